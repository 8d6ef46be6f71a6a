"""The mismatch-correction gate ``bench/e2_gate.py``: its held-out split is disjoint from training, and the
pre-registered head-to-head statistic (win rate with a prompt-clustered bootstrap) and the gate rule behave as its
docstring says. Fast: no model is trained."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _driver():
    """``bench/e2_gate.py`` as a module (``bench/`` is not a package)."""
    if "bench_e2_gate" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_e2_gate", ROOT / "bench" / "e2_gate.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_e2_gate"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["bench_e2_gate"]


def test_heldout_words_are_never_trained_on():
    train, held = _driver().split(0)
    assert len(train) == 2000 and len(held) == 200
    words = lambda xs: {ex.prompt_messages[-1]["content"].split("\n")[-1] for ex in xs}  # noqa: E731
    assert not words(train) & words(held) and len(words(held)) == 200


def test_head_to_head_scores_pairs_and_clusters_by_prompt():
    d = _driver()
    # 2 seeds x 4 prompts x 2 samples; x wins every pair of prompt 0, loses every pair of prompt 1, ties elsewhere
    x = [[1, 1], [0, 0], [1, 0], [0, 0]]
    y = [[0, 0], [1, 1], [1, 0], [0, 0]]
    recs = [{"seed": s, "a": x, "b": y} for s in (0, 1)]
    h = d.head_to_head(recs, "a", "b", boot=400)
    assert h["h"] == 0.5 and h["d"] == 0.0 and h["h_per_seed"] == [0.5, 0.5] and h["seeds"] == [0, 1]
    assert h["h_lo"] < 0.5 < h["h_hi"]  # resampling prompts moves the win rate: the interval is not degenerate
    assert d.head_to_head(recs, "b", "a", boot=400)["h"] == 0.5
    better = [{"seed": s, "a": [[1, 1]] * 4, "b": [[0, 0]] * 4} for s in (0, 1)]
    w = d.head_to_head(better, "a", "b", boot=100)
    assert w["h"] == 1.0 and w["h_lo"] == w["h_hi"] == 1.0 and w["d"] == 1.0
    assert d.head_to_head(recs, "a", "missing") == {}


def test_gate_rule_needs_the_uncorrected_arm_clearly_behind(tmp_path):
    d = _driver()
    for s in (0, 1):
        (tmp_path / f"sft-s{s}.json").write_text(json.dumps({"sft_steps": 70, "heldout_reward_exact": 0.3}))
    args = argparse.Namespace(seeds=[0, 1], engine="int2g32-experts", iters=400)
    behind = [[0, 0]] * 30 + [[1, 1]] * 10  # none exact on 10 of 40 prompts, exact on 40 of 40
    for s in (0, 1):
        (tmp_path / f"deployed-s{s}.json").write_text(json.dumps(
            {"seed": s, "sft": behind, "none": behind, "exact": [[1, 1]] * 40}))
    res = d.table(args, tmp_path)
    assert res["gate"]["h"] == 0.125 and res["gate_passes"] is True  # ties on 10 of 40 prompts, losses elsewhere
    for s in (0, 1):  # level: the gate must fail
        (tmp_path / f"deployed-s{s}.json").write_text(json.dumps(
            {"seed": s, "sft": behind, "none": behind, "exact": behind}))
    assert d.table(args, tmp_path)["gate_passes"] is False
    assert json.loads((tmp_path / "gate.json").read_text())["gate_passes"] is False


def test_each_milestone_keeps_its_own_deployed_rewards_and_gate(tmp_path):
    d = _driver()
    assert d.deployed_path(tmp_path, 3, 400).name == "deployed-s3.json"  # the first gate's files keep their names
    assert d.deployed_path(tmp_path, 3, 1500).name == "deployed-s3-i1500.json"
    (tmp_path / "sft-s0.json").write_text(json.dumps({"sft_steps": 70, "heldout_reward_exact": 0.3}))
    d.deployed_path(tmp_path, 0, 400).write_text(json.dumps({"seed": 0, "sft": [[0]], "none": [[0]], "exact": [[1]]}))
    d.deployed_path(tmp_path, 0, 1500).write_text(json.dumps({"seed": 0, "sft": [[0]], "none": [[1]], "exact": [[1]]}))
    at = {n: d.table(argparse.Namespace(seeds=[0], engine="e", iters=n), tmp_path)["gate"]["h"] for n in (400, 1500)}
    assert at == {400: 0.0, 1500: 0.5} and (tmp_path / "gate-i1500.json").exists() and (tmp_path / "gate.json").exists()
