"""``distmoe simulate``: a whole federated run on Flower's Simulation Engine, owned end to end.

It validates the configuration and the party data first (with ``--data`` and no schedule set, it
derives the schedule from the data's tasks, :func:`data_schedule`, and prints it), creates ``runs/<id>/``, writes the
default synthetic data when none is given, writes one node file per virtual SuperNode (so each
one sees only its own party directory), and then runs ``flwr run <app> local --stream`` with:
Flower's and Ray's state inside the run directory (``FLWR_HOME``, ``HOME``, ``TMPDIR``,
``RAY_TMPDIR``), runtime dependency installation off, telemetry off, its own SuperLink port, and
an overall timeout. Every process it started (the detached local SuperLink, its superexec, the
simulation process and Ray) carries a per-run token in its environment and is stopped by PID at
the end, whatever happened. Progress lines (``distmoe | ...``) are shown; the full Flower log is
kept in ``runs/<id>/flower.log``. The exit status is 0 only if the run record says ``completed``.

``--resume RUN_DIR`` (``SimOptions.resume``) continues an interrupted run in its own directory: the same
party data, node files and ``overrides.toml``, plus any new overrides, with ``run.resume`` set. It is
refused before Flower starts when the run already completed or a key that matters changed
(``distmoe.coordinator.check_resumable``); ``--parties``, ``--data`` and ``--run-id`` come from the run
and may not be given. The Flower log is appended to, after a ``resume`` marker line.

Must not: import ``flwr`` (it drives the ``flwr`` command like a user would).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from distmoe.config import (
    ConfigError,
    continual_schedule,
    load_override_file,
    parse_run_config,
    schedule_text,
    to_toml,
)
from distmoe.data.formats import DataError
from distmoe.data.party import load_party
from distmoe.wire.at_rest import PRIVATE_DIR, PRIVATE_UMASK, PreflightError, make_private, privacy_preflight

TOKEN_ENV = "DISTMOE_RUN_TOKEN"
AF_UNIX_MAX = 100  # Ray's socket paths must fit in sun_path (108 bytes) with its own suffixes


class SimulationError(RuntimeError):
    """The simulation could not be started or did not complete."""


@dataclass(frozen=True)
class SimOptions:
    overrides: dict
    parties: int | None = None
    data: Path | None = None
    run_id: str | None = None
    runs_dir: Path = Path("runs")
    port: int | None = None
    timeout: float = 3600.0
    report: bool = True
    echo: bool = True
    cpus_per_party: int = 1
    resume: Path | None = None  # an interrupted run directory to continue


def app_dir() -> Path:
    """The Flower app directory (the source checkout holding pyproject.toml)."""
    root = Path(__file__).resolve().parent.parent
    pp = root / "pyproject.toml"
    if not pp.exists() or "[tool.flwr.app]" not in pp.read_text():
        raise SimulationError(f"the Flower app (pyproject.toml with [tool.flwr.app]) was not found at {root}; "
                              "install distmoe from its source checkout with `pip install -e .`")
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flwr_bin() -> str:
    cand = Path(sys.executable).parent / "flwr"
    if cand.exists():
        return str(cand)
    found = shutil.which("flwr")
    if not found:
        raise SimulationError("the `flwr` command was not found (is flwr installed in this environment?)")
    return found


def _party_dirs(data: Path) -> list[Path]:
    """Every subdirectory of ``--data`` is a party (hidden ones aside); ``load_party`` then names one without
    ``*.jsonl`` files instead of it being skipped silently."""
    if not data.is_dir():
        raise DataError(f"--data {data}: not a directory" if data.exists() else f"--data {data}: no such directory")
    if any(f.is_file() for f in data.glob("*.jsonl")):
        raise DataError(f"--data {data}: holds <task>.jsonl files itself (one party's directory?); simulate needs "
                        "one subdirectory per party: DIR/<party>/<task>.jsonl")
    dirs = sorted(p for p in data.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not dirs:
        raise DataError(f"--data {data}: no party subdirectories (expected DIR/<party>/<task>.jsonl)")
    return dirs


def _check_party_count(n: int, cfg, what: str) -> None:
    """One message when there are fewer parties than any release may be aggregated over."""
    if cfg.privacy.secure and n < cfg.privacy.min_parties:
        raise ConfigError(f"{what}: {n} part{'y' if n == 1 else 'ies'}, but a federated run needs at least "
                          f"privacy.min-parties = {cfg.privacy.min_parties} (secure aggregation never releases "
                          f"fewer parties' figures); use {cfg.privacy.min_parties} parties or more")


def data_schedule(overrides: dict, held: list[str]) -> str | None:
    """The schedule derived from the tasks of the user's data when none is set (``config.continual_schedule``
    over ``held`` in name order), or None when ``schedule.phases`` is set."""
    if "schedule.phases" in overrides:
        return None
    return continual_schedule(sorted(held))


def _session_of(stat: bytes) -> int:
    """The session id in a ``/proc/<pid>/stat`` line (fields after the parenthesised command name)."""
    return int(stat[stat.rindex(b")") + 2:].split()[3])


def processes_with_token(token: str, session: int | None = None) -> list[int]:
    """PIDs of every process whose environment carries this run's token, or that belongs to ``session``
    (the session ``flwr run`` was started in: Ray's dashboard and runtime-env agents keep it but start
    with an environment of their own, which their process title may overwrite)."""
    needle = f"{TOKEN_ENV}={token}".encode()
    me = os.getpid()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            env = (entry / "environ").read_bytes()
            sid = _session_of((entry / "stat").read_bytes()) if session is not None else None
        except (OSError, ValueError, IndexError):
            continue
        if needle in env.split(b"\0") or (session is not None and sid == session):
            pids.append(int(entry.name))
    return pids


def stop_processes(token: str, grace: float = 5.0, session: int | None = None) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace`` seconds, every process of this run (``processes_with_token``).
    Returns the PIDs."""
    pids = processes_with_token(token, session)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and processes_with_token(token, session):
        time.sleep(0.2)
    for pid in processes_with_token(token, session):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def _check_tensorboard(cfg, opts: SimOptions) -> None:
    """``report.tensorboard = true`` without the ``tensorboard`` package: a config error before anything starts."""
    if cfg.report.tensorboard and opts.report:
        from distmoe.report.tensorboard import TensorBoardMissing, require

        try:
            require()
        except TensorBoardMissing as exc:
            raise ConfigError(f"config key 'report.tensorboard': value true: {exc}") from None


