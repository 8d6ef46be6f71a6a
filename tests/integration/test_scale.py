"""Scale: a 20-party ``distmoe simulate`` run with secure aggregation completes on a 2-core machine.

Slow (about 80 s for the run plus ~20 s for the audit on a shared 2-core box): a real local SuperLink, Flower's
Simulation Engine on Ray with 1 CPU per virtual SuperNode (so two ClientApp actors serve the 20 parties in
turn), the tiny model, three SFT rounds, stats and eval, ``privacy.mode = "secagg"`` (threshold 11 of 20).
Time per round, peak memory and the per-party cost of the SecAgg stages are measured by ``bench/scale.py``
(``docs/results.md``, "Scale"), not asserted here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distmoe.simulate import SimOptions, processes_with_token, run

TINY20 = {"model.hidden-size": 64, "model.moe-intermediate-size": 64, "model.layers": 2, "model.heads": 2,
          "model.kv-heads": 1, "model.head-dim": 32, "train.local-steps": 8, "data.synth-examples": 40,
          "schedule.phases": "sft:lookup*3, stats:lookup, eval", "privacy.mode": "secagg", "checkpoint.keep": 1}


@pytest.mark.slow
def test_simulate_twenty_parties_with_secure_aggregation(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "outer-home"))
    (tmp_path / "outer-home").mkdir()
    code, run_dir = run(SimOptions(overrides=dict(TINY20), parties=20, runs_dir=tmp_path / "runs", run_id="s20",
                                   timeout=600, report=False, echo=True))
    log = (run_dir / "flower.log").read_text() if (run_dir / "flower.log").exists() else ""
    assert code == 0, f"simulate failed; log tail:\n{log[-4000:]}"
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["status"] == "completed" and rec["privacy"]["mode"] == "secagg"
    assert rec["privacy"]["threshold"] == 11 and len(rec["parties"]) == 20
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [e for e in events if e["event"] == "train"]
    assert {e["party"] for e in train} == {"all"}  # the coordinator sees only secure sums
    assert [(e["round"], e["parties"]) for e in train] == [(1, 20), (2, 20), (3, 20)]
    assert all(e["contributors"] == 20 and "loss_last" not in e for e in train)  # uniform weights, no metrics
    assert [e["parties"] for e in events if e["event"] == "stats" and e["party"] == "all"] == [20]
    assert any(e["event"] == "eval" and e["party"] == "all" and e["round"] == 5 for e in events)
    sim = json.loads((run_dir / "simulate.json").read_text())
    assert processes_with_token(sim["token"]) == []
    assert not [line for line in log.splitlines() if "Traceback" in line], log[-3000:]

    from distmoe.audit import audit_run

    result = audit_run(run_dir)
    assert result.verdict == "pass", [(c.name, c.findings) for c in result.checks if c.status == "fail"]
    assert len(list((run_dir / "work").glob("*/ledger/*.jsonl"))) == 20
