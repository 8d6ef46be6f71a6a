"""The local SuperLink of one simulated run, on a port that is verifiably its own.

Why: ``flwr run`` with the ``local`` connection uses *whatever* answers ``/health`` on
``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` and only starts a SuperLink when nothing does. A port chosen
as "free" (bound to port 0, then closed) can be taken by another process before the SuperLink binds
it: with two runs starting at once, the second run's ``flwr run`` then submits its run to the first
run's SuperLink, and fails ("Connection to the SuperLink is unavailable") when the first run stops
its own processes. Flower's own start also gives up after 15 s, which a loaded machine can exceed.

So ``simulate`` starts the SuperLink itself, with the command ``flwr`` would use (flwr 1.42,
``flwr/cli/local_superlink.py``) and the run's environment (its token, its ``FLWR_HOME``), and waits
until the listening socket of the chosen port belongs to a process of this run (``/proc/net/tcp`` inode
→ ``/proc/<pid>/fd``) and ``/health`` answers. Another process on the port, or a SuperLink that could not
bind it, means another port (``start_superlink``, up to ``tries``); a port given with ``--port`` that is
taken is an error naming it. Once bound, nobody else can take the port, and ``flwr run`` finds this
run's SuperLink there.

Must not: import ``flwr``, or stop a process that is not this run's.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from distmoe.simulate.processes import SimulationError

LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp


class PortTaken(SimulationError):
    """The chosen port is held by a process that is not this run's."""


def free_port(exclude: frozenset[int] = frozenset()) -> int:
    """A port the kernel reports free on 127.0.0.1 now (bound to port 0, then closed; not in ``exclude``).
    Free *now* only: :func:`start_superlink` verifies that the SuperLink, not another process, then holds it."""
    for _ in range(20):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in exclude:
            return port
    raise SimulationError(f"no free local port outside {sorted(exclude)}")


def listening_inodes(port: int) -> set[int]:
    """The socket inodes listening on TCP ``port`` (any address, IPv4 and IPv6), from ``/proc/net/tcp{,6}``."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == LISTEN and int(f[1].rsplit(":", 1)[1], 16) == port:
                out.add(int(f[9]))
    return out


def socket_holders(inodes: set[int], pids: list[int]) -> set[int]:
    """Which of ``pids`` hold one of the socket ``inodes`` open."""
    want = {f"socket:[{i}]" for i in inodes}
    found = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in want:
                    found.add(pid)
                    break
            except OSError:
                continue
    return found


def port_owner(port: int, ours: list[int]) -> str:
    """``"free"`` (nothing listens), ``"ours"`` (every listening socket is held by one of ``ours``) or
    ``"foreign"`` (something else listens on it)."""
    inodes = listening_inodes(port)
    if not inodes:
        return "free"
    held = {i for i in inodes if socket_holders({i}, ours)}
    return "ours" if held == inodes else "foreign"


def healthy(port: int, timeout: float = 2.0) -> bool:
    """Whether a SuperLink answers ``GET /health`` on ``127.0.0.1:port`` (what ``flwr run`` checks)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def superlink_command(port: int, control_port: int, flwr_home: Path) -> list[str]:
    """The command ``flwr run`` would start for the ``local`` connection (flwr 1.42), on our ports."""
    state = flwr_home / "local-superlink"
    state.mkdir(parents=True, exist_ok=True)
    return ["flower-superlink", "--insecure", "--simulation", "--isolation", "subprocess",
            "--control-api-address", f"127.0.0.1:{control_port}", "--host", "127.0.0.1", "--port", str(port),
            "--log-file", str(state / "superlink.log"), "--database", str(state / "state.db")]


def _wait_ready(proc: subprocess.Popen, port: int, ours: Callable[[], list[int]], timeout: float) -> str:
    """``"ready"`` once this run's SuperLink holds ``port`` and answers; ``"taken"`` when another process holds
    it; ``"exited"`` when the SuperLink ended without holding it; ``"timeout"``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        owner = port_owner(port, [proc.pid, *ours()])
        if owner == "foreign":
            return "taken"
        if owner == "ours" and healthy(port):
            return "ready"
        if proc.poll() is not None:
            return "taken" if port_owner(port, []) != "free" else "exited"
        time.sleep(0.2)
    return "timeout"


def _end(proc: subprocess.Popen) -> None:
    """Stop a SuperLink this module started (by its PID; its superexec child follows its parent)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def start_superlink(env: dict, flwr_home: Path, ours: Callable[[], list[int]], port: int | None = None,
                    tries: int = 5, timeout: float = 90.0, pick: Callable[..., int] = free_port,
                    say: Callable[[str], None] = lambda s: None, umask: int = -1) -> tuple[subprocess.Popen, int, int]:
    """Start this run's SuperLink on a port of its own; returns (process, HTTP port, control port).

    ``port`` (``--port``) is used as given, and an error when another process holds it; otherwise up to
    ``tries`` ports from ``pick`` are tried. ``ours`` lists the PIDs of this run's processes (its token).
    ``env`` gets ``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` / ``FLWR_LOCAL_CONTROL_API_PORT`` set to the ports used."""
    last = ""
    for attempt in range(1 if port is not None else tries):
        http = port if port is not None else pick()
        control = pick(frozenset({http}))
        if port_owner(http, []) != "free":
            last = f"port {http} is in use by another process"
        else:
            env.update(FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(http), FLWR_LOCAL_CONTROL_API_PORT=str(control))
            log = flwr_home / "local-superlink" / "superlink.log"
            proc = subprocess.Popen(superlink_command(http, control, flwr_home), env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                    umask=umask)  # the run's processes write party files private from creation
            outcome = _wait_ready(proc, http, ours, timeout)
            if outcome == "ready":
                return proc, http, control
            _end(proc)
            if outcome in ("timeout", "exited"):
                why = (f"did not become ready on port {http} within {timeout:.0f} s" if outcome == "timeout"
                       else f"exited with code {proc.returncode}")
                raise SimulationError(f"the local SuperLink {why} (log: {log})")
            last = f"port {http} was taken by another process before the SuperLink bound it"
        if port is not None:
            raise PortTaken(f"--port {port}: {last}; choose another port, or leave --port out to use a free one")
        if attempt + 1 < tries:
            say(f"distmoe simulate: {last}; trying another port ({attempt + 2}/{tries})")
    raise SimulationError(f"could not start the local SuperLink after {tries} ports: {last}")
