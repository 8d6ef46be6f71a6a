"""The data owner's trust in the code its SuperNode runs, on real Flower 1.42 processes (a SuperLink and a
SuperNode on loopback, ``flwr run`` of an app bundle), ``docs/privacy.md`` §1.

1. Flower's app verification does not work with a self-hosted SuperLink: a SuperNode started with
   ``--trusted-entities`` refuses every bundle submitted with ``flwr run <dir>`` (the SuperLink attaches
   no verification records to it; only Flower Hub apps carry them), so it cannot pin a coordinator's app.
2. What distmoe uses instead: the owner's code pin (``distmoe deploy pin``, ``deploy supernode --code-pin``).
   The attack: the coordinator ships a bundle whose party code is modified (here a line in
   ``distmoe/party/session.py`` that would run at import and leaves a marker file). The SuperNode's
   pinned launcher refuses it before importing anything of it: the reply is Flower's error with the pin's
   fixed text only, the marker is never written, and the owner's refusal log names the file. The same
   bundle unmodified runs the distmoe ClientApp (the launcher is otherwise Flower's own ClientApp process;
   its party guard answers the test's bare query with its own refusal code and ledger head).
   Without the pin (defence removed) the modified code runs: the test checks that too.

The processes run with the test token in their environment and are stopped by PID at the end. The SuperLink
is plain (``--insecure``): TLS and SuperNode authentication are ``test_deployment.py``'s subject and play
no part in what code a SuperNode runs.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distmoe.deploy import commands as dc
from distmoe.deploy import credentials as cr
from distmoe.simulate import TOKEN_ENV, free_port, processes_with_token, stop_processes

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
REFUSAL = "distmoe code pin"
SERVER_APP = '''"""Test ServerApp: one setup query to every SuperNode, each reply printed on one line."""
import time
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    nodes, t0 = [], time.time()
    while not nodes and time.time() - t0 < 60:
        nodes = list(grid.get_node_ids())
        time.sleep(0.5)
    msgs = [Message(RecordDict({"c": ConfigRecord({"x": 1})}), dst_node_id=n, message_type="query.setup")
            for n in nodes]
    for r in grid.send_and_receive(msgs, timeout=120):
        if r.has_error():
            print(f"REPLY error {r.error.code} {r.error.reason}", flush=True)
        else:
            print("REPLY ok", flush=True)
'''


class Procs:
    def __init__(self, root: Path):
        self.root, self.token, self.procs, self.logs = root, secrets.token_hex(8), [], {}

    def env(self, flwr_home: Path, path: str | None = None) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FLWR_", "RAY_"))}
        home = self.root / "home"
        for d in (flwr_home, home):
            d.mkdir(parents=True, exist_ok=True)
        env.update(
            {
                TOKEN_ENV: self.token,
                "FLWR_HOME": str(flwr_home),
                "HOME": str(home),
                "PATH": path or (str(BIN) + os.pathsep + env.get("PATH", "")),
                "FLWR_TELEMETRY_ENABLED": "0",
                "FLWR_DISABLE_UPDATE_CHECK": "1",
                "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "PYTHONPATH": str(REPO),
            }
        )
        return env

    def start(self, name: str, cmd: list[str], env: dict) -> None:
        log = self.root / f"{name}.log"
        self.logs[name] = log
        self.procs.append(
            subprocess.Popen(
                cmd,
                env=env,
                cwd=str(self.root),
                stdout=log.open("w"),
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        )

    def diag(self) -> str:
        return "".join(
            f"\n----- {n} -----\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:])
            for n, p in self.logs.items()
        )

    def stop(self) -> list[int]:
        stop_processes(self.token, grace=2.0)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        return processes_with_token(self.token)


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        assert not p.stop(), "processes with the test token still running"


def _superlink(procs: Procs, tmp_path: Path) -> tuple[int, Path]:
    port = free_port()
    procs.start(
        "superlink",
        [
            str(BIN / "flower-superlink"),
            "--insecure",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--disable-runtime-dependency-installation",
        ],
        procs.env(tmp_path / "flwr-superlink"),
    )
    cli_home = tmp_path / "flwr-cli"
    env = procs.env(cli_home)
    subprocess.run([str(BIN / "flwr"), "config", "list"], env=env, capture_output=True, timeout=60)
    with (cli_home / "config.toml").open("a") as fh:
        fh.write(f'\n[superlink.t]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    return port, cli_home


def _flwr_run(procs: Procs, app: Path, cli_home: Path, expect: int = 1) -> list[str]:
    """``flwr run APP t --stream`` (retried while the SuperLink starts); the ServerApp's reply lines."""
    deadline = time.monotonic() + 60
    while True:
        res = subprocess.run(
            [str(BIN / "flwr"), "run", str(app), "t", "--stream"],
            env=procs.env(cli_home),
            capture_output=True,
            text=True,
            timeout=240,
            cwd=str(procs.root),
        )
        lines = re.findall(r"^REPLY .*$", res.stdout + res.stderr, re.M)
        if len(lines) >= expect or time.monotonic() > deadline:
            break
        time.sleep(2.0)
    assert len(lines) == expect, f"flwr run: {res.stdout}{res.stderr}" + procs.diag()
    return lines


