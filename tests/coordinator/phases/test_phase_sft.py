"""The ``sft`` step (``distmoe.coordinator.phases.sft``) on hand-made sums: what it sends, what a released update
does to the global model and the log, and the expert expansion at a new task. No coordinator, no transport."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import torch

from distmoe.coordinator.aggregator import UpdateSum
from distmoe.coordinator.phases import PHASES
from distmoe.model.adapters import server_model
from distmoe.model.expand import per_expert
from distmoe.routing.anchor import Anchor, AnchorVersion

STEP = PHASES["sft"]


def _delta(weights: dict, value: float) -> dict[str, np.ndarray]:
    return {k: np.full(tuple(v.shape), value, np.float32) for k, v in weights.items()}


def test_configure_begins_the_task_and_sends_the_global_weights(make_ctx, configure):
    ctx = make_ctx("sft:arith, sft:strings", rnd=1)
    s0 = ctx.s
    instr = configure(STEP, ctx, ctx.cfg.schedule.phases[0])
    assert s0.current_task is None and s0.ref_weights is None  # begin returned a new state, the old one is as it was
    assert ctx.s.current_task == "arith" and ctx.s.trained_tasks == ["arith"] and ctx.s.ref_weights is not None
    assert (instr.round, instr.task, instr.anchor, instr.anchor_version) == (1, "arith", None, 0)
    assert instr.seed == ctx.cfg.run.seed * 100_003 + 1 and instr.base_hash == ctx.tspec.base_hash
    assert set(instr.weights) == set(ctx.s.weights)
    for k, v in ctx.s.weights.items():
        np.testing.assert_array_equal(instr.weights[k], v.numpy())
    req = STEP.request(ctx, 0, ctx.cfg.schedule.phases[0], instr)
    assert (req.sum, req.kind, req.release, req.event["event"]) == ("update", "sft", "model-update", "train")


def test_configure_sends_the_latest_anchor_when_the_kl_is_on(make_ctx):
    ctx = make_ctx()
    L, E = ctx.mspec.num_moe_layers, ctx.mspec.num_experts
    probs = np.full((L, E), 1.0 / E, np.float32)
    ctx.s = replace(ctx.s, anchor=Anchor(probs, AnchorVersion(version=3, round=0, source_checkpoint="x",
                                                              router_spec={}, num_sequences=1.0, task="arith")))
    instr = STEP.configure(ctx, ctx.cfg.schedule.phases[0])
    assert instr.anchor_version == 3 and np.array_equal(instr.anchor, probs)
    off = make_ctx(**{"routing.anchor-kl-coef": 0.0})
    off.s = replace(off.s, anchor=ctx.s.anchor)
    assert STEP.configure(off, off.cfg.schedule.phases[0]).anchor is None


def test_aggregate_adds_exactly_the_released_update(make_ctx, read_metrics, configure):
    ctx = make_ctx(**{"privacy.mode": "plaintext"})
    phase = ctx.cfg.schedule.phases[0]
    instr = configure(STEP, ctx, phase)
    before = {k: v.clone() for k, v in ctx.s.weights.items()}
    out = UpdateSum(_delta(ctx.s.weights, 0.25), {"loss_first": 2.0, "loss_last": 1.5, "skipped_steps": 0.0}, 30, 3, 3)
    new, line = STEP.aggregate(ctx, 0, phase, instr, out)
    for k, v in new.weights.items():
        torch.testing.assert_close(v, before[k] + 0.25)
    for k, v in ctx.s.weights.items():  # the state handed in is left as it was
        torch.testing.assert_close(v, before[k])
    assert line == "3/3 parties | task loss 2.000 -> 1.500 | skipped steps 0"
    [m] = read_metrics(ctx, "train")
    assert (m["party"], m["num_examples"], m["parties"], m["round"], m["task"]) == ("all", 30, 3, 1, "arith")


def test_secure_line_shows_the_released_means_and_their_noise(make_ctx, read_metrics):
    ctx = make_ctx()
    phase = ctx.cfg.schedule.phases[0]
    instr = STEP.configure(ctx, phase)
    out = UpdateSum(_delta(ctx.s.weights, 0.0), {"task_loss": 1.25, "skipped_steps": 2.0}, 2, 3, 3,
                    noise={"task_loss": 0.1}, uniform=True)
    _, line = STEP.aggregate(ctx, 0, phase, instr, out)
    assert line == "3/3 parties, 2 with data | task loss 1.250 ± 0.100 | skipped NaN/Inf steps 2"
    [m] = read_metrics(ctx, "train")
    assert m["contributors"] == 2 and "num_examples" not in m  # uniform weights: contributors, not examples


def test_a_new_task_grows_the_model_and_the_old_experts_stay_exact(tiny, make_ctx, read_metrics, configure):
    from distmoe.config import parse_run_config

    fresh = server_model(parse_run_config(dict(tiny)).model)  # the surgery changes the module: not the shared one
    ctx = make_ctx("sft:arith, sft:strings", rnd=2, model=fresh, **{"retention.expand-experts": 1,
                                                                     "privacy.mode": "plaintext"})
    E = ctx.mspec.num_experts
    ctx.s = replace(ctx.s, trained_tasks=["arith"], current_task="arith")
    phase = ctx.cfg.schedule.phases[1]
    instr = configure(STEP, ctx, phase)
    assert ctx.mspec.num_experts == E + 1 and len(ctx.s.expansions) == 1
    assert {k: tuple(v.shape) for k, v in instr.weights.items()} == dict(ctx.tspec.shapes)
    assert read_metrics(ctx, "expand")[0]["to"] == E + 1
    before = {k: v.clone() for k, v in ctx.s.weights.items()}
    ctx.s, _ = STEP.aggregate(ctx, 1, phase, instr, UpdateSum(_delta(ctx.s.weights, 1.0),
                                                              {"loss_first": 1.0, "loss_last": 1.0,
                                                               "skipped_steps": 0.0}, 3, 3, 3))
    grown = [k for k in before if per_expert(k) and before[k].shape[0] == E + 1]
    assert grown
    for k in grown:  # experts 0..E-1 frozen: only the new expert moved
        torch.testing.assert_close(ctx.s.weights[k][:E], before[k][:E])
        torch.testing.assert_close(ctx.s.weights[k][E:], before[k][E:] + 1.0)


def _round(ctx, loss: float, last: float = 1.8):
    """One ``sft`` round of ``ctx``'s first phase with a zero update and the aggregate ``loss`` (``loss_last``)."""
    phase = ctx.cfg.schedule.phases[0]
    instr = STEP.configure(ctx, phase)
    out = UpdateSum(_delta(ctx.s.weights, 0.0), {"loss": loss, "loss_first": loss, "loss_last": last,
                                                 "skipped_steps": 0.0}, 3, 3, 3)
    ctx.s, _ = STEP.aggregate(ctx, 0, phase, instr, out)
    ctx.s = replace(ctx.s, round=ctx.s.round + 1)


