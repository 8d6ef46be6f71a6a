"""The same app on Flower's Deployment Engine with TLS and SuperNode authentication: a real SuperLink and
three SuperNodes on loopback, keys made by each data owner (``distmoe deploy owner-keys``), the CA made by
``distmoe credentials`` from their public keys only, each SuperNode running only the party code its owner
pinned (``distmoe deploy pin``), every Flower process started through ``distmoe deploy ... --exec`` (which
replaces itself with Flower's process, so the PID is Flower's).

Each process runs with Flower's state (``FLWR_HOME``), ``HOME`` and ``TMPDIR`` inside ``tmp_path``
and carries a per-test token in its environment, so everything it started (SuperExecs, ServerApp
and ClientApp processes included) is found and stopped by PID at the end, whatever happened (the
``deployment`` fixture of ``conftest.py``, shared with the other deployment whole runs of this folder).
Commands (flwr 1.42, as ``distmoe deploy`` prints them):

    distmoe deploy owner-keys --party party-i --out <tmp>/owners/party-i     (at each data owner)
    distmoe credentials --out <tmp>/creds --owner-keys <tmp>/owners/party-0/party-0.public.json,...
    cp C/parties/party-i/ca.crt <tmp>/owners/party-i/                          (the CA certificate goes back)
    distmoe deploy pin --out <tmp>/pin --source <repo>                         (each owner pins the party code)
    flower-superlink --ssl-ca-certfile C/superlink/ca.crt --ssl-certfile C/superlink/server.pem \
        --ssl-keyfile C/superlink/server.key --enable-supernode-auth --host 127.0.0.1 --port P \
        --database <tmp>/state.db --disable-runtime-dependency-installation
    [superlink.deploy] address = "127.0.0.1:P", root-certificates = "C/superlink/ca.crt"   (flwr CLI)
    flwr supernode register C/superlink/supernodes/party-i.pub deploy --name party-i
    PATH=<tmp>/pin/bin:$PATH flower-supernode --root-certificates <tmp>/owners/party-i/ca.crt \
        --auth-supernode-private-key <tmp>/owners/party-i/supernode.key --superlink 127.0.0.1:P \
        --host 127.0.0.1 --port Q_i --node-config 'data-path="..." party-name="party-i" ledger-key="..."'
    flwr supernode list deploy --format json       # until 3 nodes are "online"
    flwr run <repo> deploy --stream --run-config <tmp>/overrides.toml
    distmoe audit <run> --party-ledger ... --canaries ...

The refusals (``docs/deploy.md`` §4): a SuperNode whose key was never registered exits with
``Exit Code: 305 ... [code: 2004] Failed to activate SuperNode`` and the SuperLink logs that no
SuperNode has that key; an ``--insecure`` SuperNode against the TLS SuperLink exits with
``Server disconnected without sending a response``; neither is ever listed online.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distmoe.config import to_toml
from distmoe.data.synth import write_synthetic
from distmoe.simulate import TOKEN_ENV, free_port, processes_with_token, stop_processes
from distmoe.wire.at_rest import make_private

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DISTMOE = [sys.executable, "-m", "distmoe.cli"]
CONN = "deploy"
NODES_DEADLINE = 180.0
RUN_DEADLINE = 600.0
CLI_TIMEOUT = 180.0  # one CLI command (Python start-up and imports): about 1.5 s of CPU, a minute on a loaded machine
N_PARTIES = 3

OVERRIDES = {
    "schedule.phases": "stats:arith, sft:arith, eval",
    "schedule.sft-rounds": 1,
    "train.local-steps": 3,
    "federation.min-available": N_PARTIES,
    "privacy.min-parties": N_PARTIES,  # the owners' deployed policy floor (distmoe deploy supernode: 3)
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
        self._ports: set[int] = set()

    def port(self) -> int:
        """A free loopback port not handed out before in this test."""
        q = free_port()
        while q in self._ports:
            q = free_port()
        self._ports.add(q)
        return q

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

    def cli(self, args: list[str], flwr_home: Path, timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "flwr"), *args], env=self.env(flwr_home), cwd=str(self.root),
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def distmoe(self, args: list[str], flwr_home: Path, timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess:
        """Run ``distmoe ARGS`` to completion; a non-zero exit fails the test with its output and the logs."""
        res = subprocess.run([*DISTMOE, *args], env=self.env(flwr_home), cwd=str(self.root), capture_output=True,
                             text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        assert res.returncode == 0, (f"distmoe {' '.join(args)} exited {res.returncode}:\n{res.stdout}{res.stderr}"
                                     + self.diag())
        return res

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


def _online_nodes(dep: Deployment, cli_home: Path) -> set[str]:
    res = dep.cli(["supernode", "list", CONN, "--format", "json"], cli_home)
    text = res.stdout
    try:
        data = json.loads(text[text.index("{"):])
    except ValueError:
        return set()
    return {str(n.get("node-id")) for n in data.get("nodes", []) if n.get("status") == "online"}


def _record(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _federation(dep: Deployment, tmp_path: Path, parties: list[str], register: list[str],
                link_state: str = "memory"):
    """Credentials, a TLS + node-auth SuperLink (``--link-state link_state``), the CLI's connection, and the
    registration of ``register``.

    Returns (credentials dir, SuperLink port, CLI FLWR_HOME, {party: node id from the registration}).
    """
    creds = tmp_path / "creds"
    owners, cli = tmp_path / "owners", tmp_path / "flwr-cli"
    for p in parties:  # each data owner makes its own keys; only <party>.public.json goes to the coordinator
        dep.distmoe(["deploy", "owner-keys", "--party", p, "--out", str(owners / p)], cli)
    res = dep.distmoe(["credentials", "--out", str(creds), "--owner-keys",
                       ",".join(str(owners / p / f"{p}.public.json") for p in parties)], cli)
    assert "real CA" in res.stdout, res.stdout  # the production note
    assert not any(f.name.endswith(".key") for f in (creds / "parties").rglob("*")), "an owner key at the coordinator"
    for p in parties:  # the coordinator sends back its CA certificate only
        shutil.copy(creds / "parties" / p / "ca.crt", tmp_path / "owners" / p / "ca.crt")
    # every data owner pins the party code it reviewed (here: this checkout) and runs only that
    dep.distmoe(["deploy", "pin", "--out", str(tmp_path / "pin"), "--source", str(REPO)], tmp_path / "flwr-cli")
    port = dep.port()
    dep.start("superlink", [*DISTMOE, "deploy", "superlink", "--credentials", str(creds), "--port", str(port),
                            "--database", str(tmp_path / "state.db"), "--flwr-home", str(tmp_path / "flwr-superlink"),
                            "--link-state", link_state, "--exec"], tmp_path / "flwr-superlink")
    cli_home = tmp_path / "flwr-cli"
    dep.distmoe(["deploy", "connection", "--credentials", str(creds), "--address", f"127.0.0.1:{port}", "--name", CONN,
                 "--write", "--flwr-home", str(cli_home), "--timeout", str(CLI_TIMEOUT)], cli_home)
    # the SuperLink needs a moment before its Control API answers: retry the registration until it does
    cmd = ["deploy", "register", "--credentials", str(creds), "--connection", CONN, "--flwr-home", str(cli_home),
           "--timeout", str(CLI_TIMEOUT), "--exec", *(a for p in register for a in ("--party", p))]
    deadline = time.monotonic() + 30
    while True:
        res = subprocess.run([*DISTMOE, *cmd], env=dep.env(cli_home), cwd=str(tmp_path), capture_output=True,
                             text=True, timeout=CLI_TIMEOUT, stdin=subprocess.DEVNULL)
        if res.returncode == 0 or time.monotonic() > deadline:
            break
        assert dep.procs[0].poll() is None, f"SuperLink exited with {dep.procs[0].returncode}" + dep.diag()
        if " is node " in res.stderr:
            break  # partly registered: do not retry (a second registration of the same key is refused)
        time.sleep(1.0)
    assert res.returncode == 0, f"registration failed:\n{res.stdout}{res.stderr}" + dep.diag()
    # the table: owner, public key file, the node ID Flower gave it (one row per owner, in order)
    rows = [line.split() for line in res.stdout.strip().splitlines()[1:]]
    assert [r[0] for r in rows] == list(register), res.stdout
    ids = [r[2] for r in rows]
    assert all(i.isdigit() for i in ids), res.stdout
    superlink_log = dep.logs["superlink"].read_text(errors="replace")
    assert f"https://127.0.0.1:{port}" in superlink_log, "the SuperLink does not serve HTTPS" + dep.diag()
    return creds, port, cli_home, dict(zip(register, ids, strict=True))


def _start_supernode(dep: Deployment, tmp_path: Path, creds: Path, party: str, port: int, data: Path,
                     policy: tuple[str, ...] = ()):
    """A pinned SuperNode with the deployed owner policy (``policy``: the owner's ``--policy-*`` flags)."""
    return dep.start(f"supernode-{party}", [
        *DISTMOE, "deploy", "supernode", "--credentials", str(tmp_path / "owners" / party),
        "--code-pin", str(tmp_path / "pin"), *policy,
        "--superlink", f"127.0.0.1:{port}", "--data-path", str(data), "--port", str(dep.port()),
        "--flwr-home", str(tmp_path / f"flwr-node-{party}"), "--exec"], tmp_path / f"flwr-node-{party}")


def _wait_online(dep: Deployment, cli_home: Path, want: set[str], watch: list[subprocess.Popen]) -> set[str]:
    deadline = time.monotonic() + NODES_DEADLINE
    online: set[str] = set()
    while time.monotonic() < deadline:
        online = _online_nodes(dep, cli_home)
        if want <= online:
            break
        for proc in watch:
            assert proc.poll() is None, f"{proc.args[:6]} exited with {proc.returncode}" + dep.diag()
        time.sleep(1.0)
    assert want <= online, f"online {sorted(online)}, expected {sorted(want)} after {NODES_DEADLINE:.0f} s" + dep.diag()
    return online


def _registered_federation(dep: Deployment, tmp_path: Path, policy: tuple[str, ...] = ()):
    """N_PARTIES data owners with synthetic data (one canary each, private to each owner: the deployed party
    refuses data others can read), all registered and online over TLS.

    Returns (names, party data dirs, credentials dir, CLI FLWR_HOME, {party: node id}, SuperNode processes).
    """
    names = [f"party-{i}" for i in range(N_PARTIES)]
    parties = write_synthetic(tmp_path / "data", N_PARTIES, 24, 0, canaries=1)
    for pdir in parties:  # the owner's step: chmod -R go-rwx <data-path>
        make_private(pdir)
    creds, port, cli_home, ids = _federation(dep, tmp_path, names, register=names)
    nodes = [_start_supernode(dep, tmp_path, creds, name, port, pdir, policy)
             for name, pdir in zip(names, parties, strict=True)]
    online = _wait_online(dep, cli_home, set(ids.values()), [dep.procs[0], *nodes])
    assert online == set(ids.values()), f"online {online} are not exactly the registered nodes {ids}"
    return names, parties, creds, cli_home, ids, nodes


@pytest.mark.slow
def test_tls_node_auth_deployment_end_to_end(deployment: Deployment, tmp_path: Path):
    dep = deployment
    names, parties, creds, cli_home, ids, _ = _registered_federation(dep, tmp_path)
    run_dir = tmp_path / "run"

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

    # `flwr run --stream` shows each round line of the ServerApp once (no second copy through a root log handler)
    streamed = [x.split("distmoe | ", 1)[1] for x in dep.logs["flwr-run"].read_text(errors="replace").splitlines()
                if "distmoe | round " in x]
    assert len(streamed) == len(set(streamed)), f"round lines streamed more than once: {streamed}" + dep.diag()

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

    # each SuperNode was the registered one and ran ClientApp work for every kind of message sent
    for name in names:
        log = dep.logs[f"supernode-{name}"].read_text(errors="replace")
        assert f"SuperNode ID: {ids[name]}" in log, f"supernode-{name} is not node {ids[name]}" + msg
        for needle in ("Start `flwr-clientapp` process", "distmoe code pin: the app bundle's party code matches",
                       "Sending: train.stats message",
                       "Sending: train.sft message", "Sending: evaluate message"):
            assert needle in log, f"supernode-{name}.log lacks {needle!r}" + msg
        assert "distmoe client:" not in log, f"supernode-{name} reported a ClientApp failure" + msg
        assert "Sending: query.unmask message" in log, f"supernode-{name} never unmasked" + msg

    # each data owner signed its ledger with the key it made itself (node config ledger-key)
    ledgers = sorted(tmp_path.glob("owners/party-*/work/ledger/*.jsonl"))
    assert len(ledgers) == N_PARTIES, ledgers
    for led in ledgers:
        party = led.stem
        made = (tmp_path / "owners" / party / "ledger.pub").read_text().strip()
        assert led.with_suffix(".pub").read_text().strip() == made, f"{led} not signed with {party}'s ledger.key"
        assert not (led.parent.parent / "keys" / f"{party}-ledger.key").exists(), "a fallback key was generated"

    # the audit over the coordinator's ledger and each data owner's own ledger (kept in its work dir)
    from distmoe.audit import audit_run

    canary_file = tmp_path / "auditor-canaries.txt"  # the auditor's list: every party's planted canary
    canary_file.write_text("".join((p / "canaries.txt").read_text() for p in parties))
    result = audit_run(run_dir, party_ledgers=ledgers, canaries=canary_file)
    assert result.verdict == "pass", [(c.name, c.findings) for c in result.checks if c.status == "fail"]
    assert result.check("cross-check").status == "pass" and result.check("canaries").status == "pass"
    res = dep.distmoe(["audit", str(run_dir), *(a for led in ledgers for a in ("--party-ledger", str(led))),
                       "--canaries", str(canary_file)], cli_home)
    assert (run_dir / "audit" / "audit.json").exists(), res.stdout


@pytest.mark.slow
def test_unregistered_and_insecure_supernodes_refused(deployment: Deployment, tmp_path: Path):
    dep = deployment
    parties = write_synthetic(tmp_path / "data", 2, 4, 0)
    creds, port, cli_home, ids = _federation(dep, tmp_path, ["party-0", "intruder"], register=["party-0"])

    member = _start_supernode(dep, tmp_path, creds, "party-0", port, parties[0])  # control: this one is let in
    intruder = _start_supernode(dep, tmp_path, creds, "intruder", port, parties[1])  # CA-trusted, never registered
    insecure = dep.start("supernode-insecure", [
        str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}", "--host", "127.0.0.1",
        "--port", str(dep.port()), "--max-retries", "2",
        "--node-config", f'data-path="{parties[1].resolve()}" party-name="insecure"'], tmp_path / "flwr-node-insecure")

    online = _wait_online(dep, cli_home, {ids["party-0"]}, [dep.procs[0], member])
    for proc in (intruder, insecure):
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{proc.args[:6]} was not refused within 60 s" + dep.diag())
    online = _online_nodes(dep, cli_home)
    assert online == {ids["party-0"]}, f"online {online}: only the registered node may be" + dep.diag()
    assert member.poll() is None, "the registered SuperNode stopped" + dep.diag()

    log = dep.logs["supernode-intruder"].read_text(errors="replace")
    assert intruder.returncode != 0 and "Exit Code: 305" in log and "Failed to activate SuperNode" in log, (
        f"unregistered SuperNode: rc {intruder.returncode}" + dep.diag())
    assert "SuperNode ID:" not in log, "the unregistered SuperNode got a node ID" + dep.diag()
    assert "No SuperNode found with the given public key" in dep.logs["superlink"].read_text(errors="replace"), (
        "the SuperLink did not log the unknown key" + dep.diag())

    log = dep.logs["supernode-insecure"].read_text(errors="replace")
    assert insecure.returncode != 0 and "Exit Code: 305" in log, f"insecure SuperNode: rc {insecure.returncode}" \
        + dep.diag()
    # the TLS listener drops the plaintext request: reported as one or the other, by TCP timing
    assert ("Server disconnected without sending a response" in log or "Connection reset by peer" in log), dep.diag()
    assert "SuperNode ID:" not in log, "the insecure SuperNode got a node ID" + dep.diag()


