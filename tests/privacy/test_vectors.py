"""The secure-sum layouts (``distmoe.privacy.vectors``): what a party's input vector holds, and what the sum
decodes to. Sums are taken in Z_2^64 exactly as the secure aggregation does (uint64 wrap-around)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from distmoe.privacy.vectors import EvalLayout, LayoutError, UpdateLayout, from_ring64, to_ring64

SHAPES = {"b": (2,), "a": (2, 3)}
KEYS = ("loss_first", "loss_last", "steps", "skipped_steps")


def _ring_sum(vectors):
    total = np.zeros_like(vectors[0])
    for v in vectors:
        total = total + v  # uint64 arithmetic wraps mod 2^64, as in SecAgg
    return total


def _delta(rng, scale=0.1):
    return {k: rng.normal(0, scale, s) for k, s in SHAPES.items()}


def test_update_sum_decodes_to_the_weighted_average_and_metric_means():
    rng = np.random.default_rng(0)
    lay = UpdateLayout.build(SHAPES, KEYS, 3, clip=10.0, max_weight=100)
    deltas = [_delta(rng) for _ in range(3)]
    examples = [10, 30, 500]  # the last is capped at max_weight
    metrics = [{"loss_first": 2.0, "loss_last": 1.0, "steps": 4, "skipped_steps": 0},
               {"loss_first": 4.0, "loss_last": math.nan, "steps": 4, "skipped_steps": 1},
               {"loss_first": 1.0, "loss_last": 0.5, "steps": 3, "skipped_steps": 0}]
    vecs = [lay.encode(d, n, m)[0] for d, n, m in zip(deltas, examples, metrics, strict=True)]
    avg, weight, m = lay.decode(_ring_sum(vecs))
    w = np.array([10, 30, 100], float)
    assert weight == pytest.approx(140.0)
    for k in SHAPES:
        want = sum(wi * d[k] for wi, d in zip(w, deltas, strict=True)) / w.sum()
        np.testing.assert_allclose(avg[k], want, rtol=0, atol=1e-6)
    assert m["loss_first"] == pytest.approx((10 * 2 + 30 * 4 + 100 * 1) / 140)
    assert m["loss_last"] == pytest.approx((10 * 1 + 100 * 0.5) / 110)  # the NaN is left out, not averaged
    assert m["steps"] == 11 and m["skipped_steps"] == 1  # sums, not means


def test_update_is_clipped_to_the_declared_norm_and_refuses_bad_tensors():
    lay = UpdateLayout.build({"w": (2,)}, (), 2, clip=1.0, max_weight=4)
    vec, facts = lay.encode({"w": np.array([3.0, 4.0])}, 1, {})
    avg, _, _ = lay.decode(vec)
    np.testing.assert_allclose(avg["w"], [0.6, 0.8], atol=1e-9)
    assert facts["norm"] == pytest.approx(5.0) and facts["clipped"] == 1.0
    with pytest.raises(LayoutError, match="NaN"):
        lay.encode({"w": np.array([np.nan, 0.0])}, 1, {})
    with pytest.raises(LayoutError, match="shape"):
        lay.encode({"w": np.zeros(3)}, 1, {})
    with pytest.raises(LayoutError, match="keys"):
        lay.encode({"v": np.zeros(2)}, 1, {})


def test_private_update_layout_carries_nothing_data_dependent_beside_the_delta():
    """With client-level DP the noise covers the delta block only, so the weight and metric slots must not
    depend on the party's data: uniform weights, metrics withheld."""
    lay = UpdateLayout.build({"w": (3,)}, KEYS, 3, clip=1.0, max_weight=1024, private=True)
    d = {"w": np.array([3.0, 0.0, 4.0])}
    a, _ = lay.encode(d, 500, {"loss_first": 2.5, "loss_last": 1.0, "steps": 4, "skipped_steps": 0})
    b, _ = lay.encode(d, 7, {"loss_first": 9.0, "loss_last": 3.0, "steps": 2, "skipped_steps": 2})
    assert np.array_equal(a, b)  # dataset size and metrics do not change what leaves
    avg, weight, m = lay.decode(_ring_sum([a, b]))
    assert weight == 2.0 and all(math.isnan(v) for v in m.values())
    np.testing.assert_allclose(avg["w"], [0.6, 0.0, 0.8], atol=1e-9)
    assert lay.sensitivity == 1.0 and lay.length == 3 + 1 + 2 * len(KEYS)
    plain = UpdateLayout.build({"w": (3,)}, KEYS, 3, clip=1.0, max_weight=1024)
    assert plain.sensitivity == 1024.0
    pa, _ = plain.encode(d, 500, {"loss_first": 2.5, "loss_last": 1.0, "steps": 4, "skipped_steps": 0})
    pb, _ = plain.encode(d, 7, {"loss_first": 9.0, "loss_last": 3.0, "steps": 2, "skipped_steps": 2})
    assert not np.array_equal(pa, pb)


def test_ring64_round_trip_and_the_sum_of_negative_values():
    x = np.array([-5, 0, 7, -(2**62)], np.int64)
    assert np.array_equal(from_ring64(to_ring64(x)), x)
    lay = UpdateLayout.build({"w": (1,)}, (), 3, clip=1.0, max_weight=1)
    vecs = [lay.encode({"w": np.array([v])}, 1, {})[0] for v in (-0.5, -0.25, 0.1)]
    avg, weight, _ = lay.decode(_ring_sum(vecs))
    assert weight == 3.0 and avg["w"][0] == pytest.approx(-0.65 / 3, abs=1e-6)


def test_eval_sum_weights_each_task_by_its_examples():
    keys = ("acc/a", "loss/a", "n/a", "acc/b", "loss/b", "n/b", "routing_kl")
    lay = EvalLayout(keys, 2, 10_000)
    p0 = {"acc/a": 1.0, "loss/a": 0.5, "n/a": 10, "acc/b": math.nan, "loss/b": math.nan, "n/b": 0, "routing_kl": 0.2}
    p1 = {"acc/a": 0.0, "loss/a": 1.5, "n/a": 30, "acc/b": 0.5, "loss/b": 2.0, "n/b": 4, "routing_kl": 0.4}
    out = lay.decode(_ring_sum([lay.encode(p0), lay.encode(p1)]))
    assert out["acc/a"] == pytest.approx(10 / 40) and out["loss/a"] == pytest.approx((5 + 45) / 40)
    assert out["n/a"] == 40 and out["n/b"] == 4 and out["acc/b"] == pytest.approx(0.5)
    assert out["routing_kl"] == pytest.approx((10 * 0.2 + 34 * 0.4) / 44)