def test_a_loss_spike_beyond_the_rolling_z_score_is_flagged_in_the_record_and_the_state(make_ctx, read_metrics):
    """Plaintext baseline (under secure aggregation no training loss reaches the server, so nothing is judged)."""
    secure = make_ctx(**{"federation.anomaly-z": 4.0})  # the secure slots' means are not judged
    _round(secure, math.nan, math.nan)
    assert not read_metrics(secure, "anomaly") and secure.s.anomaly_history == {}
    ctx = make_ctx(**{"federation.anomaly-z": 4.0, "privacy.mode": "plaintext"})  # (the same run directory)
    for v in (2.0, 1.9, 1.95, 1.85, 1.9):
        _round(ctx, v)
    assert not read_metrics(ctx, "anomaly") and ctx.s.anomaly_history["train/loss"] == [2.0, 1.9, 1.95, 1.85, 1.9]
    _round(ctx, 6.0)
    [a] = read_metrics(ctx, "anomaly")
    assert "rolling standard deviations" in a["detail"] and "loss 6" in a["detail"] and a["round"] == 6
    assert json.loads((ctx.run_dir / "run.json").read_text())["anomalies"][0]["detail"] == a["detail"]


def test_a_non_finite_aggregate_loss_is_flagged_in_the_record_and_the_report(make_ctx, read_metrics):
    from distmoe.report.report import render_markdown

    ctx = make_ctx(**{"privacy.mode": "plaintext"})
    _round(ctx, math.nan)
    [a] = read_metrics(ctx, "anomaly")
    assert "non-finite" in a["detail"] and "loss" in a["detail"]
    assert any("non-finite" in x["detail"] for x in json.loads((ctx.run_dir / "run.json").read_text())["anomalies"])
    md = render_markdown(ctx.run_dir)
    assert "## Anomalies" in md and "non-finite" in md