@pytest.mark.slow
def test_a_supernode_killed_mid_run_leaves_the_rounds_to_the_survivors(deployment: Deployment, tmp_path: Path):
    """A data owner's SuperNode (with its ClientApp processes) is killed after the first round. The SuperLink
    answers the messages to it with Flower's 'Node Unavailable' error once its heartbeats stop; the next
    secure rounds complete over the two survivors (threshold 2: each owner lowered its policy floor to 2), the run
    completes and the audit passes."""
    dep = deployment
    names, parties, _, cli_home, _, nodes = _registered_federation(dep, tmp_path, ("--policy-min-parties", "2"))
    run_dir = tmp_path / "run"

    overrides = tmp_path / "overrides.toml"
    overrides.write_text(to_toml({**OVERRIDES, "run.dir": str(run_dir), "federation.round-timeout": 180.0,
                                  "privacy.min-parties": 2}))
    t0 = time.monotonic()
    cli = dep.start("flwr-run", [str(BIN / "flwr"), "run", str(REPO), CONN, "--stream",
                                 "--run-config", str(overrides)], cli_home)
    killed = False
    while time.monotonic() - t0 < RUN_DEADLINE:
        if not killed and (run_dir / "metrics.jsonl").exists() and any(
                json.loads(x).get("event") == "stats" for x in (run_dir / "metrics.jsonl").read_text().splitlines()
                if x.strip()):
            os.killpg(nodes[2].pid, 9)  # the SuperNode and every ClientApp process it started
            killed = time.monotonic() - t0
        if _record(run_dir).get("status") in ("completed", "failed"):
            break
        if cli.poll() is not None and cli.returncode != 0:
            break
        time.sleep(0.5)
    rec = _record(run_dir)
    msg = dep.diag()
    assert killed, "the first round never completed" + msg
    assert rec.get("status") == "completed", f"run {rec.get('status')!r}: {rec.get('error')!r}" + msg

    coord = [json.loads(x) for x in (run_dir / "ledger" / "coordinator.jsonl").read_text().splitlines() if x]
    rel = {e["payload_type"]: e for e in coord if e["payload_type"].startswith("release:")}
    assert sorted(rel["release:router-stats"]["info"]["included"]) == names  # before the kill
    for kind in ("release:model-update", "release:eval"):  # after it: the survivors
        assert sorted(rel[kind]["info"]["included"]) == names[:2], (kind, rel[kind]["info"]) + (msg,)
    errors = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
              if x and json.loads(x).get("event") == "party_error"]
    assert errors and all(e["party"] == "party-2" for e in errors), errors
    assert any(e["code"] in ("unavailable", "no-reply") for e in errors), errors

    from distmoe.audit import audit_run

    ledgers = sorted(tmp_path.glob("owners/party-*/work/ledger/*.jsonl"))
    canary_file = tmp_path / "auditor-canaries.txt"
    canary_file.write_text("".join((p / "canaries.txt").read_text() for p in parties))
    result = audit_run(run_dir, party_ledgers=ledgers, canaries=canary_file)
    assert result.verdict == "pass", [(c.name, c.findings) for c in result.checks if c.status == "fail"]


