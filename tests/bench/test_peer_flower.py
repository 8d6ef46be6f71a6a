"""``bench/peer_flower.py``'s reading of per-round times: Flower's timestamped round lines (the peer) and the
coordinator ledger's timestamps (distmoe), on files laid out as the two runs write them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "peer_flower.py"
_spec = importlib.util.spec_from_file_location("peer_flower_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_peer_rounds_from_flowers_round_lines(tmp_path):
    log = tmp_path / "rounds.log"
    log.write_text("100.000000 Starting FedAvg strategy:\n100.5 \n101.000000 [ROUND 1/3]\n"
                   "101.1 configure_train: Sampled 3 nodes (out of 3)\n131.000000 [ROUND 2/3]\n"
                   "146.000000 [ROUND 3/3]\n160.500000 Strategy execution finished in 59.50s\n")
    assert bench.peer_rounds(log, 3) == pytest.approx([30.0, 15.0, 14.5])
    with pytest.raises(SystemExit, match="did not finish its 4 rounds"):
        bench.peer_rounds(log, 4)


def test_distmoe_rounds_and_parts_from_the_coordinator_ledger(tmp_path):
    rows = [(0, "setup-request", 10.0), (1, "sft-instruction", 20.0), (1, "sft-instruction", 20.1),
            (1, "release:model-update", 40.0), (1, "probe-instruction", 40.5), (2, "sft-instruction", 42.0),
            (2, "release:model-update", 60.0), (None, "run-end", 61.0)]
    (tmp_path / "ledger").mkdir()
    (tmp_path / "ledger" / "coordinator.jsonl").write_text("".join(
        json.dumps({"round": r, "payload_type": t, "time": s}) + "\n" for r, t, s in rows))
    per, parts = bench.ledger_rounds(tmp_path, 2)
    assert per == pytest.approx([22.0, 19.0])
    assert parts["update"] == pytest.approx([20.0, 18.0]) and parts["after"] == pytest.approx([2.0, 1.0])


def test_steady_rounds_leave_out_the_first_and_the_last():
    assert bench._steady([90.0, 10.0, 12.0, 30.0]) == pytest.approx(11.0)


def test_the_goal_is_shown_met_only_when_the_whole_corrected_interval_is_under_it():
    """Mean per-repetition ratio with its t-interval, Bonferroni-corrected over the arms compared: a tight set of
    ratios under the goal is shown met; the same mean with a spread that reaches over it is not."""
    tight = bench._interval_text([1.01, 1.02, 1.015, 1.012], 2, 1.05)
    assert "97.5 % t-interval" in tight and tight.endswith("shown met") and "not shown" not in tight
    wide = bench._interval_text([0.95, 1.10, 1.00, 1.01], 2, 1.05)
    assert wide.endswith("not shown met")
    assert "95.0 % t-interval" in bench._interval_text([1.0, 1.1], 1, None)
    assert bench._interval_text([1.0], 2, 1.05) == ""
