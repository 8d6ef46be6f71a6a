"""``distmoe simulate``'s run: Flower started, watched and stopped, and the outcome recorded.

It runs ``flwr run <app> local --stream`` with: Flower's and Ray's state inside the run directory
(``FLWR_HOME``, ``HOME``, ``TMPDIR``, ``RAY_TMPDIR``), runtime dependency installation off, telemetry off,
this run's own SuperLink started first on a port verified to be its own (``distmoe.simulate.ports``), and
an overall timeout. Every process it started carries the run's token and is stopped by PID at the end,
whatever happened (``distmoe.simulate.processes``). Progress lines (``distmoe | ...``) are shown once each
(:class:`ProgressFilter`); the full Flower log is kept in ``runs/<id>/flower.log``. The exit status is 0
only if the run record says ``completed``.

One stream for progress, one for errors: progress goes to stdout; failures, interruptions and refusals go
to stderr, each with the next step (``--resume``, or the command to retry).

A failed run: ``run.json`` says ``"status": "failed"`` with the reason (when the ServerApp died before it
could say so itself, ``simulate`` writes it; when the coordinator never wrote a record, ``simulate``
writes one with the status and reason only). Stops: SIGINT, SIGTERM and SIGHUP end the run the same way
(``Stopped``): ``run.json`` says ``"status": "interrupted"`` with the signal, the ``--resume`` command is
printed, the exit status is 128 + the signal number; a run stopped before the coordinator wrote
``run.json`` has nothing to resume and its directory is removed.

Must not: import ``flwr`` (it drives the ``flwr`` command like a user would).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from distmoe.checkpoint import disk_bytes
from distmoe.config import parse_run_config
from distmoe.rundir import RunDir, RunFileError, read_json
from distmoe.simulate.ports import start_superlink
from distmoe.simulate.prepare import (
    SimOptions,
    _remove_run_dir,
    app_dir,
    prepare,
    prepare_resume,
    privacy_check,
)
from distmoe.simulate.processes import (
    TOKEN_ENV,
    RunLock,
    SimulationError,
    StopOnSignals,
    Stopped,
    processes_with_token,
    stop_processes,
)
from distmoe.wire.at_rest import PRIVATE_UMASK

AF_UNIX_MAX = 100  # Ray's socket paths must fit in sun_path (108 bytes) with its own suffixes


class ProgressFilter:
    """The progress lines of ``flwr run``'s output, each once. The ServerApp's log arrived twice: through
    Flower's log stream (console format, ``INFO :      distmoe | ...``) and through the simulation process's
    own output (``MM/DD/YYYY HH:MM:SS:INFO:distmoe | ...``: the root handler opacus' import added, which
    ``privacy/accountant.py`` now removes, so a run shows one source). A line is shown when it is not the pending
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


def _flwr_bin() -> str:
    cand = Path(sys.executable).parent / "flwr"
    if cand.exists():
        return str(cand)
    found = shutil.which("flwr")
    if not found:
        raise SimulationError("the `flwr` command was not found (is flwr installed in this environment?)")
    return found


def _env(run_dir: Path, token: str, threads: int) -> tuple[dict, Path | None]:
    env = dict(os.environ)
    for k in [k for k in env if k.startswith(("FLWR_", "RAY_"))]:
        env.pop(k)
    files = RunDir(run_dir)
    home, tmp = files.home, files.tmp
    for d in (home, tmp):
        d.mkdir(parents=True, exist_ok=True)
    ray_dir = files.ray
    short = None
    if len(str(ray_dir)) > AF_UNIX_MAX - 60:
        # Ray's socket paths would overflow AF_UNIX: use a short private directory, removed at the end
        short = Path(tempfile.mkdtemp(prefix="dmray-"))
        ray_dir = short
    ray_dir.mkdir(parents=True, exist_ok=True)
    bindir = str(Path(sys.executable).parent)  # flower-superlink etc. live beside this interpreter
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env.update({
        TOKEN_ENV: token, "FLWR_HOME": str(files.flwr_home), "HOME": str(home), "TMPDIR": str(tmp),
        "RAY_TMPDIR": str(ray_dir), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(home / "hf"),
        "HF_DATASETS_CACHE": str(home / "hf" / "datasets"), "MPLCONFIGDIR": str(home / "mpl"),
        "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
        "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
    })
    return env, short


def _read_record(run_dir: Path) -> dict:
    try:
        return read_json(RunDir(run_dir).record, "the run record", obj=True)
    except RunFileError:
        return {}