@pytest.mark.slow
def test_a_coordinator_that_asks_for_plaintext_is_refused_by_every_owner(deployment: Deployment, tmp_path: Path):
    """The attack: the coordinator submits ``privacy.mode = "plaintext"`` (unmodified pinned parties used to send
    plain updates, un-noised statistics and per-party rows). Every owner's SuperNode runs the deployed policy
    (``distmoe deploy supernode``'s default): each refuses every instruction with the fixed code
    ``policy-allow-plaintext`` before any work, so nothing but that code leaves any owner."""
    dep = deployment
    names, _, _, cli_home, ids, _ = _registered_federation(dep, tmp_path)
    run_dir = tmp_path / "run"
    overrides = tmp_path / "overrides.toml"
    overrides.write_text(to_toml({**OVERRIDES, "run.dir": str(run_dir), "privacy.mode": "plaintext",
                                  "federation.round-timeout": 60.0}))
    t0 = time.monotonic()
    cli = dep.start("flwr-run", [str(BIN / "flwr"), "run", str(REPO), CONN, "--stream",
                                 "--run-config", str(overrides)], cli_home)
    while time.monotonic() - t0 < RUN_DEADLINE:
        if _record(run_dir).get("status") in ("completed", "failed"):
            break
        if cli.poll() is not None and cli.returncode != 0:
            break
        time.sleep(1.0)
    msg = dep.diag()
    assert _record(run_dir).get("status") in ("completed", "failed"), f"run {_record(run_dir)}" + msg

    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    errors = [e for e in events if e.get("event") == "party_error"]
    assert {e["node"] for e in errors} == set(ids.values()), errors  # every owner refused (no setup: no names)
    assert {e["code"] for e in errors} == {"policy-allow-plaintext"}, errors
    assert not [e for e in events if e.get("event") in ("train", "stats", "eval") and not e.get("skipped")
                and e.get("party") != "all"], "a per-party row reached the coordinator" + msg
    for led in sorted(tmp_path.glob("owners/party-*/work/ledger/*.jsonl")):
        outs = [json.loads(x) for x in led.read_text().splitlines() if x.strip()]
        outs = [e for e in outs if e["direction"] == "out"]
        assert outs and all(e["payload_type"] == "error" and e["info"]["code"] == 1009 for e in outs), (led, outs)
    for name in names:  # no ClientApp did any work: no training line in any owner's log
        log = dep.logs[f"supernode-{name}"].read_text(errors="replace")
        assert "distmoe party" not in log or "loss" not in log, f"supernode-{name} trained" + msg
