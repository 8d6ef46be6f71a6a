"""The two exchanges of public inputs after a round, on hand-made replies: the bias settle
(``phases/settle.py``: the median of the usable replies, each within the schedule's bound ``U``) and the routing
probe (``phases/probe.py``: the median, a disagreeing party named once). No coordinator, no transport: the loop
sends ``instruction`` and hands the replies to ``apply``."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from distmoe.config import parse_run_config
from distmoe.coordinator.phases import probe, settle
from distmoe.model.adapters import server_model
from distmoe.wire.schema import ProbeReply, SettleReply

K, U = 20, 0.02
SETTLE = {"routing.balance": "aux+bias", "routing.balance-count": "first", "routing.balance-source": "public",
          "routing.balance-settle-steps": K, "routing.balance-settle-rate": U,
          "routing.balance-settle-schedule": "constant", "routing.probe-prompts": 4}


@pytest.fixture(scope="module")
def bias_model(tiny):
    return server_model(parse_run_config({**tiny, **SETTLE}).model)


def _bias(ctx) -> np.ndarray:
    return np.stack([ctx.s.weights[k].double().numpy() for k in settle.bias_keys(ctx.s.weights)])  # [L, E]


def test_no_settle_is_asked_unless_configured(make_ctx):
    assert settle.instruction(make_ctx()) is None


def test_lying_parties_are_outvoted_below_the_bound_and_refused_beyond_it(make_ctx, bias_model, read_metrics):
    """Round 1: party-1 reports a bias off by half the bound (outvoted by the median, named). Round 2: party-1 and
    party-2, a majority, report the bias pushed 5 beyond the bound: both refused, the honest party's value holds,
    so even a dishonest majority moves the bias by at most ``K * u_s``."""
    ctx = make_ctx("sft:arith*2", model=bias_model, **SETTLE)
    names = {100: "party-0", 101: "party-1", 102: "party-2"}
    ctx.peer = names.__getitem__
    instr = settle.instruction(ctx)
    assert instr.round == 1 and set(instr.weights) == set(ctx.s.weights)
    before = _bias(ctx)
    honest = (before + 0.3 * K * U).astype(np.float32)
    ctx.s, _ = settle.apply(ctx, {100: SettleReply("party-0", honest),
                                  101: SettleReply("party-1", honest + 0.5 * K * U),
                                  102: SettleReply("party-2", honest)}, {})
    assert np.allclose(_bias(ctx), honest, atol=1e-6)  # the median: the honest value
    ctx.s, before = replace(ctx.s, round=2), _bias(ctx)
    honest2 = (before - 0.2 * K * U).astype(np.float32)
    ctx.s, _ = settle.apply(ctx, {100: SettleReply("party-0", honest2), 101: SettleReply("party-1", honest2 + 5.0),
                                  102: SettleReply("party-2", honest2 + 5.0)}, {})
    assert np.allclose(_bias(ctx), honest2, atol=1e-6) and np.abs(_bias(ctx) - before).max() <= K * U + 1e-5
    rows = {r["round"]: r for r in read_metrics(ctx, "settle")}
    assert (rows[1]["parties"], rows[1]["disagreeing"]) == (3, 1)
    assert (rows[2]["parties"], rows[2]["disagreeing"]) == (1, 2)
    warns = [w["detail"] for w in read_metrics(ctx, "routing_warning") if w["kind"] == "settle"]
    assert len(warns) == 2  # once per party
    assert "party party-1's settled routing bias" in warns[0] and "party party-2's" in warns[1]


def test_without_a_usable_reply_the_bias_stays_as_aggregated(make_ctx, bias_model, read_metrics):
    ctx = make_ctx("sft:arith", model=bias_model, **SETTLE)
    before = _bias(ctx)
    ctx.s, _ = settle.apply(ctx, {100: SettleReply("p", (before + 1.0).astype(np.float32))}, {101: "timeout"})
    assert np.array_equal(_bias(ctx), before) and not read_metrics(ctx, "settle")
    assert "no usable reply" in read_metrics(ctx, "routing_warning")[0]["detail"]


def test_the_probe_takes_the_median_and_names_a_disagreeing_party_once(make_ctx, read_metrics):
    ctx = make_ctx("sft:arith*2", rnd=2, **{"routing.probe-every": 2, "routing.probe-prompts": 4})
    ctx.probe_prompts = ("a b", "c d", "e f", "g h")
    assert probe.instruction(ctx).prompts == ctx.probe_prompts
    ctx.s = replace(ctx.s, round=3)
    assert probe.instruction(ctx) is None  # every second round only
    ctx.s = replace(ctx.s, round=2)
    L, E = ctx.mspec.num_moe_layers, ctx.mspec.num_experts
    routing = np.full((L, E), 1.0 / E)
    routing[:, 0] += 0.1
    top1 = np.zeros((L, 6), np.int64)
    liar = ProbeReply("party-1", np.roll(routing, 1, axis=1), (top1 + 1) % E)
    ctx.peer = {100: "party-0", 101: "party-1", 102: "party-2"}.__getitem__
    replies = {100: ProbeReply("party-0", routing, top1), 101: liar, 102: ProbeReply("party-2", routing, top1)}
    same, text = probe.apply(ctx, replies, {})
    assert same is ctx.s  # the probe only measures
    [row] = read_metrics(ctx, "probe")
    assert (row["parties"], row["disagreeing"]) == (3, 1) and text.startswith(" | probe: load CV")
    assert row["expert_counts"] == [[6, 0, 0, 0]] * L  # the honest parties' top-1: all on expert 0
    ctx.s = replace(ctx.s, round=4)
    probe.apply(ctx, replies, {})
    warns = [w["detail"] for w in read_metrics(ctx, "routing_warning") if w["kind"] == "probe"]
    assert len(warns) == 1 and "party party-1's routing probe disagrees" in warns[0]


def test_a_high_load_cv_warns_once_in_the_record_and_the_report(make_ctx, read_metrics):
    from distmoe.report.report import render_markdown

    ctx = make_ctx("sft:arith*2", rnd=1, **{"routing.probe-every": 1, "routing.probe-prompts": 4,
                                            "routing.load-cv-warn": 0.01})
    ctx.probe_prompts = ("a b", "c d", "e f", "g h")
    ctx.peer = {100: "party-0", 101: "party-1", 102: "party-2"}.__getitem__
    L, E = ctx.mspec.num_moe_layers, ctx.mspec.num_experts
    routing = np.full((L, E), 1.0 / E)
    top1 = np.zeros((L, 6), np.int64)  # every token on expert 0: load CV far above 0.01
    replies = {n: ProbeReply(f"party-{n - 100}", routing, top1) for n in (100, 101, 102)}
    for rnd in (1, 2):  # it stays high: warned once
        ctx.s = replace(ctx.s, round=rnd)
        ctx.s, _ = probe.apply(ctx, replies, {})
    warns = [w for w in read_metrics(ctx, "routing_warning") if w["kind"] == "load_cv"]
    assert [w["round"] for w in warns] == [1]
    rec = json.loads((ctx.run_dir / "run.json").read_text())
    assert any("routing.load-cv-warn = 0.01" in w for w in rec["warnings"])
    md = render_markdown(ctx.run_dir)
    assert "routing.load-cv-warn = 0.01" in md
    assert "### Expert selection on the probe set" in md and "Per-round routing on the public probe set" in md


def test_a_probe_not_sent_again_shows_only_the_kl_to_an_anchor_built_since(make_ctx, read_metrics):
    """``repeat`` (the model did not change since the last probe): its row is written again for the round, and its
    progress text is the KL to an anchor built since that probe only, from the recorded figure (never the load CV or
    a top-1 consistency of 1 with itself); nothing when no new anchor was built."""
    import re

    from distmoe.routing.anchor import Anchor, AnchorVersion

    ctx = make_ctx("sft:arith, stats:arith, eval", rnd=1, **{"routing.probe-every": 1, "routing.probe-prompts": 4})
    ctx.probe_prompts = ("a b", "c d", "e f", "g h")
    L, E = ctx.mspec.num_moe_layers, ctx.mspec.num_experts
    routing = np.full((L, E), 1.0 / E)
    routing[:, 0] += 0.1
    reply = ProbeReply("party-0", routing, np.zeros((L, 6), np.int64))
    ctx.peer = {100: "party-0"}.__getitem__
    _, text = probe.apply(ctx, {100: reply}, {})
    assert "load CV" in text and "KL" not in text  # no anchor yet
    ctx.s = replace(ctx.s, round=2)  # a stats round: the same weights, a new anchor
    ctx.s = replace(ctx.s, anchor=Anchor(np.full((L, E), 1.0 / E), AnchorVersion(1, 2, "x", {}, 1.0, "arith")))
    again = probe.repeat(ctx)
    rows = read_metrics(ctx, "probe")
    assert [r["round"] for r in rows] == [1, 2] and rows[1]["routing_kl"] > 0
    assert re.fullmatch(r" \| probe: KL \d+\.\d{3}", again) and again == f" | probe: KL {rows[1]['routing_kl']:.3f}"
    ctx.s = replace(ctx.s, round=3)  # an eval round: no new anchor since
    assert probe.repeat(ctx) == "" and [r["round"] for r in read_metrics(ctx, "probe")] == [1, 2, 3]
