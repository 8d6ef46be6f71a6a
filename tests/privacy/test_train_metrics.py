"""The training-metric slots of the update layout: slot counts, clipping at the public bound, the encode/decode round
trip of a secure sum, the bound check, and the L2 budget they share with the delta under update noise."""

from __future__ import annotations

import math

import numpy as np
import pytest

from distmoe.privacy import ring
from distmoe.privacy import train_metrics as TM
from distmoe.privacy.update_noise import add_update_noise
from distmoe.privacy.vectors import LayoutError, UpdateLayout

SHAPES = {"a": (3, 4), "b": (5,)}


def _layout(objective: str, *, private=False, z=0.0, ring_bits="auto", share=0.25, n=3, clip=10.0):
    base = UpdateLayout.build(SHAPES, n, clip, private, noise_multiplier=z, threshold=2 if private else 0,
                              ring=ring_bits)
    return TM.release_layout(base, objective, 16.0, share)


def _party(layout, slots, values, contributed=True, seed=0):
    rng = np.random.default_rng(seed)
    delta = {k: rng.normal(0, 1, s).astype(np.float32) for k, s in SHAPES.items()}
    vec, _ = layout.encode(delta, 5 if contributed else 0)
    TM.encode_into(vec, layout, slots, values, contributed)
    return vec


def _sum(vecs):
    """The sum mod 2^bits of the parties' words (unsigned numpy arithmetic wraps)."""
    out = np.zeros_like(vecs[0])
    for v in vecs:
        out += v
    return out


@pytest.mark.parametrize("objective,keys", [("sft", ["task_loss"]), ("dpo", ["task_loss", "dpo_margin", "dpo_acc"]),
                                            ("rl", ["reward", "masked_frac_low", "masked_frac_high", "k3",
                                                    "logp_diff_mean"])])
def test_slot_count_and_length_per_objective(objective, keys):
    base = UpdateLayout.build(SHAPES, 3, 10.0)
    layout, slots = _layout(objective)
    assert [s.key for s in slots] == keys
    assert layout.length == base.length + len(keys) and layout.metric_start == base.length
    priv, pslots = _layout(objective, private=True, z=1.0)
    assert len(pslots) == len(keys) and priv.delta_clip == pytest.approx(10.0 * math.sqrt(1 - 0.25**2))
    none, nslots = _layout(objective, private=True, z=1.0, share=0.0)  # share 0: no metric under update noise
    assert nslots == () and none.length == UpdateLayout.build(SHAPES, 3, 10.0, True, noise_multiplier=1.0,
                                                              threshold=2).length
    with pytest.raises(LayoutError, match="objective"):
        TM.slots_for("ppo", 16.0)


@pytest.mark.parametrize("value,expected", [(1e30, 16.0), (math.inf, 16.0), (-math.inf, 0.0), (math.nan, 16.0),
                                            (-3.0, 0.0), (4.25, 4.25)])
def test_a_loss_is_clipped_to_its_bound(value, expected):
    (slot,) = TM.slots_for("sft", 16.0)
    assert TM.clip_value(slot, value) == expected
    layout, slots = _layout("sft")
    vec = _party(layout, slots, {"task_loss": value})
    means, _, problem = TM.decode(vec, layout, slots, 1, 1)
    assert problem is None and means["task_loss"] == pytest.approx(expected, abs=1e-6)


def test_nan_counts_as_each_slots_worst_end():
    worst = {s.key: TM.clip_value(s, math.nan) for s in TM.slots_for("rl", 16.0) + TM.slots_for("dpo", 16.0)}
    assert worst == {"reward": 0.0, "masked_frac_low": 1.0, "masked_frac_high": 1.0, "k3": 1.0,
                     "logp_diff_mean": 1.0, "task_loss": 16.0, "dpo_margin": -16.0, "dpo_acc": 0.0}