def run(opts: SimOptions) -> tuple[int, Path]:
    """Run one simulation; returns (exit status, run directory). SIGINT, SIGTERM and SIGHUP stop it
    (module docstring): the exit status is then 128 + the signal number."""
    with StopOnSignals():
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
        overrides_file = RunDir(run_dir).overrides(resume=opts.resume is not None)
        token = secrets.token_hex(8)
        cmd = [_flwr_bin(), "run", str(app_dir()), "local", "--stream",
               "--federation-config", f"num-supernodes={len(parties)} client-resources-num-cpus={opts.cpus_per_party}",
               "--run-config", str(overrides_file)]
        env, short_ray = _env(run_dir, token, cfg.train.threads)
    except BaseException:
        if opts.resume is None:  # a failed start leaves no half-made run directory
            _remove_run_dir(run_dir)
        raise
    n = len(parties)
    log_path = RunDir(run_dir).flower_log
    t0 = time.monotonic()
    status = "failed"
    timed_out = False
    stop: Stopped | None = None
    start_error: SimulationError | None = None
    progress = ProgressFilter()
    stopped: list[int] = []
    port = opts.port
    try:
        say(f"distmoe simulate: {'resuming ' if opts.resume is not None else ''}run {run_dir.name} | {n} parties "
            f"({', '.join(p.name for p in parties)}) | schedule {cfg.schedule.total_rounds} rounds")
        say(f"  privacy mode: {_privacy_mode(cfg)}")  # once here: the round lines do not repeat it
        say(f"  run directory: {run_dir}")
        _, port, _ = start_superlink(env, RunDir(run_dir).flwr_home, lambda: processes_with_token(token),
                                     port=opts.port, say=_err, umask=PRIVATE_UMASK)
        say(f"  SuperLink: 127.0.0.1:{port} (this run's own)")
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
    except SimulationError as exc:  # the SuperLink could not be started: Flower never ran
        start_error = exc
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
    if start_error is not None:
        return _failed_start(opts, run_dir, start_error), run_dir
    RunDir(run_dir).simulate_record.write_text(json.dumps(
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
        return _failed(opts, run_dir, log_path, timed_out), run_dir
    from distmoe.party.retention import drop_pretask  # (torch) only once a run completed

    # each party's pre-task copy (distillation)
    freed = sum(drop_pretask(RunDir(run_dir).party(p.name).root) for p in parties)
    if opts.report:
        os.environ.setdefault("MPLCONFIGDIR", str(RunDir(run_dir).home / "mpl"))  # no font cache in ~
        from distmoe.report.report import write_report

        path = write_report(run_dir)
        say(f"  report: {path}")
        if cfg.report.tensorboard:
            from distmoe.report.tensorboard import write_tensorboard

            tb = write_tensorboard(run_dir)
            say(f"  tensorboard: {tb} (view: tensorboard --logdir {tb})")
    say(f"  disk: the run keeps {_size_text(disk_bytes(run_dir))} in {run_dir} (each file once"
        + (f"; the parties' pre-task copies, {_size_text(freed)}, removed once the run completed)" if freed else ")"))
    return 0, run_dir


def _privacy_mode(cfg) -> str:
    """The privacy mode in a few words, said once in the run's header (the round lines do not repeat it)."""
    if not cfg.privacy.secure:
        return "PLAINTEXT (no secure aggregation, no DP)"
    dp = " + client-level DP" if cfg.privacy.update_noise_multiplier > 0 else ""
    return f"secagg{dp} (only sums leave the parties)"


def _size_text(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.0f} kB"


def retry_command(opts: SimOptions) -> str:
    """The command that starts this run again: the one the user typed (``distmoe simulate ...``), else a
    description of it (a run started from Python)."""
    if opts.resume is not None:
        return f"distmoe simulate --resume {Path(opts.resume).resolve()}"
    argv = sys.argv[1:]
    if Path(sys.argv[0]).name in ("distmoe", "cli.py", "__main__.py") and argv[:1] == ["simulate"]:
        again = " (with a new --run-id, or after removing the failed run's directory)" if "--run-id" in argv else ""
        return "distmoe " + shlex.join(argv) + again
    return "the same `distmoe simulate` command"


def _failed_start(opts: SimOptions, run_dir: Path, exc: SimulationError) -> int:
    """The SuperLink could not be started: nothing ran; a new run's directory is removed; say what to do."""
    if opts.resume is None:
        _remove_run_dir(run_dir)
    _err(f"distmoe simulate: the run could not start: {exc}\n  nothing ran"
         + (f" ({run_dir} removed)" if opts.resume is None else "") + f"; retry with:\n  {retry_command(opts)}")
    return 1


FLOWER_ERROR = re.compile(r"(Connection to the SuperLink is unavailable|[A-Za-z]*Error: .*|Failed to start .*)")


def flower_reason(log_path: Path) -> str:
    """The last Flower error in the log (e.g. Flower's box "Connection to the SuperLink is unavailable"), or ''."""
    try:
        tail = log_path.read_text(errors="replace").splitlines()[-60:]
    except OSError:
        return ""
    for line in reversed(tail):
        m = FLOWER_ERROR.search(line.strip(" │|\t"))
        if m:
            return m.group(1).strip()[:200]
    return ""


def _failed(opts: SimOptions, run_dir: Path, log_path: Path, timed_out: bool) -> int:
    """A run that ended without completing: ``run.json`` says ``failed`` with the reason (written here when
    the ServerApp could not write it itself), the Flower log's tail, and the next step."""
    from distmoe.io import write_json_atomic

    rec = _read_record(run_dir)
    flower = flower_reason(log_path)
    reason = rec.get("error") or (f"timed out after --timeout {opts.timeout:.0f} s" if timed_out else
                                  "the Flower run ended without completing"
                                  + (f" (Flower: {flower})" if flower else ""))
    if rec.get("status") != "failed" or not rec.get("error"):
        rec.update(status="failed", finished=time.time(), error=reason)
        write_json_atomic(RunDir(run_dir).record, rec)
    _err(f"distmoe simulate: run FAILED: {reason}")
    tail = log_path.read_text(errors="replace").splitlines()[-15:] if log_path.exists() else []
    _err("  last lines of the Flower log:\n    " + "\n    ".join(tail))
    if rec.get("run_id") and RunDir(run_dir).checkpoints.is_dir():
        _err(f"  continue it from its last good checkpoint with:\n  distmoe simulate --resume {run_dir}")
    else:
        _err(f"  nothing to resume (no checkpoint); retry with:\n  {retry_command(opts)}")
    return 1


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
        write_json_atomic(RunDir(run_dir).record, rec)
        _err(f"distmoe simulate: run {run_dir.name} interrupted by {name}; every process it started was "
             f"stopped. Continue it with:\n  distmoe simulate --resume {run_dir}")
    else:
        _err(f"distmoe simulate: stopped by {name} after the run completed (run.json: completed)")
    return stop.exit_status
