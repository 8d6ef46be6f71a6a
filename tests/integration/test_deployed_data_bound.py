"""A data owner above the public data bound ``privacy.num-sequences-max``, on the TLS + node-auth deployment of
``test_deployment.py`` (its helpers; the ``deployment`` fixture of ``conftest.py``): real SuperLink, three pinned
SuperNodes with the deployed owner policy, ``flwr run``, the audit over every owner's ledger.

The attack it closes: whether a party answered or refused with the ``data`` code once told a coordinator that varied
the bound over runs its exact size (a binary search). The owner above the bound must take part like any party
without data for the task: its router-statistics input carries no rows (contributor bit 0), its messages are the same
kinds and sizes as every other owner's, no error code reaches the coordinator, the released sum is the other owners'
alone, and only its own log says why. ``tests/party/test_work.py`` runs the binary search on the party function;
this runs the deployed processes.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from pathlib import Path

import pytest
from test_deployment import (
    BIN,
    CONN,
    N_PARTIES,
    OVERRIDES,
    REPO,
    Deployment,
    _federation,
    _record,
    _start_supernode,
    _wait_online,
)

from distmoe.config import parse_run_config, to_toml
from distmoe.data.party import load_party
from distmoe.data.synth import write_synthetic
from distmoe.wire.at_rest import make_private

pytestmark = pytest.mark.slow

RUN_DEADLINE = 1500.0  # three rounds: 186 s and 164 s each for the first two at load 22 on 2 cores
BOUND = 40  # privacy.num-sequences-max: above the two small owners' 19-21 arith training sequences, below the large's


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def test_an_owner_above_the_data_bound_takes_part_with_no_rows_and_no_error(deployment: Deployment, tmp_path: Path):
    dep = deployment
    names = [f"party-{i}" for i in range(N_PARTIES)]
    data = write_synthetic(tmp_path / "data", N_PARTIES, 24, 0, canaries=1)
    large = write_synthetic(tmp_path / "large", N_PARTIES, 96, 1, canaries=1)[-1]
    data[-1] = large  # the last owner holds about four times the others' data
    for pdir in data:
        make_private(pdir)
    overrides = {**OVERRIDES, "run.dir": str(tmp_path / "run"), "privacy.num-sequences-max": BOUND,
                 "privacy.min-parties": 2, "federation.round-timeout": 180.0}
    cfg = parse_run_config(overrides)
    sizes = [len(load_party(p, cfg.data).stats_train("arith")) for p in data]
    assert max(sizes[:-1]) <= BOUND < sizes[-1], sizes  # the last owner is above the bound, the others below
    big = names[-1]

    # every owner's policy floor of min-parties is 2, so that the round may release over the two contributors
    creds, port, cli_home, ids = _federation(dep, tmp_path, names, register=names)
    nodes = [_start_supernode(dep, tmp_path, creds, n, port, p, ("--policy-min-parties", "2"))
             for n, p in zip(names, data, strict=True)]
    _wait_online(dep, cli_home, set(ids.values()), [dep.procs[0], *nodes])

    run_dir = tmp_path / "run"
    (tmp_path / "overrides.toml").write_text(to_toml(overrides))
    t0 = time.monotonic()
    cli = dep.start("flwr-run", [str(BIN / "flwr"), "run", str(REPO), CONN, "--stream",
                                 "--run-config", str(tmp_path / "overrides.toml")], cli_home)
    while time.monotonic() - t0 < RUN_DEADLINE:
        if _record(run_dir).get("status") in ("completed", "failed") or (cli.poll() is not None and cli.returncode):
            break
        time.sleep(1.0)
    rec = _record(run_dir)
    msg = dep.diag()
    assert rec.get("status") == "completed", f"run {rec.get('status')!r}: {rec.get('error')!r}" + msg

    # no error code from any owner: the owner above the bound answered every message as the others did
    events = _lines(run_dir / "metrics.jsonl")
    assert not [e for e in events if e.get("event") == "party_error"], "a party error reached the coordinator" + msg
    coord = _lines(run_dir / "ledger" / "coordinator.jsonl")
    received: dict[str, list] = defaultdict(list)  # party -> [(round, phase, kind, bytes)] of what it sent
    for e in coord:
        if e["direction"] == "in" and e.get("peer") in names:
            received[e["peer"]].append((e["round"], e["phase"], e["payload_type"], e["bytes"]))
    assert all(kind != "error" for got in received.values() for _, _, kind, _ in got), received
    for name in names[:-1]:  # the same messages, kind by kind and byte by byte: no size-dependent reply
        assert sorted(received[big]) == sorted(received[name]), (big, name)
    assert any(kind == "masked-input:router-stats" for _, _, kind, _ in received[big]), received[big]

    # the router statistics were released over all three inputs, and the sum holds none of the large owner's rows:
    # every layer's row sum is the two small owners' sequence count (x scale) within the recorded noise
    rel = next(e for e in coord if e["payload_type"] == "release:router-stats")
    assert sorted(rel["info"]["included"]) == names, rel["info"]
    dp = rel["dp"]
    row_sd = math.sqrt(rel["info"]["experts"]) * dp["sigma_int"]  # the noise of one layer's row sum
    small, everyone = sum(sizes[:-1]) * dp["scale"], sum(sizes) * dp["scale"]
    assert (everyone - small) > 12 * row_sd, (sizes, dp)  # the test can tell the two apart
    for row in rel["info"]["row_sums"]:
        assert abs(row - small) < 6 * row_sd, (row, small, everyone, row_sd)
    stats = next(e for e in events if e.get("event") == "stats")
    assert abs(stats["num_sequences"] - sum(sizes[:-1])) < 6 * row_sd / dp["scale"], (stats, sizes)

    # the reason is in the owner's own log only, never at the coordinator
    assert "above privacy.num-sequences-max" in dep.logs[f"supernode-{big}"].read_text(errors="replace"), msg
    for where in [*run_dir.rglob("*.json"), *run_dir.rglob("*.jsonl"), dep.logs["flwr-run"], dep.logs["superlink"]]:
        assert "num-sequences-max =" not in where.read_text(errors="replace"), f"the refusal's reason in {where}"

    # the later rounds had every owner's data: the model update and the evaluation over all three
    rel = {e["payload_type"]: e for e in coord if e["payload_type"].startswith("release:")}
    for kind in ("release:model-update", "release:eval"):
        assert sorted(rel[kind]["info"]["included"]) == names, (kind, rel[kind]["info"])

    # the audit over the coordinator's ledger and every owner's own ledger passes
    from distmoe.audit import audit_run

    ledgers = sorted(tmp_path.glob("owners/party-*/work/ledger/*.jsonl"))
    assert len(ledgers) == N_PARTIES, ledgers
    canaries = tmp_path / "canaries.txt"
    canaries.write_text("".join((p / "canaries.txt").read_text() for p in data))
    result = audit_run(run_dir, party_ledgers=ledgers, canaries=canaries)
    assert result.verdict == "pass", [(c.name, c.findings) for c in result.checks if c.status == "fail"]
