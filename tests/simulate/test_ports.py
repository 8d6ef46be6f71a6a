"""The local SuperLink's port: chosen free, verified to be held by this run's own process, never shared.

The failure these guard against: a port chosen as free is taken by another process (another run's SuperLink)
before this run's SuperLink binds it; ``flwr run`` then silently uses the other run's SuperLink and fails when
that run stops its processes. Fast tests check the ownership test on real sockets; the slow ones start real
``flower-superlink`` processes, and two ``distmoe simulate`` processes at once on one port.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from distmoe.simulate import TOKEN_ENV, PortTaken, free_port, port_owner, processes_with_token, start_superlink
from distmoe.simulate.ports import listening_inodes


class _Health(http.server.BaseHTTPRequestHandler):
    """Answers ``/health`` like a SuperLink does: what ``flwr run`` would take for its own."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.fixture
def foreign_superlink():
    """Another process's "SuperLink" on 127.0.0.1: an HTTP server answering ``/health`` (in this test's process,
    which is not the run's: it carries no run token)."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def test_free_port_is_free_and_outside_exclude():
    p = free_port()
    assert port_owner(p, []) == "free"
    for _ in range(5):
        assert free_port(frozenset({p})) != p


def test_port_owner_tells_ours_from_foreign():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert listening_inodes(port)
        assert port_owner(port, [os.getpid()]) == "ours"
        assert port_owner(port, [os.getppid()]) == "foreign"  # listening, but not held by the listed process
    assert port_owner(port, [os.getpid()]) == "free"


def test_a_given_port_held_by_another_superlink_is_refused(tmp_path: Path, foreign_superlink: int):
    env = dict(os.environ)
    with pytest.raises(PortTaken, match=rf"--port {foreign_superlink}: port {foreign_superlink} is in use"):
        start_superlink(env, tmp_path / "flwr", lambda: [], port=foreign_superlink)
    assert "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT" not in env  # flwr run would never be pointed at it


def _env(tmp_path: Path, token: str) -> dict:
    env = dict(os.environ)
    env.update({TOKEN_ENV: token, "FLWR_HOME": str(tmp_path / "flwr"), "HOME": str(tmp_path),
                "PATH": str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")})
    return env


@pytest.mark.slow
def test_a_port_taken_by_another_superlink_is_left_for_a_port_of_our_own(tmp_path: Path, foreign_superlink: int):
    token = "ports-test-" + os.urandom(4).hex()
    picks = iter([foreign_superlink])  # the collision, forced: the first "free" port is another SuperLink's

    def pick(exclude=frozenset()):
        return next(picks, None) or free_port(exclude)

    said: list[str] = []
    env = _env(tmp_path, token)
    proc, port, _ = start_superlink(env, tmp_path / "flwr", lambda: processes_with_token(token), pick=pick,
                                    say=said.append)
    try:
        assert port != foreign_superlink and env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] == str(port)
        assert port_owner(port, [proc.pid]) == "ours"  # flower-superlink itself holds the port flwr run will use
        assert any(f"port {foreign_superlink} is in use" in s for s in said)
    finally:
        proc.terminate()
        proc.wait(10)
        for pid in processes_with_token(token):  # its superexec child
            os.kill(pid, 9)


TINY = {"model.hidden-size": 32, "model.moe-intermediate-size": 32, "model.layers": 1, "model.heads": 2,
        "model.kv-heads": 1, "model.head-dim": 16, "model.experts": 4, "model.top-k": 2, "train.local-steps": 2,
        "train.batch-size": 4, "data.synth-examples": 20, "schedule.phases": "sft:lookup", "routing.probe-every": 0,
        "eval.max-new-tokens": 2}


@pytest.mark.slow
def test_two_simulates_at_once_on_one_port_one_runs_the_other_is_refused(tmp_path: Path):
    """Two ``distmoe simulate`` started together, forced onto one SuperLink port: exactly one gets it and
    completes; the other stops before Flower runs, names the port and the command to retry, and leaves no run
    directory; neither uses the other's SuperLink."""
    port = free_port()
    over = " ".join(f"{k}={json.dumps(v)}" for k, v in TINY.items())
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-m", "distmoe.cli", "simulate", "--parties", "2", "--no-report",
                               "--runs-dir", str(tmp_path / "runs"), "--run-id", name, "--port", str(port),
                               "--timeout", "500", "--run-config", over],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in ("a", "b")]
    outs = [p.communicate(timeout=560) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 1], outs
    lost = codes.index(1)
    err = outs[lost][1]
    assert f"--port {port}" in err and "retry with:" in err and "distmoe simulate" in err, err
    assert not (tmp_path / "runs" / "ab"[lost]).exists()
    won = tmp_path / "runs" / "ab"[1 - lost]
    assert json.loads((won / "run.json").read_text())["status"] == "completed"
    time.sleep(1)
    info = json.loads((won / "simulate.json").read_text())
    assert info["port"] == port and info["remaining"] == []
