"""The secure-sum layouts (``distmoe.privacy.vectors``): what a party's input vector holds, and what the sum
decodes to. Sums are taken in Z_2^64 exactly as the secure aggregation does (uint64 wrap-around)."""

from __future__ import annotations

import numpy as np
import pytest

from distmoe.privacy.ring import WrapError
from distmoe.privacy.vectors import LayoutError, UpdateLayout, from_ring64, to_ring64

SHAPES = {"b": (2,), "a": (2, 3)}


def _ring_sum(vectors):
    total = np.zeros_like(vectors[0])
    for v in vectors:
        total = total + v  # uint64 arithmetic wraps mod 2^64, as in SecAgg
    return total


def _delta(rng, scale=0.1):
    return {k: rng.normal(0, scale, s) for k, s in SHAPES.items()}


def test_update_sum_is_the_mean_of_the_contributors_with_uniform_weights():
    """Weights are 1 per contributing party (0 without data), never the example count: the released weight
    sum is the contributor count (against straggle differencing)."""
    rng = np.random.default_rng(0)
    lay = UpdateLayout.build(SHAPES, 3, clip=10.0)
    deltas = [_delta(rng) for _ in range(3)]
    examples = [10, 30, 500]
    vecs = [lay.encode(d, n)[0] for d, n in zip(deltas, examples, strict=True)]
    avg, weight = lay.decode(_ring_sum(vecs))
    assert weight == pytest.approx(3.0)
    for k in SHAPES:
        np.testing.assert_allclose(avg[k], sum(d[k] for d in deltas) / 3, rtol=0, atol=1e-6)
    a, _ = lay.encode(deltas[0], 10)
    b, _ = lay.encode(deltas[0], 10_000)
    assert np.array_equal(a, b)  # the dataset size does not change what leaves
    none, facts = lay.encode({k: np.zeros(s) for k, s in SHAPES.items()}, 0)
    assert facts["weight"] == 0.0 and not from_ring64(none).any()  # no data: weight 0, nothing added
    assert lay.length == 2 + 6 + 1 and lay.weight_bound == 1  # the deltas and the weight: no skipped-step count


def test_update_is_clipped_to_the_declared_norm_and_refuses_bad_tensors():
    lay = UpdateLayout.build({"w": (2,)}, 2, clip=1.0)
    vec, facts = lay.encode({"w": np.array([3.0, 4.0])}, 1)
    avg, _ = lay.decode(vec)
    np.testing.assert_allclose(avg["w"], [0.6, 0.8], atol=1e-9)
    assert facts["norm"] == pytest.approx(5.0) and facts["clipped"] == 1.0
    with pytest.raises(LayoutError, match="NaN"):
        lay.encode({"w": np.array([np.nan, 0.0])}, 1)
    with pytest.raises(LayoutError, match="shape"):
        lay.encode({"w": np.zeros(3)}, 1)
    with pytest.raises(LayoutError, match="keys"):
        lay.encode({"v": np.zeros(2)}, 1)


def test_private_update_layout_gives_every_included_party_weight_one():
    """With client-level DP the noise covers the delta block only, so the weight slot must not depend on the
    party's data: weight 1 even without data (a zero delta plus its noise share)."""
    lay = UpdateLayout.build({"w": (3,)}, 3, clip=1.0, private=True)
    d = {"w": np.array([3.0, 0.0, 4.0])}
    a, _ = lay.encode(d, 500)
    b, _ = lay.encode({"w": np.zeros(3)}, 0)
    avg, weight = lay.decode(_ring_sum([a, b]))
    assert weight == 2.0
    np.testing.assert_allclose(avg["w"], [0.3, 0.0, 0.4], atol=1e-9)
    assert lay.sensitivity == 1.0 and lay.length == 3 + 1


def test_ring64_round_trip_and_the_sum_of_negative_values():
    x = np.array([-5, 0, 7, -(2**62)], np.int64)
    assert np.array_equal(from_ring64(to_ring64(x)), x)
    lay = UpdateLayout.build({"w": (1,)}, 3, clip=1.0)
    vecs = [lay.encode({"w": np.array([v])}, 1)[0] for v in (-0.5, -0.25, 0.1)]
    avg, weight = lay.decode(_ring_sum(vecs))
    assert weight == 3.0 and avg["w"][0] == pytest.approx(-0.65 / 3, abs=1e-6)


