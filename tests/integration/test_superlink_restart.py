"""The coordinator's SuperLink failing the owners' SuperNodes for a while, and killed mid-run (SIGKILL, as a crash
or an out-of-memory kill does) and restarted on the same state database, port and credentials, on the deployment of
``test_deployment.py`` (TLS, SuperNode authentication, three pinned owners' SuperNodes through
``distmoe deploy supernode``).

A SuperLink that keeps Flower's link state in its database (``--link-state database``, or a stock
``flower-superlink``) and whose database is locked (as another writer or a stalled disk does) answers each
SuperNode's ask for a message with HTTP 500 after SQLite's 5 s busy wait (``database is locked``): flwr 1.42's
SuperNode ends its loop at the first and takes no more messages; ``clients.supernode`` asks again after a back-off,
so each owner's SuperNode logs the failures, stays up and is online again once the lock is gone. (With the default
``--link-state memory`` no ask touches the database: only a registration does.)

What flwr 1.42 does on a SuperLink killed mid-run, and what this test holds it to (``docs/deploy.md`` §1.2, "When
the SuperLink stops"): the run's ServerApp does not outlive its SuperLink (the SuperLink's SuperExec watches the
SuperLink's PID and exits with it, and the ServerApp's ``watch_parent`` then stops it with Flower's graceful exit;
flwr 1.42's own watch left it running for minutes), so the coordinator closes the run as ``interrupted`` with a
reason that names the SuperLink and ``distmoe deploy wait`` exits 1 with the next step; a restarted SuperLink does
not start that run again. The owners' SuperNodes retry the connection all the while, never exit, and are online
again once the SuperLink is back; the coordinator's ``run.resume`` then continues the run from its last checkpoint
over the same owners, and the audit over the coordinator's ledger, every owner's own ledger and signed receipt
passes, from their ledgers and from their receipts of both sessions: nothing of the interrupted session is lost or
contradicted.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
import test_deployment as td

from distmoe.config import to_toml
from distmoe.data.synth import write_synthetic
from distmoe.simulate import processes_with_token
from distmoe.wire.at_rest import make_private

LOCKED_S = 16.0  # seconds the SuperLink's state database is locked: 3 failed asks of each SuperNode (5 s each)
DOWN_S = 15.0  # seconds the SuperLink stays down: the SuperNodes' connection retries must outlast it
END_DEADLINE = 120.0  # seconds for the interrupted run's record to say so once the SuperLink is gone


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _processes(dep: td.Deployment) -> str:
    """The test's processes (PID, parent, state, command) for a failure message."""
    pids = {str(p) for p in processes_with_token(dep.token)}
    rows = subprocess.run(["ps", "-eo", "pid,ppid,stat,args"], capture_output=True, text=True).stdout.splitlines()
    return "\n----- processes -----\n" + "\n".join(r[:200] for r in rows if r.split(None, 1)[0] in pids)


def _run(dep: td.Deployment, name: str, cli_home: Path, cfg: Path, run_dir: Path, until) -> subprocess.Popen:
    """``flwr run`` of the repository's app with ``cfg``; polls until ``until()`` or the CLI fails."""
    cli = dep.start(name, [str(td.BIN / "flwr"), "run", str(td.REPO), td.CONN, "--stream", "--run-config",
                           str(cfg)], cli_home)
    t0 = time.monotonic()
    while time.monotonic() - t0 < td.RUN_DEADLINE and not until() and (cli.poll() or 0) == 0:
        time.sleep(0.5)
    return cli


def _superlink(dep: td.Deployment, tmp_path: Path, creds: Path, port: int, name: str) -> subprocess.Popen:
    """The coordinator's SuperLink as ``_federation`` starts it: same credentials, port, database, FLWR_HOME."""
    return dep.start(name, [*td.DISTMOE, "deploy", "superlink", "--credentials", str(creds), "--port", str(port),
                            "--database", str(tmp_path / "state.db"), "--flwr-home",
                            str(tmp_path / "flwr-superlink"), "--exec"], tmp_path / "flwr-superlink")


