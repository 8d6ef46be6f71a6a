"""The ``dpo``, ``rl``, ``stats`` and ``eval`` steps (``distmoe.coordinator.phases``) on hand-made sums: what each
sends and what a released sum does to the round state and the log. No coordinator, no transport."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from distmoe.coordinator.aggregator import EvalSum, StatsSum, UpdateSum
from distmoe.coordinator.errors import RunFailed
from distmoe.coordinator.phases import PHASES
from distmoe.coordinator.phases.evaluate import retention
from distmoe.routing.anchor import load_anchor


def _zero(weights: dict) -> dict[str, np.ndarray]:
    return {k: np.zeros(tuple(v.shape), np.float32) for k, v in weights.items()}


def test_dpo_keeps_the_phase_reference_and_sends_it_from_the_second_round(make_ctx, configure):
    ctx = make_ctx("sft:arith, dpo:arith*2")
    first_round = ctx.cfg.schedule.phases[0].rounds + 1  # the dpo phase's first round
    ctx.s = replace(ctx.s, current_task="arith", trained_tasks=["arith"], round=first_round)
    step, phase = PHASES["dpo"], ctx.cfg.schedule.phases[1]
    first = configure(step, ctx, phase)
    assert first.objective == "dpo" and first.ref_weights is None  # round 1 of the phase: the reference is kept
    ref = {k: v.clone() for k, v in ctx.s.ref_weights.items()}
    ctx.s = replace(ctx.s, weights={k: v + 1.0 for k, v in ctx.s.weights.items()}, round=first_round + 1)
    second = configure(step, ctx, phase)
    assert set(second.ref_weights) == set(ref)
    for k, v in ref.items():  # the phase's reference, not the moved global model
        np.testing.assert_array_equal(second.ref_weights[k], v.numpy())
    per_round = make_ctx("sft:arith, dpo:arith*2", rnd=first_round + 1, **{"dpo.reference": "round"})
    per_round.s = replace(per_round.s, current_task="arith", ref_weights=ref)
    assert configure(step, per_round, phase).ref_weights is None  # each party's reference is the model it receives
    assert step.request(ctx, 1, phase, second).release == "model-update"  # the sft release, dpo metric slots


def test_rl_marks_the_task_and_applies_its_update(make_ctx, read_metrics, configure):
    ctx = make_ctx("rl:arith", **{"privacy.mode": "plaintext"})
    step, phase = PHASES["rl"], ctx.cfg.schedule.phases[0]
    instr = configure(step, ctx, phase)
    assert ctx.s.trained_tasks == ["arith"] and ctx.s.current_task is None  # rl tunes the task, begins no stage
    req = step.request(ctx, 0, phase, instr)
    assert (req.sum, req.kind, req.release) == ("update", "rl", "rl-update")
    delta = {k: np.full(tuple(v.shape), -0.5, np.float32) for k, v in ctx.s.weights.items()}
    before = {k: v.clone() for k, v in ctx.s.weights.items()}
    agg = {"reward_first": 0.1, "reward_last": 0.4, "logp_diff_mean": 0.01, "logp_diff_max": 0.2,
           "masked_frac_low": 0.001, "masked_frac_high": 0.002, "k3": 1e-3}
    ctx.s, line = step.aggregate(ctx, 0, phase, instr, UpdateSum(delta, agg, 12, 2, 3))
    assert line.startswith("2/3 parties | reward 0.100 -> 0.400") and "masked 0.0030" in line
    for k, v in ctx.s.weights.items():
        torch.testing.assert_close(v, before[k] - 0.5)
    [m] = read_metrics(ctx, "rl")
    assert m["engine"] == ctx.cfg.rl.engine and m["num_examples"] == 12


def test_stats_builds_the_next_anchor_version_from_the_released_sum(make_ctx, read_metrics):
    ctx = make_ctx("sft:arith, stats:arith", rnd=2)
    step, phase = PHASES["stats"], ctx.cfg.schedule.phases[1]
    instr = step.configure(ctx, phase)
    assert instr.task == "arith" and step.request(ctx, 1, phase, instr).sum == "stats"
    L, E = ctx.mspec.num_moe_layers, ctx.mspec.num_experts
    total = np.tile(np.arange(1, E + 1, dtype=np.float64), (L, 1)) * 10  # [L, E]
    total[0, 0] = -3.0  # noise below zero: clipped to no mass
    ctx.s, line = step.aggregate(ctx, 1, phase, instr, StatsSum(total, 3, 3, "DP note"))
    a = ctx.s.anchor
    assert a.meta.version == 1 and ctx.s.anchor_versions == 1 and ctx.s.task_anchors["arith"] is a
    assert np.allclose(a.probs.sum(1), 1.0) and a.probs[0, 0] == 0.0
    assert np.allclose(a.probs[1], np.arange(1, E + 1) / np.arange(1, E + 1).sum())
    assert load_anchor(ctx.run_dir / "anchors" / "round-2.npz").meta.version == 1  # saved with its version
    assert "anchor v1" in line and line.endswith("DP note")
    [m] = read_metrics(ctx, "stats")
    assert m["anchor_version"] == 1 and m["parties"] == 3


def test_stats_of_all_noise_leave_the_anchor_and_never_stop_the_run(make_ctx, read_metrics):
    ctx = make_ctx("stats:arith", **{"federation.on-round-failure": "stop"})
    step, phase = PHASES["stats"], ctx.cfg.schedule.phases[0]
    L, E = ctx.mspec.num_moe_layers, ctx.mspec.num_experts
    total = np.full((L, E), -1.0)
    ctx.s, _ = step.aggregate(ctx, 0, phase, step.configure(ctx, phase), StatsSum(total, 3, 3, ""))
    assert ctx.s.anchor is None and ctx.s.anchor_versions == 0
    assert "router statistics are empty" in read_metrics(ctx, "round_skipped")[0]["detail"]
    with pytest.raises(RunFailed):  # a failed round under `stop` does end the run: the rule is the context's
        ctx.round_failed("nothing", failed=True)


def test_eval_reports_retention_against_the_baseline_of_the_current_task(make_ctx, read_metrics):
    ctx = make_ctx("sft:arith, sft:strings, eval", rnd=3)
    ctx.s = replace(ctx.s, trained_tasks=["arith", "strings"], current_task="strings",
                    baseline={"all": {"acc/arith": 0.8, "acc_sd/arith": 0.01}})
    step, phase = PHASES["eval"], ctx.cfg.schedule.phases[2]
    instr = step.configure(ctx, phase)
    assert instr.tasks == ("arith", "strings") and instr.new_task == "strings"
    agg = {"acc/arith": 0.6, "acc_sd/arith": 0.02, "loss/arith": 1.0, "acc/strings": 0.5, "loss/strings": 2.0,
           "n/arith": 9.0, "n/strings": 9.0}
    s, line = step.aggregate(ctx, 2, phase, instr, EvalSum({"all": dict(agg)}, 3, 3))
    [m] = read_metrics(ctx, "eval")
    assert m["retention/arith"] == pytest.approx(0.75) and m["new_task"] == "strings" and m["new_task_loss"] == 2.0
    assert not any(k.startswith(("acc_sd/", "loss_sd/")) for k in m)  # noise scales stay in memory
    assert "retention arith 0.75" in line and s.last_eval["all"]["acc/arith"] == 0.6


@pytest.mark.parametrize("secure", [True, False])
def test_eval_sends_the_reference_model_and_the_anchor_only_where_a_party_uses_them(make_ctx, secure):
    """Under secure aggregation a party computes only per-example scores of the global weights: the eval instruction
    carries no reference model (a second copy of the weights) and no anchor; in plaintext both, for the routing
    figures (``party.work.run_eval``)."""
    ctx = make_ctx("stats:arith, sft:strings, eval", rnd=3, **{"privacy.mode": "secagg" if secure else "plaintext"})
    assert ctx.cfg.privacy.secure is secure
    stats, first = PHASES["stats"], ctx.cfg.schedule.phases[0]  # an anchor, as a released stats sum makes it
    total = np.ones((ctx.mspec.num_moe_layers, ctx.mspec.num_experts))  # [L, E]
    ctx.s, _ = stats.aggregate(ctx, 1, first, stats.configure(ctx, first), StatsSum(total, 3, 3, ""))
    ref = {k: v.clone() + 1 for k, v in ctx.s.weights.items()}
    ctx.s = replace(ctx.s, trained_tasks=["arith", "strings"], current_task="strings", ref_weights=ref)
    instr = PHASES["eval"].configure(ctx, ctx.cfg.schedule.phases[2])
    assert set(instr.weights) == set(ctx.s.weights) and instr.anchor_version == 1
    if secure:
        assert instr.ref_weights is None and instr.anchor is None
    else:
        assert set(instr.ref_weights) == set(ref) and instr.anchor is not None
        k = next(iter(ref))
        np.testing.assert_array_equal(instr.ref_weights[k], ref[k].numpy())


def test_eval_says_retention_is_undefined_against_a_noise_baseline_and_near_zero_against_a_noise_accuracy(
        make_ctx, read_metrics):
    """An earlier accuracy within its noise of 0: retention is undefined, ``null`` in metrics.jsonl and
    ``n/a (earlier accuracy within noise)`` on the round line (never a ratio to noise such as ``0.00``); an accuracy
    now within its noise of 0 against a real earlier one: its retention reads ``≈ 0 (within noise)``."""
    ctx = make_ctx("sft:arith, sft:strings, sft:lookup, eval", rnd=4)
    ctx.s = replace(ctx.s, trained_tasks=["arith", "strings", "lookup"], current_task="lookup",
                    baseline={"all": {"acc/arith": 0.004, "acc_sd/arith": 0.03, "acc/strings": 0.5,
                                      "acc_sd/strings": 0.03}})
    step, phase = PHASES["eval"], ctx.cfg.schedule.phases[3]
    instr = step.configure(ctx, phase)
    agg = {"acc/arith": 0.3, "acc_sd/arith": 0.03, "acc/strings": 0.01, "acc_sd/strings": 0.03, "acc/lookup": 0.5,
           "acc_sd/lookup": 0.03, **{f"n/{t}": 9.0 for t in ("arith", "strings", "lookup")}}
    _, line = step.aggregate(ctx, 3, phase, instr, EvalSum({"all": dict(agg)}, 3, 3))
    [m] = read_metrics(ctx, "eval")
    assert "retention/arith" in m and m["retention/arith"] is None
    assert m["retention/strings"] == pytest.approx(0.02)
    flat = " ".join(line.split())  # the round line may wrap
    assert "retention arith n/a (earlier accuracy within noise)" in flat
    assert "retention strings ≈ 0 (within noise)" in flat and "0.00" not in flat and "0.02" not in flat


def test_retention_is_undefined_when_the_baseline_is_noise():
    assert retention(0.8, 0.01, 0.6) == pytest.approx(0.75)
    assert retention(0.02, 0.05, 0.6) is None  # the earlier accuracy is within its noise scale of 0
    assert retention(math.nan, 0.0, 0.6) is None and retention(0.0, 0.0, 0.5) is None
