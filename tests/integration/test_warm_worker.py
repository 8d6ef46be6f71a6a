"""The data owner's warm ClientApp worker (``clients/warm.py``) on real Flower 1.42 processes: the TLS +
node-auth deployment of ``test_deployment.py`` (its helpers; the ``deployment`` fixture of ``conftest.py``),
every SuperNode pinned with the default (warm) launcher.

A whole deployed run must be served by one worker per SuperNode (the imports paid once per party, not once
per message: ``<pin>/warm/starts.log`` has one line per worker start), each message in a forked child that
passed the code pin (one ``matches the pin`` line per message received), and still pass the audit. A worker
killed mid-run (SIGKILL, as a crash) costs nothing but a restart: the next message starts a new one and the
run completes with every round released. When its SuperNode stops, the worker stops too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from test_deployment import (
    BIN,
    CONN,
    N_PARTIES,
    OVERRIDES,
    REPO,
    RUN_DEADLINE,
    Deployment,
    _record,
    _registered_federation,
)

from distmoe.config import to_toml

pytestmark = pytest.mark.slow


def _workers(pin: Path) -> list[int]:
    path = pin / "warm" / "starts.log"
    return [int(line.split()[2]) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def test_a_deployed_run_is_served_by_one_warm_worker_per_supernode(deployment: Deployment, tmp_path: Path):
    dep = deployment
    names, parties, _, cli_home, _, nodes = _registered_federation(dep, tmp_path)
    pin, run_dir = tmp_path / "pin", tmp_path / "run"
    first = _workers(pin)  # started with the SuperNodes (clients.supernode), before any message
    assert len(first) == N_PARTIES and all(_alive(p) for p in first), f"workers at start: {first}" + dep.diag()

    overrides = tmp_path / "overrides.toml"
    overrides.write_text(to_toml({**OVERRIDES, "run.dir": str(run_dir), "schedule.sft-rounds": 2}))
    t0 = time.monotonic()
    cli = dep.start("flwr-run", [str(BIN / "flwr"), "run", str(REPO), CONN, "--stream",
                                 "--run-config", str(overrides)], cli_home)
    killed = None
    while time.monotonic() - t0 < RUN_DEADLINE:
        if killed is None and any(e.get("event") == "stats" for e in _events(run_dir)):
            killed = first[0]  # a crash of one owner's worker between rounds
            os.kill(killed, signal.SIGKILL)
        if _record(run_dir).get("status") in ("completed", "failed") or (cli.poll() is not None and cli.returncode):
            break
        time.sleep(0.5)
    rec = _record(run_dir)
    assert rec.get("status") == "completed", f"run {rec.get('status')!r}: {rec.get('error')!r}" + dep.diag()
    assert killed is not None, "the run ended before its statistics round was seen" + dep.diag()
    events = _events(run_dir)
    trains = [e for e in events if e.get("event") == "train"]
    assert len(trains) == 2 and not any(e.get("skipped") for e in trains), f"train rounds: {trains}" + dep.diag()
    assert not [e for e in events if e.get("event") == "party_error"], "party errors" + dep.diag()

    # one worker per SuperNode for the whole run, plus the one restart after the crash
    workers = _workers(pin)
    assert len(workers) == N_PARTIES + 1 and workers[:N_PARTIES] == first, f"worker starts: {workers}" + dep.diag()
    received = served = ready = 0
    for name in names:
        log = dep.logs[f"supernode-{name}"].read_text(errors="replace")
        n = log.count("Receiving: ")
        passed = log.count("distmoe code pin: the app bundle's party code matches the pin")
        assert n >= 8 and passed >= n, f"supernode-{name}: {n} messages, {passed} passed the pin" + dep.diag()
        assert "ready (" in log, f"supernode-{name}: no warm worker" + dep.diag()
        received += n
        served += len(re.findall(r"distmoe warm worker: child \d+ exited 0 after", log))
        ready += len(re.findall(r"distmoe warm worker \d+: ready \(", log))
    # every message served by a forked child of a warm worker (the killed worker's last child is not reported)
    assert served >= received - 1 and ready == N_PARTIES + 1, (
        f"{received} messages, {served} children exited 0, {ready} workers ready" + dep.diag())

    # the audit over the coordinator's and the owners' ledgers
    from distmoe.audit import audit_run

    ledgers = sorted(tmp_path.glob("owners/party-*/work/ledger/*.jsonl"))
    canaries = tmp_path / "canaries.txt"
    canaries.write_text("".join((p / "canaries.txt").read_text() for p in parties))
    result = audit_run(run_dir, party_ledgers=ledgers, canaries=canaries)
    assert result.verdict == "pass", [(c.name, c.findings) for c in result.checks if c.status == "fail"]

    # the workers end with their SuperNodes
    for node in nodes:
        node.send_signal(signal.SIGTERM)
    for node in nodes:
        node.wait(timeout=30)
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in workers if p != killed) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [p for p in workers if p != killed and _alive(p)]
    assert not left, f"warm workers still running after their SuperNodes stopped: {left}" + dep.diag()