def _owners(dep: td.Deployment, tmp_path: Path, link_state: str = "memory"):
    """Three registered owners' SuperNodes online: (names, data dirs, credentials, port, CLI home, ids, nodes)."""
    names = [f"party-{i}" for i in range(td.N_PARTIES)]
    parties = write_synthetic(tmp_path / "data", td.N_PARTIES, 24, 0, canaries=1)
    for pdir in parties:
        make_private(pdir)
    creds, port, cli_home, ids = td._federation(dep, tmp_path, names, register=names, link_state=link_state)
    nodes = [td._start_supernode(dep, tmp_path, creds, name, port, pdir) for name, pdir in zip(names, parties,
                                                                                                strict=True)]
    td._wait_online(dep, cli_home, set(ids.values()), [dep.procs[0], *nodes])
    return names, parties, creds, port, cli_home, ids, nodes


@pytest.mark.slow
def test_supernodes_outlast_a_superlink_that_fails_their_asks_for_a_while(deployment: td.Deployment,
                                                                          tmp_path: Path):
    dep = deployment
    names, _, _, _, cli_home, ids, nodes = _owners(dep, tmp_path, link_state="database")
    db = sqlite3.connect(str(tmp_path / "state.db"), timeout=30, isolation_level=None)
    try:
        db.execute("BEGIN EXCLUSIVE")  # every write of the SuperLink (each ask's claim of a message) now fails
        time.sleep(LOCKED_S)
    finally:
        db.close()  # the lock goes with the connection
    msg = dep.diag()
    for name, node in zip(names, nodes, strict=True):
        assert node.poll() is None, f"supernode-{name} exited {node.returncode}" + msg
        log = dep.logs[f"supernode-{name}"].read_text(errors="replace")
        assert "distmoe supernode: the SuperLink failed the ask for a message" in log, f"supernode-{name}" + msg
    assert "database is locked" in dep.logs["superlink"].read_text(errors="replace"), msg
    deadline = time.monotonic() + 90  # each SuperNode's next ask, and its heartbeat, succeed again
    while td._online_nodes(dep, cli_home) != set(ids.values()) and time.monotonic() < deadline:
        time.sleep(1.0)
    assert td._online_nodes(dep, cli_home) == set(ids.values()), "a SuperNode went offline" + dep.diag()


