"""The floor's ``flwr-clientapp`` with distmoe's cuts: a forked child of a warm process, short content back-off.

What Flower's SuperExec starts for each message of the floor's cut arm (``bench/deploy_arms.py`` puts a script that
runs this file first on the SuperNode's ``PATH``). Like distmoe's owner launcher (``clients/warm.py``) it hands its
arguments and its stdin/stdout/stderr to one warm process per SuperNode (started on first use; flwr's ClientApp
runtime and the floor app imported once) over a Unix socket, and exits with the exit status of the child that the
warm process forks for it. The child runs Flower's own ``flwr-clientapp`` with the content back-off of
``clients/pinned.py`` (50 ms doubling to 0.5 s instead of 1, 2, 4, 8 s) and nothing else changed. Without the code
pin and its checks, it is the cheapest per-message ClientApp process Flower's design allows: the floor under
distmoe's warm worker.

Must not: be imported by distmoe (benchmark only).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import selectors
import socket
import struct
import subprocess
import sys
import time

from clients.pinned import PULL_BACKOFF_CAP_S, PULL_BACKOFF_S


def _arg(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
    return None


def _run(argv: list[str]) -> None:
    from flwr.supernode.cli.flwr_clientapp import flwr_clientapp
    from flwr.supernode.runtime import run_clientapp as rc

    rc.pull_and_inflate_object_from_tree = functools.partial(
        rc.pull_and_inflate_object_from_tree, initial_backoff=PULL_BACKOFF_S, backoff_cap=PULL_BACKOFF_CAP_S)
    sys.argv = ["flwr-clientapp", *argv]
    flwr_clientapp()


def _child(req: dict, fds: list[int]) -> None:  # pragma: no cover - the forked child
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.chdir(req["cwd"])
        _run(req["argv"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(path: str, parent: int) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    import flwr.supernode.cli.flwr_clientapp  # noqa: F401  (the imports a child then needs no more)
    import flwr.supernode.runtime.run_clientapp  # noqa: F401
    import numpy  # noqa: F401  (the floor app's own imports)
    from flwr import clientapp, serverapp  # noqa: F401

    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    try:
        while os.path.exists(f"/proc/{parent}") or children:
            for _key, _ in sel.select(0.05):
                conn, _ = listener.accept()
                data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
                req = json.loads(data[4:4 + struct.unpack("!I", data[:4])[0]])
                pid = os.fork()
                if pid == 0:  # pragma: no cover
                    listener.close()
                    _child(req, fds)
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                conn = children.pop(pid)
                with contextlib.suppress(OSError):
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                conn.close()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        return sock
    except OSError:
        sock.close()
        return None


def launch(args: list[str]) -> int:
    address = _arg(args, "--runtime-api-address") or "default"
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "floor-" + hashlib.sha256(address.encode()).hexdigest()[:12])
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sock = _connect(path)
        if sock is None:  # this SuperNode's warm process is not up yet: start it (it imports, then listens)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            subprocess.Popen([sys.executable, "-P", __file__, "--serve", path, _arg(args, "--parent-pid") or "1"],
                             stdin=subprocess.DEVNULL, start_new_session=True)
            deadline = time.monotonic() + 120
            while (sock := _connect(path)) is None:
                if time.monotonic() > deadline:
                    raise SystemExit(f"the floor's warm ClientApp process did not listen at {path}")
                time.sleep(0.02)
    request = json.dumps({"argv": args, "cwd": os.getcwd()}).encode()
    socket.send_fds(sock, [struct.pack("!I", len(request)) + request], [0, 1, 2])
    line = sock.makefile("r").readline()
    return int(line.split()[1]) if line.startswith("exit ") else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        raise SystemExit(launch(sys.argv[1:]))
