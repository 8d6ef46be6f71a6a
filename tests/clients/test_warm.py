"""The warm ClientApp worker's own rules (``clients/warm.py``), without Flower: where its socket is, which
arguments it reads, and that it tells a peer of another uid from its owner. The whole worker, on real
Flower processes: ``tests/integration/test_warm_worker.py``."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from clients import warm

REPO = Path(__file__).resolve().parents[2]


def test_one_short_socket_per_runtime_api_address(tmp_path):
    a, b = warm.socket_name("127.0.0.1:9094"), warm.socket_name("127.0.0.1:9095")
    assert a != b and a == warm.socket_name("127.0.0.1:9094") and len(a) < 32 and "/" not in a
    pin = tmp_path / "pin" / "code-pin.json"
    pin.parent.mkdir()
    d = warm.warm_dir(pin)
    assert d == str(tmp_path / "pin" / "warm") and stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_the_launcher_imports_only_what_a_message_needs():
    """The launcher runs once per message in a fresh Python: it imports no module beyond its own few (each costs
    every message its import; json, pathlib, subprocess and traceback were half of a launcher's CPU)."""
    code = ("import sys; before = set(sys.modules); import clients.warm; "
            "print(' '.join(sorted(set(sys.modules) - before)))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    imported = set(res.stdout.split())
    assert not imported & {"json", "pathlib", "subprocess", "traceback", "re", "contextlib", "fcntl", "threading"}
    assert {"clients.warm", "socket", "struct"} <= imported


def test_a_request_reaches_the_worker_as_the_launcher_sent_it():
    """The launcher's arguments and working directory, NUL-separated, with its three descriptors (SCM_RIGHTS)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    args = ["--runtime-api-address", "127.0.0.1:9094", "--token", "t=1,2", "--x", "", "é"]
    try:
        socket.send_fds(b, [warm.request("/tmp/a b", args)], [0, 1, 2])
        req, fds = warm._receive(a)
        assert req == {"cwd": "/tmp/a b", "argv": args} and len(fds) == 3
        for fd in fds:
            os.close(fd)
        socket.send_fds(b, [warm.request("", args)], [0, 1, 2])
        with pytest.raises(ValueError, match="malformed"):
            warm._receive(a)
    finally:
        a.close()
        b.close()


def test_flwr_clientapp_arguments_are_read_in_both_spellings():
    args = ["--runtime-api-address", "127.0.0.1:9094", "--token", "t", "--parent-pid=42"]
    assert warm.arg_value(args, "--runtime-api-address") == "127.0.0.1:9094"
    assert warm.arg_value(args, "--parent-pid") == "42" and warm.arg_value(args, "--insecure") is None


def test_the_peer_uid_is_read_from_the_kernel_not_assumed(monkeypatch):
    """Without root: a real connected pair (the kernel fills in the peer's credentials) is accepted as the owner's,
    and refused once the worker runs as another uid than its peer, the same comparison the root test below makes
    with a second real account."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert warm._same_uid(a) is True
        real = os.getuid()
        monkeypatch.setattr(warm.os, "getuid", lambda: real + 1)
        assert warm._same_uid(a) is False
    finally:
        a.close()
        b.close()


# Skipped where the tests do not run as root (CI runs them as root): only root can connect as another account.
@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another uid")
def test_a_peer_of_another_uid_is_told_apart():
    """The attack the uid check stops: another local account connecting to the worker's socket (here a
    world-writable one, as if the 0700 directory were not there) to have the owner's party code run against a
    Runtime API of its own."""
    shared = tempfile.mkdtemp()  # in the system's temporary directory, which every account can traverse
    os.chmod(shared, 0o777)
    path = os.path.join(shared, "s.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen(2)
    srv.settimeout(30)
    for uid in (os.getuid(), 65534):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                if uid != os.getuid():
                    os.setuid(uid)
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.connect(path)
                c.recv(1)
                code = 0
            finally:
                os._exit(code)
        conn, _ = srv.accept()
        assert warm._same_uid(conn) is (uid == os.getuid())
        conn.close()
        os.waitpid(pid, 0)
    srv.close()
    shutil.rmtree(shared)


def test_a_connection_that_only_checks_the_worker_listens_is_no_refused_request():
    """``prestart`` connects and closes to see the worker listen: that is no request (the worker used to log
    "request refused: short request" at every SuperNode start); a request cut short still is refused."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b.close()
    try:
        assert warm._receive(a) is None
    finally:
        a.close()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        b.sendall(b"\x00\x00")
        b.close()
        with pytest.raises(ValueError, match="short request"):
            warm._receive(a)
    finally:
        a.close()


def test_a_forked_childs_garbage_collection_leaves_the_workers_preloaded_objects_alone():
    """The worker freezes its objects before it forks children: a child's full collection then copies none of the
    pages it shares with the worker (counted as the child's minor page faults, the kernel's count of copied pages)."""
    code = """
import gc, os
from clients import warm
heap = [[i, str(i)] for i in range(300000)]  # a preloaded worker's many objects

def faults():
    pid = os.fork()
    if pid == 0:
        gc.collect()
        os._exit(0)
    return os.wait4(pid, 0)[2].ru_minflt

before = faults()
warm.ready_to_fork()
print(before, faults())
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    before, after = map(int, res.stdout.split())
    assert before > 4000 and after < before / 4, (before, after)