@pytest.mark.parametrize("ring_bits", ["auto", "64"])
@pytest.mark.parametrize("private", [False, True])
def test_round_trip_of_a_secure_sum_is_the_contributors_mean(ring_bits, private):
    layout, slots = _layout("rl", private=private, z=1.0 if private else 0.0, ring_bits=ring_bits)
    figures = [{"reward": 0.25, "masked_frac_low": 0.01, "masked_frac_high": 0.002, "k3": 3e-4, "logp_diff_mean": 0.02},
               {"reward": 0.75, "masked_frac_low": 0.03, "masked_frac_high": 0.0, "k3": 1e-4, "logp_diff_mean": 0.04},
               {"reward": 9.0}]  # the third has no data for the task: not a contributor, its figures never count
    vecs = [_party(layout, slots, f, contributed=i < 2, seed=i) for i, f in enumerate(figures)]
    total = _sum(vecs)
    means, stds, problem = TM.decode(total, layout, slots, contributors=2, n_included=3)
    assert problem is None and stds == {}
    unit = 2.0**layout.frac_bits * TM.slot_scales(layout, slots)  # one rounding unit per party, in metric units
    for s, u in zip(slots, unit, strict=True):
        want = (figures[0][s.key] + figures[1][s.key]) / 2
        assert abs(means[s.key] - want) <= 1.0 / u, (s.key, means[s.key], want)
    assert layout.bits == (32 if ring_bits == "auto" else 64)


def test_under_update_noise_the_whole_rounded_vector_keeps_the_calibrated_sensitivity():
    """Delta at its (reduced) clip and every metric at its bound: the party's rounded vector still has L2 norm
    <= D2 = int_sensitivity(), the sensitivity the update noise and the accounting use."""
    layout, slots = _layout("rl", private=True, z=1.0)
    big = {k: np.full(s, 1e3, np.float32) for k, s in SHAPES.items()}  # clipped to delta_clip
    vec, facts = layout.encode(big, 5)
    TM.encode_into(vec, layout, slots, {s.key: s.hi for s in slots}, True)
    ints = ring.from_ring(vec).astype(np.float64)
    ints[layout.numel] = 0.0  # the weight slot: 1 for every included party (public), not data
    assert facts["clipped"] == 1.0
    assert np.linalg.norm(ints) <= layout.int_sensitivity()
    metric_norm = np.linalg.norm(ints[layout.metric_start:]) / 2.0**layout.frac_bits
    assert metric_norm > 0.2 * layout.clip  # the metrics get about rho = 0.25 of the clip's norm


def test_update_noise_reaches_the_metric_words_with_the_update_variance():
    layout, slots = _layout("sft", private=True, z=2.0)
    vec = _party(layout, slots, {"task_loss": 3.0})
    draws = np.array([ring.from_ring(add_update_noise(vec, layout, 2.0, 2))[layout.metric_start] for _ in range(400)],
                     np.float64) - float(ring.from_ring(vec)[layout.metric_start])
    sd = 2.0 * layout.int_sensitivity() / math.sqrt(2)  # each share's variance is (z D2)^2 / t
    assert abs(draws.std() / sd - 1.0) < 0.15 and abs(draws.mean()) < 4 * sd / math.sqrt(400)
    sigma = TM.noise_std(layout, 2.0, 3, 2)
    means, stds, problem = TM.decode(vec, layout, slots, 1, 1, sigma)
    assert problem is None and stds["task_loss"] > 0


def test_a_slot_beyond_what_honest_contributors_can_sum_is_refused():
    layout, slots = _layout("sft")
    vec = _party(layout, slots, {"task_loss": 4.0})
    raw = ring.from_ring(vec).astype(np.int64)
    raw[layout.metric_start] = int(40.0 * 2.0**layout.frac_bits * TM.slot_scales(layout, slots)[0])  # 40 > 16
    forged = ring.to_ring(raw, layout.bits)
    means, _, problem = TM.decode(forged, layout, slots, 1, 1)
    assert means == {} and "task_loss" in problem
    means, _, problem = TM.decode(vec, layout, slots, 0, 1)  # a non-zero slot with no contributor
    assert means == {} and "task_loss" in problem
    zero = _party(layout, slots, {"task_loss": 4.0}, contributed=False)
    assert TM.decode(zero, layout, slots, 0, 1) == ({}, {}, None)  # no contributor: no mean, nothing wrong


def test_plaintext_figures_are_the_same_clipped_uniform_mean():
    slots = TM.slots_for("dpo", 16.0)
    got = TM.plain_means([{"task_loss": 0.6, "dpo_margin": 40.0, "dpo_acc": 1.0},
                          {"task_loss": math.nan, "dpo_margin": -1.0, "dpo_acc": 0.5}], slots)
    assert got == pytest.approx({"task_loss": 8.3, "dpo_margin": 7.5, "dpo_acc": 0.75})
