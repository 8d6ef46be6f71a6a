"""The data owner's warm ClientApp worker: Flower's per-message ``flwr-clientapp`` process without the cold start.

flwr 1.42's SuperExec starts one ``flwr-clientapp --runtime-api-address A --token T ...`` process per message
(``supercore/superexec/executor/subprocess_executor.py``), so every message stage of a round pays a fresh
Python with flwr, torch, transformers and distmoe imported (7-12 s on a loaded 2-core machine). With the code
pin, that process is the owner's launcher (``<pin-dir>/bin/flwr-clientapp``), which runs this module:

- **client** (what the SuperExec starts, light: no flwr, no torch): connects to the warm worker of this
  SuperNode (one Unix socket per Runtime API address, in ``<pin-dir>/warm/``, a 0700 directory of the owner;
  the worker serves only peers of its own uid), starting it on first use, and hands it its arguments, its
  working directory and its stdin/stdout/stderr (``SCM_RIGHTS``); it then waits for the child's exit status
  and exits with it, forwarding SIGTERM/SIGINT to the child. When no worker can be started it runs the cold
  path itself (:mod:`clients.pinned` in this process).
- **worker** (``--serve``): checks the owner's install against the pin, imports flwr's ClientApp runtime and
  the party side (``clients.app``, the party's work, torch, transformers, peft) once, and then **forks one
  child per message**. The child runs exactly the cold path, :func:`clients.pinned.main`: the bundle is
  checked against the pin before anything of it is installed or loaded, then Flower's ``run_clientapp``
  serves the one task of the token. The worker runs no torch operation (a forked child starts with no
  thread pool to inherit) and keeps no per-message state: each message still runs in a fresh process whose
  memory is gone when it has replied, and the party saves its state to its work directory before replying
  (a crash loses nothing, as before). The base is memory-mapped from the party's base cache in each child
  (the page cache keeps one copy between messages). It exits when the SuperExec that first started it is gone.

Why the code pin still holds: the worker imports only the owner's install, after checking it against the
pin; each child re-checks the install on disk and the bundle's bytes before Flower installs or loads the
bundle (``clients.pinned.checked_installer``), and Flower's loader takes ``clients.app`` from the modules the
worker imported (``flwr.supercore.object_ref.load_app`` reuses ``sys.modules``), never from the bundle.

Must not: run any torch work or import anything of a bundle in the worker, serve a peer of another uid, or
keep anything of one message for the next.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import struct
import sys

# The launcher (what the SuperExec starts for every message) imports only the modules above: a Python start-up
# pays for each module it imports, and on this path every message pays that start-up. Everything else (the worker's
# and the worker start's modules: pathlib, json, subprocess, traceback, ...) is imported where it is used.

WARM_DIR = "warm"  # under the pin directory (0700, the owner's)
START_TIMEOUT_S = 30.0  # for the worker to listen (it listens before its imports; requests wait in the backlog)
TICK_S = 0.05  # the worker's loop: reap children, check its SuperExec
STARTS_LOG = "starts.log"  # one line per worker start (pid, address): how often the imports were paid
PRELOAD = ("torch", "transformers", "peft", "flwr.supernode.cli.flwr_clientapp", "flwr.supernode.runtime.run_clientapp",
           "clients.pinned", "clients.app", "distmoe.party.work", "distmoe.party.dpo_work", "distmoe.model.build",
           "distmoe.model.base", "distmoe.model.trainable", "distmoe.model.expert_lora", "distmoe.train.sft",
           "distmoe.train.evaluate", "distmoe.rl.grpo", "distmoe.rl.dpo")


def arg_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def socket_name(runtime_address: str) -> str:
    """The worker's socket file for one SuperNode (its Runtime API address), short enough for ``AF_UNIX``."""
    return hashlib.sha256(runtime_address.encode()).hexdigest()[:16] + ".sock"


def warm_dir(pin_file: str | os.PathLike[str]) -> str:
    d = os.path.join(os.path.dirname(os.fspath(pin_file)), WARM_DIR)
    os.makedirs(d, mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)
    return d


# --------------------------------------------------------------------------------------------- client
def _connect(name: str) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(name)  # relative to the warm directory (the process's cwd here)
        return s
    except OSError:
        s.close()
        return None


