"""The long-run driver ``bench/rl_long.py``: a few GRPO iterations of one arm through ``run_arm`` log every field,
resume from their checkpoint, and the collapse rule and the deployed win rate behave as documented."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _driver():
    """``bench/rl_long.py`` as a module (``bench/`` is not a package)."""
    if "bench_rl_long" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_rl_long", ROOT / "bench" / "rl_long.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_rl_long"] = mod  # dataclasses look their module up while the class is created
        spec.loader.exec_module(mod)
    return sys.modules["bench_rl_long"]


def _args(**kw) -> argparse.Namespace:
    base = {"prompts": 4, "group": 2, "tokens": 4, "lr": 3e-4, "minibatches": 1, "iters": 3, "chunk": 2}
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture(scope="module")
def start():
    """Seed 0's starting model after a short SFT (~3-6 s): rewards are not all equal, so the updates act."""
    return _driver().start_model(0, sft_steps=150)


@pytest.mark.parametrize("arm", ["icepop", "simulator"])
def test_three_iterations_log_every_field_and_resume(tmp_path, arm, start):
    rl = _driver()
    before = {k: v.clone() for k, v in start.model.state_dict().items()}
    out = tmp_path / f"prune-2-{arm}-s0.jsonl"
    rows = rl.run_arm(start, _args(), "prune-2", arm, 0, out)
    assert [r["iter"] for r in rows] == [0, 1, 2]  # two run_grpo calls: 2 + 1 steps
    for r in rows:
        assert set(rl.LOGGED) <= set(r)
        for k in ("reward", "logp_diff_mean", "logp_diff_max", "k3", "masked_frac", "time_s"):
            assert math.isfinite(r[k]), k
        assert 0.0 <= r["reward"] <= 1.0 and 0.0 <= r["masked_frac"] <= 1.0
        assert r["logp_diff_max"] >= r["logp_diff_mean"] >= 0.0
        assert r["logp_diff_mean"] > 0  # prune-2 differs from the trainer
        assert math.isfinite(r["sim_trusted"]) == (arm == "simulator")
    assert [json.loads(x)["iter"] for x in out.read_text().splitlines()] == [0, 1, 2]
    assert all((v == before[k]).all() for k, v in start.model.state_dict().items())  # the start model is kept
    saved = rl.torch.load(out.with_suffix(".pt"), weights_only=True)
    assert saved["iters"] == 3
    assert any((saved["state"][k] != v).any() for k, v in before.items())  # the updates changed the policy
    same = json.dumps  # rows hold NaN (NaN != NaN): compare their JSON
    assert same(rl.run_arm(start, _args(), "prune-2", arm, 0, out)) == same(rows)  # finished: reused, not rerun
    more = rl.run_arm(start, _args(iters=4), "prune-2", arm, 0, out)  # resumes at iteration 3
    assert [r["iter"] for r in more] == [0, 1, 2, 3] and same(more[:3]) == same(rows)


def test_collapse_rule():
    rl = _driver()

    def rows(rewards, skipped_at=None):
        return [{"iter": i, "reward": r, "skipped_steps": float(i == skipped_at)} for i, r in enumerate(rewards)]
    assert rl.collapse_at(rows([0.5] * 400)) is None
    assert rl.collapse_at(rows([0.5] * 400, skipped_at=7)) == 7
    assert rl.collapse_at(rows([0.5] * 200 + [math.nan] + [0.5] * 10)) == 200
    # a drop to 0.1 (below half the peak) that lasts: the moving average crosses half the peak within the window
    col = rl.collapse_at(rows([0.5] * 200 + [0.1] * 300))
    assert col is not None and 200 <= col < 200 + rl.COLLAPSE_WINDOW
    assert rl.collapse_at(rows([0.5] * 200 + [0.1] * 60 + [0.5] * 200)) is None  # too short a dip


def test_trigger_shares_count_the_iterations_beyond_each_default_threshold():
    rl = _driver()
    rows = [{"sim_err_shift": math.nan, "sim_route_shift": math.nan},  # a scheduled fit: neither trigger looked
            {"sim_err_shift": 0.6, "sim_route_shift": 0.0}, {"sim_err_shift": 0.4, "sim_route_shift": 0.2},
            {"sim_err_shift": 0.9, "sim_route_shift": 0.3}]
    assert rl._share(rows, "sim_err_shift", rl._RL.simulator_error_shift) == 0.5  # 0.6 and 0.9 exceed 0.5
    assert rl._share(rows, "sim_route_shift", rl._RL.simulator_route_shift) == 0.5  # 0.2 and 0.3 exceed 0.1
    assert math.isnan(rl._share([{"reward": 1.0}], "sim_err_shift", 0.5))  # not a simulator run


def test_win_rate(start):
    rl = _driver()
    w = rl.win_rate(start.model, start.model, start.tok, start.heldout[:8], "bf16", 4, 6, seed=3)
    assert w["win_rate"] == 0.5 and w["heldout_reward_final"] == w["heldout_reward_start"]  # itself: all ties
    untrained = rl.start_model(0, sft_steps=0).model  # one SFT step: answers nothing right
    w = rl.win_rate(start.model, untrained, start.tok, start.heldout[:8], "bf16", 4, 6, seed=3)
    assert w["heldout_reward_start"] == 0.0 and w["heldout_reward_final"] > 0.0
    assert w["win_rate"] == pytest.approx(0.5 + 0.5 * w["heldout_reward_final"])  # wins where right, ties elsewhere