@pytest.mark.slow
def test_a_superlink_killed_mid_run_interrupts_it_and_resume_completes_it(deployment: td.Deployment,
                                                                         tmp_path: Path):
    dep = deployment
    names, parties, creds, port, cli_home, ids, nodes = _owners(dep, tmp_path)
    run_dir = tmp_path / "run"
    overrides = {**td.OVERRIDES, "run.dir": str(run_dir), "checkpoint.every": 1}
    cfg = tmp_path / "overrides.toml"
    cfg.write_text(to_toml(overrides))

    # 1. the run, until its first round (statistics) is in; then the SuperLink is killed, the process alone
    _run(dep, "flwr-run", cli_home, cfg, run_dir, lambda: any(e.get("event") == "stats" for e in _events(run_dir))
         or td._record(run_dir).get("status") not in (None, "running"))
    assert any(e.get("event") == "stats" for e in _events(run_dir)), f"no first round: {td._record(run_dir)}" \
        + dep.diag()
    link = dep.procs[0]
    os.kill(link.pid, signal.SIGKILL)
    link.wait(timeout=30)
    killed = time.monotonic()

    # 2. the run's record says it was interrupted, and why, without the SuperLink
    while td._record(run_dir).get("status") == "running" and time.monotonic() - killed < END_DEADLINE:
        time.sleep(0.5)
    rec = td._record(run_dir)
    msg = dep.diag() + _processes(dep)
    assert rec.get("status") == "interrupted", f"run record after the SuperLink's kill: {rec.get('status')}" + msg
    assert "SuperLink" in rec.get("error", "") and "run.resume" in rec.get("error", ""), rec
    wait = subprocess.run([*td.DISTMOE, "deploy", "wait", str(run_dir), "--timeout", "5"], capture_output=True,
                          text=True, env=dep.env(cli_home), timeout=td.CLI_TIMEOUT)
    assert wait.returncode == 1 and "interrupted" in wait.stdout and "run.resume" in wait.stdout, (
        wait.returncode, wait.stdout, wait.stderr)

    # 3. the owners' SuperNodes wait out the outage (Flower retries the connection), then are online again
    time.sleep(max(0.0, DOWN_S - (time.monotonic() - killed)))
    for name, node in zip(names, nodes, strict=True):
        assert node.poll() is None, f"supernode-{name} exited {node.returncode} while the SuperLink was down" + msg
    link = _superlink(dep, tmp_path, creds, port, "superlink-restarted")
    td._wait_online(dep, cli_home, set(ids.values()), [link, *nodes])
    assert td._record(run_dir).get("status") == "interrupted", "the restarted SuperLink touched the run's record"
    ledger = run_dir / "ledger" / "coordinator.jsonl"
    closed = [json.loads(x) for x in ledger.read_text().splitlines() if x.strip()][-1]
    assert closed["payload_type"] == "run-end" and closed["info"].get("status") == "interrupted", closed

    # 4. the coordinator resumes the run from its last checkpoint over the same owners: it completes
    resume = tmp_path / "resume.toml"
    resume.write_text(to_toml({**overrides, "run.resume": str(run_dir)}))
    _run(dep, "flwr-run-resume", cli_home, resume, run_dir,  # the record says "interrupted" until the resume starts
         lambda: any(e.get("event") == "run_resume" for e in _events(run_dir))
         and td._record(run_dir).get("status") != "running")
    rec = td._record(run_dir)
    msg = dep.diag()
    assert rec.get("status") == "completed", f"resumed run: {rec}" + msg
    entries = [json.loads(x) for x in ledger.read_text().splitlines() if x.strip()]
    assert [e["payload_type"] for e in entries].count("run-resume") == 1, "no run-resume entry" + msg
    assert {e.get("event") for e in _events(run_dir)} >= {"stats", "train", "eval", "run_resume"}, msg
    for name, node in zip(names, nodes, strict=True):  # the same SuperNode processes served both sessions
        assert node.poll() is None, f"supernode-{name} exited {node.returncode}" + msg
        log = dep.logs[f"supernode-{name}"].read_text(errors="replace")
        assert "Sending: train.sft message" in log and "distmoe client:" not in log, f"supernode-{name}" + msg

    # 5. nothing of either session is lost from the owners' records: the audit over the coordinator's ledger and each
    # owner's own ledger passes (chains, signatures, the heads each side anchored, epsilon charged, canaries); each
    # owner signed one receipt per session (named by that session's Flower run id), and its last one holds its
    # ledger's last entry; the audit over the coordinator's ledger and every owner's receipts of both sessions (alone,
    # and beside the owners' ledgers) passes, each receipt judged against its own session's entries.
    from distmoe.audit import audit_run
    from distmoe.deploy.receipt import read_receipt

    ledgers = sorted(tmp_path.glob("owners/party-*/work/ledger/*.jsonl"))
    assert len(ledgers) == td.N_PARTIES, ledgers
    canary_file = tmp_path / "auditor-canaries.txt"
    canary_file.write_text("".join((p / "canaries.txt").read_text() for p in parties))
    result = audit_run(run_dir, party_ledgers=ledgers, canaries=canary_file)
    assert result.verdict == "pass", [(c.name, c.findings) for c in result.checks if c.status == "fail"]
    sessions = {rec["run_id"], *(r["session"] for r in rec.get("resumes", []))}
    assert len(sessions) == 2, rec.get("resumes")
    for led in ledgers:
        party, entries = led.stem, [json.loads(x) for x in led.read_text().splitlines() if x.strip()]
        assert {e["run"] for e in entries} == sessions, (party, {e["run"] for e in entries})
        got = {}
        for path in sorted((led.parent.parent / "receipts").glob(f"{party}-*.json")):
            body = read_receipt(json.loads(path.read_text()), (led.with_suffix(".pub")).read_text().strip())
            got[body["run"]] = body
        assert set(got) == sessions, (party, sorted(got))
        last = got[entries[-1]["run"]]
        assert last["ledger_head"] == {"seq": entries[-1]["seq"], "hash": entries[-1]["hash"]}, (party, last)
    receipts = sorted(p for led in ledgers for p in (led.parent.parent / "receipts").glob(f"{led.stem}-*.json"))
    assert len(receipts) == 2 * td.N_PARTIES, receipts
    for given in ([], ledgers):  # the owners' receipts alone, then beside their ledgers
        result = audit_run(run_dir, party_ledgers=given, canaries=canary_file, receipt_files=receipts)
        assert result.verdict == "pass" and result.check("receipts").status == "pass", [
            (c.name, c.findings) for c in result.checks if c.status == "fail"]
        assert result.unwitnessed == [], result.unwitnessed
