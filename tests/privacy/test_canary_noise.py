"""Noise that is present only where the audit looks: the row-sum noise test of the router
statistic and the per-release canary positions (``distmoe.privacy.dp``, ``StatsLayout``).

The attacks run the real share code (``dp.client_share`` through ``StatsLayout.encode``) with a patched noise step,
the way a party's fork would, and sum the parties' vectors in Z_2^64 as secure aggregation does.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from distmoe.privacy import dp
from distmoe.privacy.dp import (
    SkellamSpec,
    canary_chi2_test,
    canary_positions,
    canary_seed,
    positions_digest,
    row_noise_power,
    row_noise_test,
)
from distmoe.privacy.vectors import StatsLayout

ALPHA = 1e-6


def _spec(layers=8, experts=4, n=3, k=64, z=1.0) -> SkellamSpec:
    return SkellamSpec(
        layers,
        experts,
        z,
        n_parties=n,
        num_sequences_max=1000,
        scale=64,
        n_canaries=k,
        max_dropouts=0,
        rounding="mass-preserving",
    )


def _per_seq(rng, n_seq, spec):
    return rng.dirichlet(np.full(spec.experts, 0.5), size=(n_seq, spec.layers))  # [N, L, E] simplex rows


def _release(spec, rng, seed=None, canary_only=(), n_seq=20):
    """One release: each party's real ``StatsLayout.encode``; parties in ``canary_only`` run the fork below.
    Returns (row sums [L], canaries [K], tau)."""
    layout = StatsLayout(spec, seed)
    total = np.zeros(layout.length, np.uint64)
    for i in range(spec.n_parties):
        share = _canary_only_share if i in canary_only else dp.client_share
        real, dp.client_share = dp.client_share, share
        try:
            total += layout.encode(_per_seq(rng, n_seq, spec), rng)  # wraps mod 2^64 like the secure sum
        finally:
            dp.client_share = real
    ints = layout.decode_ints(total)  # [L*E + K] share order
    rows = ints[: spec.dim].reshape(spec.layers, spec.experts).sum(1)
    return rows, ints[spec.dim :], math.sqrt(spec.experts) * spec.aggregate_sigma()


def _canary_only_share(int_stats, spec, num_sequences, rng=None):
    """The attacker's fork of ``dp.client_share``: the full noise share, but only on the canary coordinates
    (the share's last K entries, which ``StatsLayout`` places at the canary positions)."""
    flat = dp.pack(int_stats, spec.n_canaries)
    flat[spec.dim :] += dp.skellam_noise(spec.n_canaries, spec.party_variance, rng)
    return flat


# ------------------------------------------------------------------------------------------- row noise
def test_honest_releases_rarely_alarm_and_p_values_are_calibrated():
    """Many honest simulated runs (3 releases of an [8, 4] statistic from 3 parties with real Skellam shares):
    the lower-tail p-values are uniform (slightly conservative), none comes near the audit's 1e-6 level."""
    spec, rng = _spec(k=0), np.random.default_rng(11)
    ps = []
    for _ in range(600):
        rels = [_release(spec, rng, n_seq=5)[::2] for _ in range(3)]
        ps.append(row_noise_test(rels, ALPHA).p_low)
    ps = np.array(ps)
    assert ps.min() > 1e-4
    for level in (0.01, 0.05, 0.2, 0.5):  # P[p <= level] <= level (+ 4 binomial sigma)
        assert (ps <= level).mean() <= level + 4 * math.sqrt(level * (1 - level) / ps.size), level
    assert 0.45 < ps.mean() < 0.56  # uniform: mean 1/2


def test_canary_only_noise_at_every_party_leaves_exact_row_sums_and_fails():
    """Every party runs the fork: the canary test still passes (the canaries carry all the noise) while every row
    sum is exactly N*s (exact equalities) and the row-noise test fails. Without the row-noise test (the
    defence under test), nothing in the release would show the missing noise."""
    spec, rng = _spec(), np.random.default_rng(1)
    rows, canaries, tau = _release(spec, rng, canary_only=range(3))
    assert np.all(rows == rows[0]) and rows[0] == 3 * 20 * 64
    assert canary_chi2_test(canaries, spec.aggregate_sigma(), 1e-4).passed
    t = row_noise_test([(rows, tau)], ALPHA)
    assert not t.passed and t.statistic == 0 and t.p_low < 1e-15
    honest_rows, _, _ = _release(spec, rng)
    assert row_noise_test([(honest_rows, tau)], ALPHA).passed and len(set(honest_rows.tolist())) > 1


def test_exact_equalities_fail_only_where_the_lattice_makes_them_improbable():
    """All rows equal is T = 0; with two layers and one release an honest sum does that with probability ~1e-3
    (the conservative lattice correction says so), so it cannot fail there; with more releases it does."""
    spec = _spec(layers=2, z=0.5, k=0)
    tau = math.sqrt(spec.experts) * spec.aggregate_sigma()
    one = row_noise_test([([100, 100], tau)], ALPHA)
    assert one.passed and 1e-4 < one.p_low < 0.05
    assert not row_noise_test([([100, 100], tau)] * 4, ALPHA).passed


def test_one_canary_only_party_of_three_is_caught_at_the_predicted_rate(layers=24, releases=20):
    """One of three parties runs the fork: the row noise keeps 2/3 of its variance. The measured detection rate
    over simulated runs matches ``row_noise_power`` (documented in docs/privacy.md §6)."""
    spec, rng = _spec(layers=layers, k=0), np.random.default_rng(layers)
    dof = (layers - 1) * releases
    want = row_noise_power(3, 2, dof, ALPHA)
    trials, hits = 60, 0
    for _ in range(trials):
        rels = [_release(spec, rng, canary_only=(0,), n_seq=2)[::2] for _ in range(releases)]
        hits += not row_noise_test(rels, ALPHA).passed
    assert 0.6 < want < 1.0
    assert abs(hits / trials - want) < 4 * math.sqrt(want * (1 - want) / trials) + 0.02, (hits, want)


def test_power_is_certain_for_all_and_weak_for_one_of_many():
    assert row_noise_power(3, 0, 3) == 1.0
    assert row_noise_power(10, 9, 7 * 5) < 1e-3  # one of ten parties, 8 layers x 5 releases: invisible
    assert row_noise_power(2, 1, 47 * 5) > 0.99


def test_row_noise_test_refuses_unusable_input():
    with pytest.raises(ValueError):
        row_noise_test([([1, 2], 0.0)])
    with pytest.raises(ValueError):
        row_noise_test([([1], 3.0)])


# -------------------------------------------------------------------------------------- canary positions
def _u1(rng, n=3):
    return [(100 + i, bytes(rng.integers(0, 256, 32, dtype=np.uint8))) for i in range(n)]


def test_canary_positions_differ_per_release_and_depend_on_every_mask_key():
    rng = np.random.default_rng(0)
    u1 = _u1(rng)
    s1, s2 = canary_seed(b"run", 1, u1), canary_seed(b"run", 2, u1)
    assert s1 == canary_seed(b"run", 1, list(reversed(u1)))  # order-free, recomputable
    p1, p2 = canary_positions(s1, 96, 64), canary_positions(s2, 96, 64)
    assert np.array_equal(p1, canary_positions(s1, 96, 64))
    assert len(set(p1.tolist())) == 64 and p1.min() >= 0 and p1.max() < 96 and np.all(np.diff(p1) > 0)
    assert not np.array_equal(p1, p2) and positions_digest(p1) != positions_digest(p2)
    assert not np.array_equal(p1, np.arange(32, 96))  # not the old fixed tail
    for i in range(3):  # any one party's fresh key changes the seed
        other = list(u1)
        other[i] = (u1[i][0], bytes(32))
        assert canary_seed(b"run", 1, other) != s1
    assert canary_seed(b"run", 1, u1[:2]) != s1 and canary_seed(b"other", 1, u1) != s1


def test_canary_positions_are_uniform_over_the_vector():
    rng = np.random.default_rng(1)
    counts = np.zeros(40)
    for r in range(2000):
        counts[canary_positions(canary_seed(b"run", r, _u1(rng, 2)), 40, 10)] += 1
    expect = 2000 * 10 / 40
    assert np.abs(counts - expect).max() < 5 * math.sqrt(expect)


def test_layout_with_seed_round_trips_and_puts_canaries_off_the_tail():
    spec, rng = _spec(k=16), np.random.default_rng(2)
    seed = canary_seed(b"run", 3, _u1(rng))
    layout = StatsLayout(spec, seed)
    per = [_per_seq(rng, 5, spec) for _ in range(3)]
    total = sum((layout.encode(m, rng) for m in per), np.zeros(layout.length, np.uint64))
    noisy, canaries = layout.decode(total)
    want = sum(dp.encode_per_sequence(m, 64, rounding="mass-preserving") for m in per) / 64
    assert np.abs(noisy - want).max() < 8 * spec.aggregate_sigma() / 64
    assert canaries.shape == (16,) and np.abs(canaries).max() < 8 * spec.aggregate_sigma()
    pos = layout.canary_positions
    assert not np.array_equal(pos, np.arange(spec.dim, layout.length))
    assert np.array_equal(layout.decode_ints(total)[spec.dim :], canaries)


def test_a_fork_with_noise_at_the_old_fixed_tail_now_fails_the_canary_test():
    """A fork written against the old layout adds its noise to the vector's last K coordinates. With canaries at
    drawn positions those are mostly data coordinates; the canaries get none of its noise and the canary test
    fails (with canaries at the tail, the defence removed, this fork would pass)."""
    spec, rng = _spec(layers=24, experts=8, k=64, n=3), np.random.default_rng(3)
    for seed, passes in ((None, True), (canary_seed(b"run", 1, _u1(rng)), False)):
        layout = StatsLayout(spec, seed)
        total = np.zeros(layout.length, np.uint64)
        for _ in range(3):
            ints = dp.encode_per_sequence(_per_seq(rng, 5, spec), 64, rounding="mass-preserving")
            vec = np.zeros(layout.length, np.int64)
            vec[layout._data_positions(layout.canary_positions)] = ints.ravel()  # the data where the party puts it
            vec[-spec.n_canaries :] += dp.skellam_noise(spec.n_canaries, spec.party_variance, rng)  # "noise at tail"
            total += dp.ring.to_ring64(vec)
        _, canaries = layout.decode(total)
        assert canary_chi2_test(canaries, spec.aggregate_sigma(), 1e-4).passed is passes
