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

One stream for progress, one for errors: progress goes to stdout once per line (``ProgressFilter``: the
ServerApp's log reaches ``flwr run``'s output twice, through the log stream and through the simulation
process's own output); failures, interruptions and refusals go to stderr.

Stops: SIGINT (Ctrl-C), SIGTERM and SIGHUP all end the run the same way (``Stopped``): every process
of the run is stopped by PID, ``run.json`` says ``"status": "interrupted"`` with the signal, and the
``--resume`` command is printed; the exit status is 128 + the signal number. A run stopped before the
coordinator wrote ``run.json`` has nothing to resume and its directory is removed, as is the directory
of any start that failed before Flower ran (a config error after it was made).

Lock: ``RUN_LOCK`` in the run directory holds the PID of the ``simulate`` writing it (``RunLock``); a
second ``simulate --resume`` on it is refused naming that PID while it runs; a lock whose PID is gone
is stale and taken over with a message.

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
RUN_LOCK = "simulate.lock"  # in the run directory: {"pid", "started", "command"} of the simulate writing it
AF_UNIX_MAX = 100  # Ray's socket paths must fit in sun_path (108 bytes) with its own suffixes


class SimulationError(RuntimeError):
    """The simulation could not be started or did not complete."""


class Stopped(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived: the run is stopped like Ctrl-C (``exit_status`` = 128 + signal)."""

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_status = 128 + signum
        super().__init__(signal.Signals(signum).name)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _StopOnSignals:
    """While active, the first of ``STOP_SIGNALS`` raises ``Stopped`` in the main thread; later ones are
    ignored so that the cleanup (stopping the run's processes, a few seconds at most) is not cut short."""

    def __enter__(self):
        self.old, self.fired = {}, False
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self.old[sig] = signal.signal(sig, self._handler)
        return self

    def _handler(self, signum, _frame):
        if self.fired:
            return
        self.fired = True
        raise Stopped(signum)

    def __exit__(self, *exc):
        for sig, old in self.old.items():
            signal.signal(sig, old)
        return False


def _proc_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot, ``/proc/<pid>/stat`` field 22), or None."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _holder_alive(pid: int, start: int | None) -> bool:
    """Whether the lock holder ``pid`` still runs: it exists, is no zombie, and (when the lock recorded it)
    started when the holder did, so a PID reused by another process does not count."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != b"Z" and (start is None or _proc_start(pid) == start)


class RunLock:
    """``RUN_LOCK`` in a run directory: the PID of the one ``simulate`` writing it (module docstring)."""

    def __init__(self, run_dir: Path, say=print):
        self.path = Path(run_dir) / RUN_LOCK
        self.say = say
        self.held = False

    def holder(self) -> dict | None:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) and isinstance(data.get("pid"), int) else {"pid": -1}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"pid": -1}  # torn or foreign: treated as stale

    def acquire(self) -> None:
        body = json.dumps({"pid": os.getpid(), "proc_start": _proc_start(os.getpid()), "started": time.time(),
                           "command": sys.argv})
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                held = self.holder()
                if held is None:
                    continue  # released meanwhile
                pid = held["pid"]
                start = held.get("proc_start") if isinstance(held.get("proc_start"), int) else None
                if pid > 0 and pid != os.getpid() and _holder_alive(pid, start):
                    raise SimulationError(f"run directory {self.path.parent} is being written by `distmoe simulate` "
                                          f"PID {pid} (lock {self.path}); stop it first (kill -TERM {pid}), or wait "
                                          "for it to end") from None
                self.say(f"distmoe simulate: taking over the stale lock {self.path} of PID {pid} "
                         "(no longer running)")
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(body)
            self.held = True
            return
        raise SimulationError(f"could not take the lock {self.path}: it keeps changing (another simulate?)")

    def release(self) -> None:
        if self.held:
            held = self.holder()
            if held is not None and held.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False


class ProgressFilter:
    """The progress lines of ``flwr run``'s output, each once. The ServerApp's log arrives twice: through
    Flower's log stream (console format, ``INFO :      distmoe | ...``) and through the simulation process's
    own output (``MM/DD/YYYY HH:MM:SS:INFO:distmoe | ...``). A line is shown when it is not the pending
    copy of a line already shown from the other source; repeats within one source are all shown."""

    DATED = re.compile(r"^\d\d/\d\d/\d{4} \d\d:\d\d:\d\d:")

    def __init__(self):
        self.pending: dict[tuple[str, str], int] = {}  # (source, text) -> copies shown, not yet seen from the other

    def __call__(self, line: str) -> str | None:
        if "distmoe |" in line:
            text = line.split("distmoe | ", 1)[1].rstrip() if "distmoe | " in line else ""
        elif "distmoe client:" in line:
            text = line[line.index("distmoe client:"):].rstrip()
        else:
            return None
        src = "dated" if self.DATED.match(line) else "stream"
        other = ("stream" if src == "dated" else "dated", text)
        if self.pending.get(other, 0) > 0:
            self.pending[other] -= 1
            return None
        self.pending[(src, text)] = self.pending.get((src, text), 0) + 1
        return "  " + text


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


def processes_with_token(token: str, session: int | None = None, ray_dir: str | None = None) -> list[int]:
    """PIDs of every live process whose environment carries this run's token, or that belongs to ``session``
    (the session ``flwr run`` was started in), or whose ``RAY_TMPDIR`` is this run's own Ray directory
    (``ray_dir``: Ray's dashboard and runtime-env agents start in a session of their own with an environment
    that keeps Ray's variables but not the token; measured: both outlived a run matched by token and session).
    A zombie (exited, not yet reaped by its parent) is not listed: its ``environ`` can no longer be read (ESRCH)."""
    needles = {f"{TOKEN_ENV}={token}".encode()}
    if ray_dir:
        needles.add(f"RAY_TMPDIR={ray_dir}".encode())
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
        if needles.intersection(env.split(b"\0")) or (session is not None and sid == session):
            pids.append(int(entry.name))
    return pids


def stop_processes(token: str, grace: float = 5.0, session: int | None = None, ray_dir: str | None = None,
                   kill_wait: float = 10.0) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace`` seconds, every process of this run (``processes_with_token``), and
    SIGKILL again until none is left (at most ``kill_wait`` seconds more): a killed process stays listed until
    its exit completes, and one forked by a process of the run between the scan and that process's SIGKILL (Ray
    starts workers while it stops) is in no earlier scan. Returns the PIDs signalled."""
    pids = processes_with_token(token, session, ray_dir)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and processes_with_token(token, session, ray_dir):
        time.sleep(0.2)
    deadline = time.monotonic() + kill_wait
    while (left := processes_with_token(token, session, ray_dir)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pids += [p for p in left if p not in pids]
        time.sleep(0.05)
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
    from distmoe.data.synth import synth_tasks

    derived = None
    if opts.data is not None:
        parties = _party_dirs(opts.data.resolve())
        if opts.parties is not None and opts.parties != len(parties):
            raise SimulationError(f"--parties {opts.parties} but --data {opts.data} has {len(parties)} "
                                  "party directories")
        _check_party_count(len(parties), cfg, f"--data {opts.data}")
        held: set[str] = set()
        plain: dict[str, str] = {}  # task -> a party holding it without preference pairs
        for p in parties:  # validate every party's data (file, line, field) before anything starts
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", p.name):
                raise DataError(f"--data {opts.data}: party directory name {p.name!r} must be an identifier "
                                "(letters, digits, '-', '_'): it becomes the party's name")
            data = load_party(p, cfg.data)
            held.update(data.tasks)
            plain.update({t: p.name for t in data.tasks if not data.is_preference(t) and t not in plain})
        derived = data_schedule(overrides, sorted(held))
        if derived is not None:
            overrides["schedule.phases"] = derived
            cfg = parse_run_config(overrides)
        for ph in cfg.schedule.phases:  # every party would refuse a dpo round on instruction data
            if ph.kind == "dpo" and ph.task in plain:
                raise DataError(f"--data {opts.data}: phase 'dpo:{ph.task}' needs preference pairs, but party "
                                f"{plain[ph.task]!r} holds {ph.task}.jsonl as instruction lines (a dpo task has "
                                "lines {\"prompt\", \"chosen\", \"rejected\"})")
    else:
        parties = None
        held = set(synth_tasks(cfg.schedule.tasks))
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
    existed = run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        parties = _populate(opts, cfg, run_dir, parties, overrides, run_id)
    except BaseException:  # a failed start (a config error, a signal) leaves no half-made run directory
        _remove_run_dir(run_dir, existed)
        raise
    return run_dir, parties, overrides


def _remove_run_dir(run_dir: Path, keep_dir: bool = False) -> None:
    """Remove a run directory this start made (only its contents if it existed, empty, before)."""
    if keep_dir:
        for child in run_dir.iterdir():
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
    else:
        shutil.rmtree(run_dir, ignore_errors=True)


def _populate(opts: SimOptions, cfg, run_dir: Path, parties: list[Path] | None, overrides: dict,
              run_id: str) -> list[Path]:
    """The data (synthetic unless given), work and node directories and ``overrides.toml`` of a new run."""
    from distmoe.data.synth import synth_tasks, write_synthetic

    old_umask = os.umask(PRIVATE_UMASK)  # party files and directories are private from their creation
    try:
        (run_dir / "work").mkdir(mode=PRIVATE_DIR, exist_ok=True)
        if parties is None:
            n = opts.parties if opts.parties is not None else 3
            # party-side files live under work/ (the audit checks that nothing outside it holds party data)
            parties = write_synthetic(run_dir / "work" / "data", n, cfg.data.synth_examples, cfg.run.seed, canaries=1,
                                      tasks=synth_tasks(cfg.schedule.tasks))
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
    return parties


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
    """Run one simulation; returns (exit status, run directory). SIGINT, SIGTERM and SIGHUP stop it
    (module docstring): the exit status is then 128 + the signal number."""
    with _StopOnSignals():
        return _run(opts)


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _run(opts: SimOptions) -> tuple[int, Path]:
    say = (lambda s: print(s, flush=True)) if opts.echo else (lambda s: None)
    lock = None
    if opts.resume is not None:  # the lock first: nothing is written while another simulate holds the run
        if not Path(opts.resume).is_dir():
            raise SimulationError(f"--resume {opts.resume}: no such run directory")
        given = [flag for flag, v in (("--parties", opts.parties), ("--data", opts.data),
                                      ("--run-id", opts.run_id)) if v is not None]
        if given:
            raise SimulationError(f"--resume {opts.resume}: {', '.join(given)} come from the run being resumed")
        lock = RunLock(Path(opts.resume).resolve(), say=_err)
        lock.acquire()
        try:
            run_dir, parties, overrides = prepare_resume(opts)
        except BaseException:
            lock.release()
            raise
    else:
        run_dir, parties, overrides = prepare(opts)
        lock = RunLock(run_dir, say=_err)
        try:
            lock.acquire()
        except BaseException:
            _remove_run_dir(run_dir)
            raise
    try:
        return _run_locked(opts, run_dir, parties, overrides, say)
    finally:
        lock.release()


def _run_locked(opts: SimOptions, run_dir: Path, parties: list[Path], overrides: dict, say) -> tuple[int, Path]:
    proc = None
    try:
        privacy_check(run_dir, parties, "before the run")  # before anything trains: modes, the logging path
        cfg = parse_run_config(overrides)
        overrides_file = run_dir / ("overrides.resume.toml" if opts.resume is not None else "overrides.toml")
        port = opts.port or free_port()
        token = secrets.token_hex(8)
        cmd = [_flwr_bin(), "run", str(app_dir()), "local", "--stream",
               "--federation-config", f"num-supernodes={len(parties)} client-resources-num-cpus={opts.cpus_per_party}",
               "--run-config", str(overrides_file)]
        env, short_ray = _env(run_dir, port, token, cfg.train.threads)
    except BaseException:
        if opts.resume is None:  # a failed start leaves no half-made run directory
            _remove_run_dir(run_dir)
        raise
    n = len(parties)
    log_path = run_dir / "flower.log"
    t0 = time.monotonic()
    status = "failed"
    timed_out = False
    stop: Stopped | None = None
    progress = ProgressFilter()
    stopped: list[int] = []
    try:
        say(f"distmoe simulate: {'resuming ' if opts.resume is not None else ''}run {run_dir.name} | {n} parties "
            f"({', '.join(p.name for p in parties)}) | schedule {cfg.schedule.total_rounds} rounds | "
            f"SuperLink port {port}")
        say(f"  run directory: {run_dir}")
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
                    shown = progress(line)
                    if shown is not None:
                        say(shown)
                    rec_status = None
                    if "run completed" in line or "run FAILED" in line:
                        rec_status = _read_record(run_dir).get("status")
                    if rec_status in ("completed", "failed"):
                        break  # the ServerApp is done; do not wait for Flower's teardown chatter
            finally:
                timed_out = time.monotonic() - t0 >= opts.timeout
                timer.cancel()
        status = _read_record(run_dir).get("status", "failed")
    except Stopped as exc:
        stop = exc
    finally:
        if proc is not None:
            stopped = stop_processes(token, session=proc.pid, ray_dir=env["RAY_TMPDIR"])  # session id = its pid
            if proc.poll() is None:
                proc.kill()
        else:
            stopped = stop_processes(token, ray_dir=env["RAY_TMPDIR"])
        if short_ray is not None:
            shutil.rmtree(short_ray, ignore_errors=True)
    elapsed = time.monotonic() - t0
    session = proc.pid if proc is not None else None
    (run_dir / "simulate.json").write_text(json.dumps(
        {"token": token, "port": port, "command": cmd, "stopped_pids": stopped, "wall_s": elapsed,
         "session": session, "ray_dir": env["RAY_TMPDIR"],
         "remaining": processes_with_token(token, session, env["RAY_TMPDIR"]),
         "signal": stop.args[0] if stop is not None else None}, indent=2))
    say(f"  stopped {len(stopped)} Flower/Ray processes; wall time {elapsed:.0f} s; log: {log_path}")
    if stop is not None:
        return _interrupted(opts, run_dir, stop), run_dir
    try:  # the same checks at the end: nothing the run wrote opened a party's files to others
        privacy_check(run_dir, parties, "at the end of the run")
    except SimulationError as exc:
        _err(f"distmoe simulate: {exc}")
        return 1, run_dir
    if status != "completed":
        rec = _read_record(run_dir)
        reason = rec.get("error") or ("timed out after --timeout " f"{opts.timeout:.0f} s" if timed_out
                                      else "the Flower run ended without completing")
        _err(f"distmoe simulate: run FAILED: {reason}")
        tail = log_path.read_text().splitlines()[-15:]
        _err("  last lines of the Flower log:\n    " + "\n    ".join(tail))
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


def _interrupted(opts: SimOptions, run_dir: Path, stop: Stopped) -> int:
    """Record a run stopped by a signal (its processes are stopped already) and say how to resume it."""
    from distmoe.io import write_json_atomic

    name = stop.args[0]
    rec = _read_record(run_dir)
    if not rec.get("run_id"):  # the coordinator never wrote its record: there is nothing to resume
        if opts.resume is None:
            _remove_run_dir(run_dir)
            _err(f"distmoe simulate: stopped by {name} before the run started; nothing to resume "
                 f"({run_dir} removed)")
        else:
            _err(f"distmoe simulate: stopped by {name}; resume again with: distmoe simulate --resume {run_dir}")
        return stop.exit_status
    if rec.get("status") != "completed":  # the ServerApp died with its process: record why it stopped
        rec.update(status="interrupted", finished=time.time(),
                   error=f"stopped by {name} (distmoe simulate, PID {os.getpid()})")
        write_json_atomic(run_dir / "run.json", rec)
        _err(f"distmoe simulate: run {run_dir.name} interrupted by {name}; every process it started was "
             f"stopped. Continue it with:\n  distmoe simulate --resume {run_dir}")
    else:
        _err(f"distmoe simulate: stopped by {name} after the run completed (run.json: completed)")
    return stop.exit_status
