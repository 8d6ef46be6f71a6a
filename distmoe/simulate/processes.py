"""The processes of one simulated run: stopping them by PID, the run-directory lock, and stop signals.

Every process a run starts (the detached local SuperLink, its superexec, the simulation process, Ray) carries
a per-run token (``TOKEN_ENV``) in its environment; :func:`processes_with_token` finds them (also by the
session ``flwr run`` was started in, and by the run's own Ray directory), :func:`stop_processes` stops them
by PID. ``RUN_LOCK`` in the run directory holds the PID of the ``simulate`` writing it (:class:`RunLock`).
SIGINT, SIGTERM and SIGHUP raise :class:`Stopped` in the main thread (:class:`StopOnSignals`).

Must not: import ``flwr``, or signal a process that carries neither the run's token nor its session and holds
nothing open in the run's own Ray directory.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from distmoe.rundir import RunDir
from distmoe.rundir.layout import SIMULATE_LOCK

TOKEN_ENV = "DISTMOE_RUN_TOKEN"
RUN_LOCK = SIMULATE_LOCK  # in the run directory: {"pid", "started", "command"} of the simulate writing it


class SimulationError(RuntimeError):
    """The simulation could not be started or did not complete."""


class Stopped(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived: the run is stopped like Ctrl-C (``exit_status`` = 128 + signal)."""

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_status = 128 + signum
        super().__init__(signal.Signals(signum).name)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopOnSignals:
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
        self.path = RunDir(run_dir).lock
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


def _session_of(stat: bytes) -> int:
    """The session id in a ``/proc/<pid>/stat`` line (fields after the parenthesised command name)."""
    return int(stat[stat.rindex(b")") + 2:].split()[3])


def processes_with_token(token: str, session: int | None = None, ray_dir: str | None = None) -> list[int]:
    """PIDs of every live process whose environment carries this run's token, or that belongs to ``session``
    (the session ``flwr run`` was started in), or whose ``RAY_TMPDIR`` is this run's own Ray directory
    (``ray_dir``: Ray's dashboard and runtime-env agents start in a session of their own with an environment
    that keeps Ray's variables but not the token; measured: both outlived a run matched by token and session).
    A process holding a file open under ``ray_dir`` is listed too: measured, Ray's dashboard and runtime-env agents
    can also start with an environment of only ``RAY_CLIENT_MODE`` in a session of the simulation process's, and
    are re-parented to PID 1 when the raylet dies; their logs under the run's Ray directory identify them.
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
        if (needles.intersection(env.split(b"\0")) or (session is not None and sid == session)
                or (ray_dir and _holds_file_under(entry, ray_dir))):
            pids.append(int(entry.name))
    return pids


def _holds_file_under(proc: Path, directory: str) -> bool:
    """Whether the process at ``/proc/<pid>`` (``proc``) has a file open under ``directory`` or runs in it."""
    prefix = os.path.join(os.path.realpath(directory), "")
    try:
        if os.path.join(os.readlink(proc / "cwd"), "").startswith(prefix):
            return True
        return any(os.readlink(fd).startswith(prefix) for fd in (proc / "fd").iterdir())
    except OSError:  # gone meanwhile, or not ours to read
        return False


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