def _app(tmp_path: Path, name: str, marker: Path | None = None) -> Path:
    """An app bundle directory: this repository's pyproject, distmoe/ and clients/, and the test ServerApp;
    with ``marker`` the coordinator's modification of the party code (a module-level write of ``marker``)."""
    app = tmp_path / name
    app.mkdir()
    shutil.copy(REPO / "pyproject.toml", app / "pyproject.toml")
    for pkg in ("distmoe", "clients"):
        shutil.copytree(REPO / pkg, app / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (app / "server").mkdir()
    (app / "server" / "__init__.py").write_text("")
    (app / "server" / "app.py").write_text(SERVER_APP)
    if marker is not None:
        with (app / "distmoe" / "party" / "session.py").open("a") as fh:
            fh.write(f"\nPath({str(marker)!r}).write_text('coordinator code ran')\n")
    return app


def _supernode_argv(port: int, *extra: str) -> list[str]:
    """``flower-supernode`` on loopback against the SuperLink at ``port``, insecure, plus ``extra``."""
    return [str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}", "--host", "127.0.0.1",
            "--port", str(free_port()), *extra]


def _supernode(procs: Procs, tmp_path: Path, port: int, code_pin: Path | None) -> None:
    """A SuperNode with the node config and ``PATH`` that ``distmoe deploy supernode`` builds (owner-made keys)."""
    owner = tmp_path / "owner"
    _, public = cr.create_owner_keys(owner, "party-0")
    creds = cr.create(tmp_path / "creds", (), owner_public=[cr.read_owner_public(public)])
    shutil.copy(creds.party("party-0").ca_cert, owner / "ca.crt")
    data = tmp_path / "data"
    data.mkdir()
    cmd = dc.supernode_command(
        owner,
        superlink=f"127.0.0.1:{port}",
        data_path=data,
        port=free_port(),
        work_dir=tmp_path / "work",
        code_pin=code_pin,
    )
    argv = list(cmd.argv)
    nc = argv[argv.index("--node-config") + 1]
    procs.start("supernode", _supernode_argv(port, "--node-config", nc),
                procs.env(tmp_path / "flwr-supernode", cmd.env.get("PATH")))


def test_modified_party_code_is_refused_by_the_pinned_supernode(procs, tmp_path):
    pin_dir = tmp_path / "pin"
    res = subprocess.run(
        [sys.executable, "-m", "distmoe.cli", "deploy", "pin", "--out", str(pin_dir), "--source", str(REPO)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert re.match(r"^code pin [0-9a-f]{64}$", res.stdout.splitlines()[0]), res.stdout
    port, cli_home = _superlink(procs, tmp_path)
    _supernode(procs, tmp_path, port, pin_dir)

    marker = tmp_path / "ATTACK_RAN"
    (line,) = _flwr_run(procs, _app(tmp_path, "modified", marker), cli_home)
    assert REFUSAL in line, line + procs.diag()
    assert not marker.exists(), "the modified party code ran at the pinned SuperNode"
    log = (pin_dir / "refusals.log").read_text()
    assert "distmoe/party/session.py: differs from the pinned version" in log, log

    (line,) = _flwr_run(procs, _app(tmp_path, "honest"), cli_home)
    # the pinned code ran: distmoe's party guard answered (this bare query is refused by the protocol check,
    # with the party ledger's head: the party's ledger was written)
    assert REFUSAL not in line and "[ledger-head " in line, line + procs.diag()
    assert "distmoe code pin: the app bundle's party code matches the pin" in procs.logs["supernode"].read_text()


def test_without_the_pin_the_modified_code_runs(procs, tmp_path):
    """The defence removed (no --code-pin): the same modified bundle's code runs at the data owner."""
    port, cli_home = _superlink(procs, tmp_path)
    _supernode(procs, tmp_path, port, None)
    marker = tmp_path / "ATTACK_RAN"
    (line,) = _flwr_run(procs, _app(tmp_path, "modified", marker), cli_home)
    assert REFUSAL not in line, line
    assert marker.exists(), line + procs.diag()


def test_flower_app_verification_refuses_every_self_hosted_bundle(procs, tmp_path):
    """flwr 1.42 ``--trusted-entities`` with a self-hosted SuperLink: even the unmodified bundle is refused
    (``The FAB could not be verified``), so Flower's own verification cannot pin a coordinator's app."""
    port, cli_home = _superlink(procs, tmp_path)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "signer")], check=True)
    trusted = tmp_path / "trusted.yaml"
    trusted.write_text(f"fpk_owner: '{(tmp_path / 'signer.pub').read_text().strip()}'\n")
    procs.start("supernode", _supernode_argv(port, "--trusted-entities", str(trusted)),
                procs.env(tmp_path / "flwr-supernode"))
    (line,) = _flwr_run(procs, _app(tmp_path, "honest"), cli_home)
    assert "The FAB could not be verified" in line, line + procs.diag()
    log = procs.logs["supernode"].read_text(errors="replace")
    assert "App verification is not supported by the connected SuperLink" in log, procs.diag()