def test_straggle_differencing_learns_no_skipped_step_count():
    """The attack: two update releases whose survivor sets differ by one party difference to that party's exact
    count of skipped NaN/Inf steps, an integer slot outside every DP account. Defence: no layout has that slot, so
    the vector a party sends does not depend on its count and the sum decodes none."""
    rng = np.random.default_rng(1)
    for private in (False, True):
        lay = UpdateLayout.build(SHAPES, 3, clip=10.0, private=private, noise_multiplier=1.0 if private else 0.0,
                                 threshold=2)
        base = [lay.encode(_delta(rng), 5)[0] for _ in range(3)]
        with_counts = [lay.count_skipped(v, s) for v, s in zip(base, (0, 7, 3), strict=True)]
        assert all(np.array_equal(a, b) for a, b in zip(base, with_counts, strict=True))  # nothing of it is sent
        assert lay.length == lay.numel + 1  # the clipped deltas and the weight, nothing else
        two, three = _ring_sum(with_counts[:2]), _ring_sum(with_counts)
        assert lay.decode_skipped(three) is None and lay.decode_skipped(two) is None
        assert lay.decode(three)[1] - lay.decode(two)[1] == pytest.approx(1.0)  # only the weight differences


# ------------------------------------------------------------------------------ ring width
BIG = {"w": (7_121_682,)}  # the default model's update length, for the width rule (no encoding)


def test_auto_ring_picks_32_bit_words_when_the_bound_fits():
    lay = UpdateLayout.build(BIG, 10, clip=10.0, ring="auto")
    assert lay.bits == 32 and lay.frac_bits == 23  # B(23) = 10 * (10 * 2^23 + 1) <= 2^30 < B(24)
    assert lay.int_bound(lay.frac_bits) <= 2**30 < lay.int_bound(lay.frac_bits + 1)
    assert UpdateLayout.build(BIG, 10, clip=10.0).bits == 64  # the library default stays 64
    noisy = UpdateLayout.build(BIG, 10, 10.0, private=True, noise_multiplier=1.0, threshold=6, ring="auto")
    assert noisy.bits == 32 and noisy.frac_bits < lay.frac_bits  # the noise tail costs a bit


def test_a_release_that_does_not_fit_32_bits_gets_64_or_a_clear_error():
    wide = UpdateLayout.build(BIG, 1000, clip=10.0, ring="auto")  # 1000 x 10 x 2^20 > 2^30
    assert wide.bits == 64
    with pytest.raises(WrapError, match="privacy.ring-bits = 32: 1000 parties x clip 10 leave fewer than 20"):
        _ = UpdateLayout.build(BIG, 1000, clip=10.0, ring="32").bits
    loud = UpdateLayout.build(BIG, 10, 10.0, private=True, noise_multiplier=10.0, threshold=6, ring="auto")
    assert loud.bits == 64  # z_u = 10: the noise tail alone needs more than 2^30 at 20 fractional bits
    with pytest.raises(LayoutError, match="ring width"):
        UpdateLayout.build(BIG, 10, 10.0, ring="16")


def test_32_bit_sum_of_worst_case_inputs_does_not_wrap():
    """Every party at the clip bound, all with the same sign, sums to n * clip in Z_2^32 exactly (up to rounding);
    one more fractional bit would leave the one-bit margin, two the signed range (the check is tight)."""
    n, clip = 10, 10.0
    lay = UpdateLayout.build({"w": (3,)}, n, clip, ring="32")
    for sign in (1.0, -1.0):
        vecs = [lay.encode({"w": np.array([sign * clip, 0.0, 0.0])}, 1, np.random.default_rng(i))[0]
                for i in range(n)]
        assert vecs[0].dtype == np.uint32
        avg, w = lay.decode(_ring_sum(vecs))
        assert w == pytest.approx(n)
        assert avg["w"][0] == pytest.approx(sign * clip, abs=lay.quantisation_bound())
    f = lay.frac_bits
    assert n * (clip * 2.0 ** (f + 1)) > 2**30 and n * (clip * 2.0 ** (f + 2)) > 2**31 - 1  # f + 2 would wrap


@pytest.mark.parametrize("source", ["numpy", "default"])
def test_stochastic_quantisation_is_unbiased_and_bounded(source):
    """32-bit encoding error: below 2^-f per coordinate of the decoded mean, zero on average, with a given numpy
    Generator and with the default draws (a fresh AES-CTR ``KeystreamUniform`` per encode)."""
    lay = UpdateLayout.build({"w": (20_000,)}, 4, clip=10.0, ring="32")
    f = lay.frac_bits
    rng = np.random.default_rng(7) if source == "numpy" else None
    x = np.full(20_000, (3 + 0.3) * 2.0**-f)  # 0.3 of a step above a grid point: rint would always err by -0.3
    vecs = [lay.encode({"w": x}, 1, rng)[0] for _ in range(4)]
    avg, _ = lay.decode(_ring_sum(vecs))
    err = avg["w"].astype(np.float64) - x  # [20000]
    assert np.abs(err).max() <= lay.quantisation_bound() == 2.0**-f
    std = 2.0**-f * np.sqrt(0.3 * 0.7 / 4)  # per coordinate of the mean of 4 independent roundings
    assert abs(err.mean()) < 5 * std / np.sqrt(err.size)  # unbiased
    assert err.std() == pytest.approx(std, rel=0.05)