def _start_worker(pin_file: str | os.PathLike[str], name: str, parent_pid: str | None) -> socket.socket | None:
    """Start this SuperNode's worker (under a lock, so concurrent launchers start one) and connect to it."""
    import contextlib
    import fcntl
    import subprocess
    import time

    with open(name + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sock = _connect(name)
        if sock is not None:
            return sock
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)  # a worker that died left it
        argv = [sys.executable, "-P", "-m", "clients.warm", "--serve", "--code-pin", str(pin_file), "--socket", name]
        proc = subprocess.Popen(argv + (["--parent-pid", parent_pid] if parent_pid else []),
                                stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            sock = _connect(name)
            if sock is not None:
                return sock
            time.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
        return None


def prestart(pin_file: str | os.PathLike[str], runtime_address: str) -> bool:
    """Start the worker of the SuperNode at ``runtime_address`` now (``clients.supernode``, as the SuperNode starts,
    so the first message does not wait for the imports); it exits with the calling process. True if it listens."""
    cwd = os.getcwd()
    os.chdir(warm_dir(pin_file))
    try:
        sock = _start_worker(pin_file, socket_name(runtime_address), str(os.getpid()))
    finally:
        os.chdir(cwd)
    if sock is not None:
        sock.close()
    return sock is not None


def request(cwd: str, args: list[str]) -> bytes:
    """A launcher's request as the worker reads it (``_receive``): its length, then the working directory and the
    arguments, NUL-separated (no path or argument can hold a NUL; no JSON: its import is most of a launcher's)."""
    data = b"\0".join(os.fsencode(a) for a in [cwd, *args])
    return struct.pack("!I", len(data)) + data


def launch(pin_file: str | os.PathLike[str], args: list[str]) -> int:
    """What the SuperExec starts: have this SuperNode's warm worker serve ``args`` in a forked child."""
    cwd = os.getcwd()
    address = arg_value(args, "--runtime-api-address") or "default"
    os.chdir(warm_dir(pin_file))
    name = socket_name(address)
    sock = _connect(name) or _start_worker(pin_file, name, arg_value(args, "--parent-pid"))
    os.chdir(cwd)
    if sock is None:
        print("distmoe warm worker: could not start; serving this message in a cold process", file=sys.stderr)
        from clients import pinned

        pinned.main(["--code-pin", str(pin_file), *args])
        return 0
    socket.send_fds(sock, [request(cwd, args)], [0, 1, 2])
    reader = sock.makefile("r")
    child = int(reader.readline().split()[1])  # "pid N"

    def forward(signum, _frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    line = reader.readline()  # "exit C" when the child is done; empty if the worker died
    return int(line.split()[1]) if line.startswith("exit ") else 1


# --------------------------------------------------------------------------------------------- worker
def _preload(pin_file: str | os.PathLike[str]) -> None:
    """The owner's install against the pin first (nothing of it imported if it differs), then the imports."""
    from clients import pinned
    from distmoe.deploy import pin as code_pin

    problems = pinned.install_problems(code_pin.load_pin(pin_file))
    if problems:  # each child refuses every bundle (clients.pinned): import nothing of the party side here
        print(f"distmoe warm worker: the installed party code differs from the pin ({problems[0]}); "
              "every message will be refused", file=sys.stderr, flush=True)
        return
    for mod in PRELOAD:
        try:
            __import__(mod)
        except ImportError as exc:  # an optional extra (e.g. peft) not installed: the child imports what it needs
            print(f"distmoe warm worker: not preloaded {mod}: {exc}", file=sys.stderr, flush=True)


def ready_to_fork() -> None:
    """Freeze the worker's objects (``gc.freeze``: the preloaded modules', some 600,000 with torch and transformers)
    out of the garbage collector's reach. A forked child shares the worker's memory until it writes to it; without
    this, the child's first full collection walks every one of those objects, writing to each, and so copies most of
    the worker's heap (42,000 page faults and 0.6 s of CPU on the preloaded worker, against 900 and 33 ms frozen).
    The worker itself allocates nothing that lives between messages, so nothing it frees is kept by the freeze."""
    import gc

    gc.collect()
    gc.freeze()


def _child(pin_file: str | os.PathLike[str], req: dict, fds: list[int]) -> None:  # pragma: no cover - the child
    import contextlib
    import traceback

    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        os.chdir(req["cwd"])
        from clients import pinned

        pinned.main(["--code-pin", str(pin_file), *req["argv"]])
        code = 0
    except SystemExit as exc:  # flwr_exit ends the task with sys.exit
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child must never return into the worker's loop
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _receive(conn: socket.socket) -> tuple[dict, list[int]] | None:
    """A launcher's request: its arguments and working directory, and its stdin/stdout/stderr; None when the peer
    closed without sending anything (``prestart``'s check that the worker listens: not a request, nothing to log)."""
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    if not data and not fds:
        return None
    if len(data) < 4:
        raise ValueError("short request")
    size = struct.unpack("!I", data[:4])[0]
    while len(data) < 4 + size:
        more = conn.recv(4 + size - len(data))
        if not more:
            raise ValueError("truncated request")
        data += more
    parts = [os.fsdecode(x) for x in data[4:4 + size].split(b"\0")]  # the working directory, then the arguments
    if not parts[0] or len(fds) != 3:
        raise ValueError("malformed request")
    return {"cwd": parts[0], "argv": parts[1:]}, fds


def _same_uid(conn: socket.socket) -> bool:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1] == os.getuid()


def _alive(pid: int | None) -> bool:
    """Whether ``pid`` still runs (a zombie, exited but not yet reaped by its parent, does not)."""
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def serve(pin_file: str | os.PathLike[str], name: str, parent_pid: int | None) -> None:
    """The worker: listen first (launchers may connect while it imports), preload, then fork per request."""
    import contextlib
    import selectors
    import time

    os.chdir(warm_dir(pin_file))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(name)
    finally:
        os.umask(old)
    listener.listen(64)
    with open(STARTS_LOG, "a") as fh:
        fh.write(f"{time.time():.3f} pid {os.getpid()} socket {name}\n")
    _preload(pin_file)
    ready_to_fork()
    print(f"distmoe warm worker {os.getpid()}: ready ({len(sys.modules)} modules imported)", file=sys.stderr,
          flush=True)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: dict[int, tuple[socket.socket, float]] = {}
    try:
        while _alive(parent_pid) or children:
            for _key, _ in sel.select(TICK_S):
                conn, _ = listener.accept()
                try:
                    if not _same_uid(conn):
                        raise PermissionError("peer of another uid")
                    got = _receive(conn)
                except (OSError, ValueError) as exc:
                    print(f"distmoe warm worker: request refused: {exc}", file=sys.stderr, flush=True)
                    conn.close()
                    continue
                if got is None:  # a connection that only checked the worker listens
                    conn.close()
                    continue
                req, fds = got
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:  # pragma: no cover - the child
                    listener.close()
                    conn.close()
                    _child(pin_file, req, fds)
                for fd in fds:
                    os.close(fd)
                children[pid] = (conn, time.monotonic())
                with contextlib.suppress(OSError):
                    conn.sendall(f"pid {pid}\n".encode())
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                conn, t0 = children.pop(pid, (None, 0.0))
                code = os.waitstatus_to_exitcode(status)
                print(f"distmoe warm worker: child {pid} exited {code} after {time.monotonic() - t0:.2f} s",
                      file=sys.stderr, flush=True)
                if conn is not None:
                    with contextlib.suppress(OSError):
                        conn.sendall(f"exit {code}\n".encode())
                    conn.close()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name)
        listener.close()


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    serving = bool(argv) and argv[0] == "--serve"
    argv = argv[1:] if serving else argv
    if len(argv) < 2 or argv[0] != "--code-pin":
        print("usage: python -m clients.warm [--serve] --code-pin FILE <flwr-clientapp arguments>", file=sys.stderr)
        raise SystemExit(2)
    pin_file = os.path.realpath(argv[1])
    if serving:
        name = arg_value(argv, "--socket")
        parent = arg_value(argv, "--parent-pid")
        if not name or "/" in name:
            raise SystemExit("--serve needs --socket NAME")
        serve(pin_file, name, int(parent) if parent else None)
        return
    raise SystemExit(launch(pin_file, argv[2:]))


if __name__ == "__main__":
    main()
