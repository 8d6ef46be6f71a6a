"""The same app on Flower's Deployment Engine: a real SuperLink and two SuperNodes on loopback.

Each process runs with Flower's state (``FLWR_HOME``), ``HOME`` and ``TMPDIR`` inside ``tmp_path``
and carries a per-test token in its environment, so everything it started (SuperExecs, ServerApp
and ClientApp processes included) is found and stopped by PID at the end, whatever happened.
Commands (flwr 1.42):

    flower-superlink --insecure --host 127.0.0.1 --port P --database <tmp>/state.db \
        --disable-runtime-dependency-installation
    flower-supernode --insecure --superlink 127.0.0.1:P --host 127.0.0.1 --port Q_i \
        --node-config 'data-path="<tmp>/data/party-i" party-name="party-i"'
    flwr supernode list deploy --format json       # until 2 nodes are "online"
    flwr run <repo> deploy --stream --run-config <tmp>/overrides.toml
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distmoe.config import to_toml
from distmoe.data.synth import write_synthetic
from distmoe.simulate import TOKEN_ENV, free_port, processes_with_token, stop_processes

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CONN = "deploy"
NODES_DEADLINE = 60.0
RUN_DEADLINE = 240.0

OVERRIDES = {
    "schedule.phases": "stats:arith, sft:arith, eval",
    "schedule.sft-rounds": 1,
    "train.local-steps": 3,
    "federation.min-parties": 2,
    "federation.wait-timeout": 60.0,
    "federation.round-timeout": 120.0,
    "checkpoint.keep": 10,  # keep round 0 so the final weights can be compared with it
    "model.hidden-size": 64,
    "model.moe-intermediate-size": 64,
    "model.layers": 2,
    "model.heads": 2,
    "model.kv-heads": 1,
    "model.head-dim": 32,
}


class Deployment:
    """The processes and logs of one test; ``diag()`` gives the log tails for failure messages."""

    def __init__(self, root: Path):
        self.root = root
        self.token = secrets.token_hex(8)
        self.procs: list[subprocess.Popen] = []
        self.logs: dict[str, Path] = {}
        self._files = []

    def env(self, flwr_home: Path) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FLWR_", "RAY_"))}
        home, tmp = self.root / "home", self.root / "tmp"
        for d in (flwr_home, home, tmp):
            d.mkdir(parents=True, exist_ok=True)
        env.update({
            TOKEN_ENV: self.token, "FLWR_HOME": str(flwr_home), "HOME": str(home), "TMPDIR": str(tmp),
            "PATH": str(BIN) + os.pathsep + env.get("PATH", ""),
            "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(home / "hf"),
            "MPLCONFIGDIR": str(home / "mpl"), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        })
        return env

    def start(self, name: str, cmd: list[str], flwr_home: Path) -> subprocess.Popen:
        log = self.root / f"{name}.log"
        fh = log.open("w")
        self._files.append(fh)
        proc = subprocess.Popen(cmd, env=self.env(flwr_home), cwd=str(self.root), stdout=fh,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        self.logs[name] = log
        return proc

    def cli(self, args: list[str], flwr_home: Path, timeout: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "flwr"), *args], env=self.env(flwr_home), cwd=str(self.root),
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def diag(self, lines: int = 40) -> str:
        out = []
        for name, path in self.logs.items():
            try:
                tail = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError as exc:
                tail = [f"<unreadable: {exc}>"]
            out.append(f"----- {name}.log (last {lines} lines) -----\n" + "\n".join(tail))
        return "\n" + "\n".join(out)

    def stop(self) -> list[int]:
        stop_processes(self.token)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for fh in self._files:
            fh.close()
        deadline = time.monotonic() + 10
        while processes_with_token(self.token) and time.monotonic() < deadline:
            stop_processes(self.token, grace=1.0)
        return processes_with_token(self.token)


@pytest.fixture
def deployment(tmp_path):
    dep = Deployment(tmp_path)
    try:
        yield dep
    finally:
        leftover = dep.stop()
        assert not leftover, f"processes with the test token still running: {leftover}" + dep.diag(10)


def _online_nodes(dep: Deployment, cli_home: Path) -> int:
    res = dep.cli(["supernode", "list", CONN, "--format", "json"], cli_home)
    text = res.stdout
    try:
        data = json.loads(text[text.index("{"):])
    except ValueError:
        return 0
    return sum(1 for n in data.get("nodes", []) if n.get("status") == "online")


def _record(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


@pytest.mark.slow
def test_deployment_engine_end_to_end(deployment: Deployment, tmp_path: Path):
    dep = deployment
    parties = write_synthetic(tmp_path / "data", 2, 24, 0, canaries=1)
    run_dir = tmp_path / "run"

    # SuperLink and SuperNodes, each with its own FLWR_HOME and log file
    port = free_port()
    dep.start("superlink", [str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1",
                            "--port", str(port), "--database", str(tmp_path / "state.db"),
                            "--disable-runtime-dependency-installation"], tmp_path / "flwr-superlink")
    node_ports: set[int] = {port}
    for i, pdir in enumerate(parties):
        q = free_port()
        while q in node_ports:
            q = free_port()
        node_ports.add(q)
        node_config = f'data-path="{pdir.resolve()}" party-name="party-{i}"'
        dep.start(f"supernode-{i}", [str(BIN / "flower-supernode"), "--insecure", "--superlink",
                                     f"127.0.0.1:{port}", "--host", "127.0.0.1", "--port", str(q),
                                     "--node-config", node_config], tmp_path / f"flwr-node-{i}")

    # the CLI's connection: let flwr create its default config.toml, then add ours
    cli_home = tmp_path / "flwr-cli"
    res = dep.cli(["config", "list"], cli_home)
    cfg_file = cli_home / "config.toml"
    assert cfg_file.exists(), f"flwr did not create {cfg_file}: {res.stdout}{res.stderr}"
    with cfg_file.open("a") as fh:
        fh.write(f'\n[superlink.{CONN}]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')

    deadline = time.monotonic() + NODES_DEADLINE
    online = 0
    while time.monotonic() < deadline:
        online = _online_nodes(dep, cli_home)
        if online >= 2:
            break
        for proc in dep.procs:
            assert proc.poll() is None, f"{proc.args[0]} exited with {proc.returncode}" + dep.diag()
        time.sleep(1.0)
    assert online >= 2, f"only {online} SuperNodes online after {NODES_DEADLINE:.0f} s" + dep.diag()

    # the run: same app, same run config keys as in simulation
    overrides = tmp_path / "overrides.toml"
    overrides.write_text(to_toml({**OVERRIDES, "run.dir": str(run_dir)}))
    t0 = time.monotonic()
    cli = dep.start("flwr-run", [str(BIN / "flwr"), "run", str(REPO), CONN, "--stream",
                                 "--run-config", str(overrides)], cli_home)
    status = None
    while time.monotonic() - t0 < RUN_DEADLINE:
        status = _record(run_dir).get("status")
        if status in ("completed", "failed"):
            break
        if cli.poll() is not None and cli.returncode != 0:
            break  # the CLI failed (e.g. the run was refused): nothing will write run.json
        time.sleep(1.0)
    rec = _record(run_dir)
    assert rec.get("status") == "completed", (
        f"run status {rec.get('status')!r} after {time.monotonic() - t0:.0f} s "
        f"(error: {rec.get('error')!r}; CLI rc {cli.poll()})" + dep.diag())

    # run outputs
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    by = {}
    for e in events:
        by.setdefault(e.get("event"), []).append(e)
    msg = dep.diag()
    assert by.get("stats"), "no stats event in metrics.jsonl" + msg
    train_parties = {e.get("party") for e in by.get("train", [])}
    assert train_parties == {"all"}, f"train events for {train_parties}" + msg  # secure sums only
    assert not any(e.get("skipped") for e in by["train"]), "a train round had no usable update" + msg
    evals = [e for e in by.get("eval", []) if e.get("party") == "all"]
    assert evals and "acc/arith" in evals[-1], f"no aggregate eval with acc/arith: {evals}" + msg
    assert not by.get("party_error"), f"party errors: {by.get('party_error')}" + msg
    assert list((run_dir / "anchors").glob("*.npz")), "no anchor .npz written" + msg
    ckpts = run_dir / "checkpoints"
    latest = (ckpts / "LATEST").read_text().strip()
    assert latest != "round-0", "LATEST still points at round 0" + msg

    from safetensors.numpy import load_file

    w0 = load_file(str(ckpts / "round-0" / "trainable.safetensors"))
    w1 = load_file(str(ckpts / latest / "trainable.safetensors"))
    assert set(w0) == set(w1) and w0, "checkpoint tensors differ in names" + msg
    assert any(not (w0[k] == w1[k]).all() for k in w0), "final weights equal round 0's" + msg

    # each SuperNode ran ClientApp work for every kind of message the schedule sends
    for i in range(2):
        log = dep.logs[f"supernode-{i}"].read_text(errors="replace")
        for needle in ("Start `flwr-clientapp` process", "Sending: train.stats message",
                       "Sending: train.sft message", "Sending: evaluate message"):
            assert needle in log, f"supernode-{i}.log lacks {needle!r}" + msg
        assert "distmoe client:" not in log, f"supernode-{i} reported a ClientApp failure" + msg
        assert "Sending: query.unmask message" in log, f"supernode-{i} never unmasked" + msg

    # the audit over the coordinator's ledger and each data owner's own ledger (kept in its work dir)
    from distmoe.audit import audit_run

    ledgers = sorted(tmp_path.glob("data/.party-*-work/ledger/*.jsonl"))
    assert len(ledgers) == 2, ledgers
    canary_file = tmp_path / "auditor-canaries.txt"  # the auditor's list: every party's planted canary
    canary_file.write_text("".join((p / "canaries.txt").read_text() for p in parties))
    result = audit_run(run_dir, party_ledgers=ledgers, canaries=canary_file)
    assert result.verdict == "pass", [(c.name, c.findings) for c in result.checks if c.status == "fail"]
    assert result.check("cross-check").status == "pass" and result.check("canaries").status == "pass"
