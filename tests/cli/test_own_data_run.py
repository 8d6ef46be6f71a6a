"""``distmoe simulate --data`` on a user's own task names, end to end on Flower's Simulation Engine (slow).

Party files named after the user's tasks (``train.jsonl``, ``support.jsonl``) used to stop
with "task(s) lookup, arith are held by no party"; with no schedule set, the run now derives the continual
schedule over the data's tasks (name order), prints it first, and completes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distmoe.simulate import SimOptions, run
from distmoe.wire.at_rest import make_private

TINY = {"model.hidden-size": 64, "model.moe-intermediate-size": 64, "model.layers": 2, "model.heads": 2,
        "model.kv-heads": 1, "model.head-dim": 32, "train.local-steps": 4, "schedule.sft-rounds": 1}


@pytest.mark.slow
def test_simulate_own_task_names_without_a_schedule(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "outer-home"))
    (tmp_path / "outer-home").mkdir()
    data = tmp_path / "data"
    for p in ("clinic-a", "clinic-b"):
        (data / p).mkdir(parents=True)
        for t in ("train", "support"):
            (data / p / f"{t}.jsonl").write_text("".join(
                f'{{"instruction": "{t} {i}", "output": "{t[0]}{i % 7}"}}\n' for i in range(16)))
        make_private(data / p)
    code, run_dir = run(SimOptions(overrides=dict(TINY), data=data, runs_dir=tmp_path / "runs", run_id="own",
                                   timeout=600, report=False))
    out = capsys.readouterr().out
    log = (run_dir / "flower.log").read_text() if (run_dir / "flower.log").exists() else ""
    assert code == 0, f"simulate failed:\n{out[-3000:]}\n{log[-3000:]}"
    first = out.splitlines()[0]
    assert first.startswith("distmoe simulate: schedule derived from the tasks in --data (support, train")
    assert "sft:support -> eval -> stats:support -> sft:train -> eval (5 rounds)" in first
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["status"] == "completed" and sorted(rec["parties"]) == ["clinic-a", "clinic-b"]
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["round"] for e in events if e["event"] == "train"] == [1, 4]
    assert any(e["event"] == "stats" and e["task"] == "support" for e in events)
    final = [e for e in events if e["event"] == "eval" and e["party"] == "all"][-1]
    assert "acc/support" in final and "acc/train" in final  # retention of the first task is measured