def prepare(opts: SimOptions) -> tuple[Path, list[Path], dict]:
    """Validate, create the run directory, data and node files; return (run_dir, party_dirs, overrides)."""
    overrides = dict(opts.overrides)
    cfg = parse_run_config(overrides)  # fail before anything is created
    _check_tensorboard(cfg, opts)
    run_id = opts.run_id or time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
    run_dir = (opts.runs_dir / run_id).resolve()
    if run_dir.exists() and any(run_dir.iterdir()):
        raise SimulationError(f"run directory {run_dir} already exists and is not empty")
    from distmoe.data.synth import TASK_FAMILIES, write_synthetic

    derived = None
    if opts.data is not None:
        parties = _party_dirs(opts.data.resolve())
        if opts.parties is not None and opts.parties != len(parties):
            raise SimulationError(f"--parties {opts.parties} but --data {opts.data} has {len(parties)} "
                                  "party directories")
        _check_party_count(len(parties), cfg, f"--data {opts.data}")
        held: set[str] = set()
        for p in parties:  # validate every party's data (file, line, field) before anything starts
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", p.name):
                raise DataError(f"--data {opts.data}: party directory name {p.name!r} must be an identifier "
                                "(letters, digits, '-', '_'): it becomes the party's name")
            held.update(load_party(p, cfg.data).tasks)
        derived = data_schedule(overrides, sorted(held))
        if derived is not None:
            overrides["schedule.phases"] = derived
            cfg = parse_run_config(overrides)
    else:
        parties = None
        held = set(TASK_FAMILIES)
        _check_party_count(opts.parties if opts.parties is not None else 3, cfg,
                           f"--parties {opts.parties}" if opts.parties is not None else "the default")
    missing = [t for t in cfg.schedule.tasks if t not in held]
    if missing:
        hint = "; with --data, leave the schedule unset to derive it from the data's tasks" if opts.data else ""
        raise ConfigError(f"config key 'schedule.phases': task(s) {', '.join(missing)} are held by no "
                          f"party (tasks available: {', '.join(sorted(held))}){hint}")
    from distmoe.privacy.plan import plan_privacy

    plan_privacy(cfg.privacy, cfg.schedule)  # the budget must cover the schedule's releases (ConfigError)
    if derived is not None and opts.echo:
        print(f"distmoe simulate: schedule derived from the tasks in --data ({', '.join(sorted(held))}; name "
              f"order, set it with --schedule): {schedule_text(cfg.schedule)}", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    old_umask = os.umask(PRIVATE_UMASK)  # party files and directories are private from their creation
    try:
        (run_dir / "work").mkdir(mode=PRIVATE_DIR, exist_ok=True)
        if parties is None:
            n = opts.parties if opts.parties is not None else 3
            # party-side files live under work/ (the audit checks that nothing outside it holds party data)
            parties = write_synthetic(run_dir / "work" / "data", n, cfg.data.synth_examples, cfg.run.seed, canaries=1)
            make_private(run_dir / "work")  # whatever the writers' own modes were
        for p in parties:
            (run_dir / "work" / p.name).mkdir(mode=PRIVATE_DIR, exist_ok=True)
    finally:
        os.umask(old_umask)
    nodes = run_dir / "nodes"
    nodes.mkdir(exist_ok=True)
    for i, p in enumerate(parties):
        name = p.name
        (nodes / f"node-{i}.toml").write_text(
            f'data-path = "{p.resolve()}"\nparty-name = "{name}"\nwork-dir = "{run_dir / "work" / name}"\n'
            # the Simulation Engine keeps each party's process, and its loaded base, across messages: no mapped copy
            'base-cache = "off"\n')
    overrides["run.dir"] = str(run_dir)
    overrides["sim.nodes-dir"] = str(nodes)
    overrides.setdefault("run.name", run_id)
    overrides.setdefault("federation.min-available", len(parties))
    if int(overrides["federation.min-available"]) > len(parties):
        raise ConfigError(f"config key 'federation.min-available': value {overrides['federation.min-available']} "
                          f"exceeds the number of parties ({len(parties)})")
    parse_run_config(overrides)
    (run_dir / "overrides.toml").write_text(to_toml(overrides))
    return run_dir, parties, overrides


def prepare_resume(opts: SimOptions) -> tuple[Path, list[Path], dict]:
    """The interrupted run's directory, party directories and overrides (+ new ones, + ``run.resume``),
    after checking that it may resume; nothing is written before the checks pass."""
    import tomllib

    run_dir = Path(opts.resume).resolve()
    given = [flag for flag, v in (("--parties", opts.parties), ("--data", opts.data), ("--run-id", opts.run_id))
             if v is not None]
    if given:
        raise SimulationError(f"--resume {opts.resume}: {', '.join(given)} come from the run being resumed")
    if not run_dir.is_dir():
        raise SimulationError(f"--resume {opts.resume}: no such run directory")
    ov_path = run_dir / "overrides.toml"
    if not ov_path.is_file():
        raise SimulationError(f"--resume {opts.resume}: {ov_path} not found: not a `distmoe simulate` run directory")
    try:
        overrides = load_override_file(ov_path)
    except ConfigError as exc:
        raise SimulationError(f"--resume {opts.resume}: {exc}") from None
    overrides = {**overrides, **opts.overrides, "run.resume": str(run_dir), "run.dir": str(run_dir)}
    cfg = parse_run_config(overrides)
    _check_tensorboard(cfg, opts)
    from distmoe.coordinator import RunFailed, check_resumable

    try:
        check_resumable(run_dir, cfg)
    except RunFailed as exc:
        raise SimulationError(f"--resume {opts.resume}: {exc}") from None
    node_files = sorted((run_dir / "nodes").glob("node-*.toml"))
    if not node_files:
        raise SimulationError(f"--resume {opts.resume}: no node files in {run_dir / 'nodes'}")
    parties = []
    for nf in node_files:
        try:
            parties.append(Path(tomllib.loads(nf.read_text())["data-path"]))
        except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
            raise SimulationError(f"--resume {opts.resume}: node file {nf} is unreadable: {exc}") from None
    (run_dir / "overrides.resume.toml").write_text(to_toml(overrides))
    return run_dir, parties, overrides


def party_dirs(run_dir: Path, parties: list[Path]) -> dict[str, list[Path]]:
    """Each party's private directories: its data (copy) and its work directory."""
    return {p.name: [p, run_dir / "work" / p.name] for p in parties}


def privacy_check(run_dir: Path, parties: list[Path], when: str) -> None:
    """The pre-run / end-of-run privacy check (``distmoe.wire.at_rest``) as a :class:`SimulationError`."""
    try:
        privacy_preflight(party_dirs(run_dir, parties), when=when)
    except PreflightError as exc:
        raise SimulationError(str(exc)) from None


def _env(run_dir: Path, port: int, token: str, threads: int) -> tuple[dict, Path | None]:
    env = dict(os.environ)
    for k in [k for k in env if k.startswith(("FLWR_", "RAY_"))]:
        env.pop(k)
    home = run_dir / "home"
    tmp = run_dir / "tmp"
    for d in (home, tmp):
        d.mkdir(parents=True, exist_ok=True)
    ray_dir = run_dir / "ray"
    short = None
    if len(str(ray_dir)) > AF_UNIX_MAX - 60:
        # Ray's socket paths would overflow AF_UNIX: use a short private directory, removed at the end
        short = Path(tempfile.mkdtemp(prefix="dmray-"))
        ray_dir = short
    ray_dir.mkdir(parents=True, exist_ok=True)
    bindir = str(Path(sys.executable).parent)  # flower-superlink etc. live beside this interpreter
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env.update({
        TOKEN_ENV: token, "FLWR_HOME": str(run_dir / "flwr"), "HOME": str(home), "TMPDIR": str(tmp),
        "RAY_TMPDIR": str(ray_dir), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(port), "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(home / "hf"),
        "HF_DATASETS_CACHE": str(home / "hf" / "datasets"), "MPLCONFIGDIR": str(home / "mpl"),
        "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
        "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
    })
    return env, short


def _read_record(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def run(opts: SimOptions) -> tuple[int, Path]:
    """Run one simulation; returns (exit status, run directory)."""
    run_dir, parties, overrides = prepare_resume(opts) if opts.resume is not None else prepare(opts)
    privacy_check(run_dir, parties, "before the run")  # before anything trains: modes, the logging path
    cfg = parse_run_config(overrides)
    overrides_file = run_dir / ("overrides.resume.toml" if opts.resume is not None else "overrides.toml")
    port = opts.port or free_port()
    token = secrets.token_hex(8)
    env, short_ray = _env(run_dir, port, token, cfg.train.threads)
    n = len(parties)
    cmd = [_flwr_bin(), "run", str(app_dir()), "local", "--stream",
           "--federation-config", f"num-supernodes={n} client-resources-num-cpus={opts.cpus_per_party}",
           "--run-config", str(overrides_file)]
    say = (lambda s: print(s, flush=True)) if opts.echo else (lambda s: None)
    say(f"distmoe simulate: {'resuming ' if opts.resume is not None else ''}run {run_dir.name} | {n} parties "
        f"({', '.join(p.name for p in parties)}) | schedule {cfg.schedule.total_rounds} rounds | SuperLink port {port}")
    say(f"  run directory: {run_dir}")
    log_path = run_dir / "flower.log"
    t0 = time.monotonic()
    status = "failed"
    timed_out = False
    try:
        with log_path.open("a" if opts.resume is not None else "w") as log:
            if opts.resume is not None:
                log.write(f"---- distmoe simulate --resume {run_dir} at {time.strftime('%Y-%m-%d %H:%M:%S')} ----\n")
            proc = subprocess.Popen(cmd, env=env, cwd=str(run_dir), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, bufsize=1,
                                    start_new_session=True, umask=PRIVATE_UMASK)
            timer = threading.Timer(opts.timeout, lambda: proc.kill())
            timer.start()
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    log.write(line)
                    log.flush()
                    if "distmoe |" in line:
                        say("  " + line.split("distmoe | ", 1)[1].rstrip())
                    elif "distmoe client:" in line:
                        say("  " + line.strip())
                    rec_status = None
                    if "run completed" in line or "run FAILED" in line:
                        rec_status = _read_record(run_dir).get("status")
                    if rec_status in ("completed", "failed"):
                        break  # the ServerApp is done; do not wait for Flower's teardown chatter
            finally:
                timed_out = time.monotonic() - t0 >= opts.timeout
                timer.cancel()
        status = _read_record(run_dir).get("status", "failed")
    finally:
        stopped = stop_processes(token, session=proc.pid)  # start_new_session: its session id is its pid
        if proc.poll() is None:
            proc.kill()
        if short_ray is not None:
            shutil.rmtree(short_ray, ignore_errors=True)
    elapsed = time.monotonic() - t0
    (run_dir / "simulate.json").write_text(json.dumps(
        {"token": token, "port": port, "command": cmd, "stopped_pids": stopped, "wall_s": elapsed,
         "session": proc.pid, "remaining": processes_with_token(token, proc.pid)}, indent=2))
    say(f"  stopped {len(stopped)} Flower/Ray processes; wall time {elapsed:.0f} s; log: {log_path}")
    try:  # the same checks at the end: nothing the run wrote opened a party's files to others
        privacy_check(run_dir, parties, "at the end of the run")
    except SimulationError as exc:
        say(f"distmoe simulate: {exc}")
        return 1, run_dir
    if status != "completed":
        rec = _read_record(run_dir)
        reason = rec.get("error") or ("timed out after --timeout " f"{opts.timeout:.0f} s" if timed_out
                                      else "the Flower run ended without completing")
        say(f"distmoe simulate: run FAILED: {reason}")
        tail = log_path.read_text().splitlines()[-15:]
        say("  last lines of the Flower log:\n    " + "\n    ".join(tail))
        return 1, run_dir
    if opts.report:
        os.environ.setdefault("MPLCONFIGDIR", str(run_dir / "home" / "mpl"))  # no font cache in ~
        from distmoe.report.report import write_report

        path = write_report(run_dir)
        say(f"  report: {path}")
        if cfg.report.tensorboard:
            from distmoe.report.tensorboard import write_tensorboard

            say(f"  tensorboard: {write_tensorboard(run_dir)} (view: tensorboard --logdir {run_dir / 'tensorboard'})")
    return 0, run_dir
