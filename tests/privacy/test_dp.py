"""Distributed Skellam DP for router statistics: encoding, calibration, canaries, bit widths, sensitivity."""

from __future__ import annotations

import math

import numpy as np
import pytest

from distmoe.privacy import ring
from distmoe.privacy.dp import (
    KeystreamUniform,
    SkellamSpec,
    WrapError,
    canary_chi2_test,
    client_share,
    crypto_rng,
    decode_stats,
    encode_per_sequence,
    encode_stats,
    int_sensitivity,
    l2_sensitivity,
    pack,
    required_bits,
    sequence_contribution_norm,
    skellam_noise,
    skellam_tail,
    sum_bound,
)

L, E = 24, 8


def _per_seq(rng, n, layers=L, experts=E, alpha=0.3):
    return rng.dirichlet(np.full(experts, alpha), size=(n, layers))  # [N, L, E] simplex rows


@pytest.mark.parametrize("scale", [32, 64, 100.5])
def test_encoding_round_trip_error_within_one_over_scale(scale):
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 500, size=(L, E))
    enc = encode_stats(x, scale)
    assert enc.dtype == np.int64
    err = np.abs(decode_stats(enc, scale) - x).max()
    assert err <= 0.5 / scale + 1e-12 and err <= 1 / scale
    assert err > 0.1 / scale  # it really rounds (the bound is not vacuous)


def test_scale_below_32_refused():
    with pytest.raises(ValueError, match="scale"):
        encode_stats(np.ones((2, 2)), 16)


def test_per_sequence_encoding_requires_simplex_rows():
    rng = np.random.default_rng(1)
    m = _per_seq(rng, 10)
    enc = encode_per_sequence(m, 32)
    assert enc.shape == (L, E) and np.array_equal(enc, np.rint(m * 32).astype(np.int64).sum(0))
    bad = m.copy()
    bad[3, 0] *= 2.0  # a row summing to 2 would double the sensitivity
    with pytest.raises(ValueError, match="simplex"):
        encode_per_sequence(bad, 32)


def test_sensitivity_of_sequence_contribution_at_most_sqrt_L():
    rng = np.random.default_rng(2)
    m = np.concatenate([_per_seq(rng, 2000, alpha=a) for a in (0.01, 0.3, 5.0)])
    norms = sequence_contribution_norm(m)
    assert norms.max() <= l2_sensitivity(L) + 1e-12
    vertices = np.zeros((1, L, E))
    vertices[0, :, 3] = 1.0  # one-hot every layer: the worst case attains the bound
    assert sequence_contribution_norm(vertices)[0] == pytest.approx(math.sqrt(L))
    # integer sensitivity after per-sequence rounding (including the vertex worst case)
    d2, d1 = int_sensitivity(L, E, 32, "per-sequence")
    ints = np.rint(np.concatenate([m, vertices]) * 32)
    assert np.sqrt((ints**2).sum((1, 2))).max() <= d2
    assert np.abs(ints).sum((1, 2)).max() <= d1
    # and after rounding the float sum: neighbouring datasets differ by at most D2("sum")
    d2s, _ = int_sensitivity(L, E, 32, "sum")
    base = m[:500].sum(0)
    diffs = [encode_stats(base + m[i], 32) - encode_stats(base, 32) for i in range(500, 1500)]
    assert max(np.sqrt((d.astype(float) ** 2).sum()) for d in diffs) <= d2s


def test_skellam_shares_are_integers_with_the_party_variance():
    spec = SkellamSpec(L, E, noise_multiplier=2.0, n_parties=5, num_sequences_max=100, scale=32)
    x = skellam_noise(200_000, spec.party_variance, np.random.default_rng(3))
    assert x.dtype == np.int64
    assert x.var() == pytest.approx(spec.party_variance, rel=0.02)


@pytest.mark.parametrize("n_parties,max_dropouts,present", [(5, 0, 5), (6, 2, 4)])
def test_aggregate_noise_has_calibrated_variance(n_parties, max_dropouts, present):
    spec = SkellamSpec(4, 4, noise_multiplier=1.5, n_parties=n_parties, num_sequences_max=100, scale=32,
                       max_dropouts=max_dropouts)
    assert spec.sigma_int == pytest.approx(1.5 * (32 * 2 + 0.5 * 4))  # z * (s sqrt(L) + sqrt(LE)/2)
    m = 200_000
    rngs = [np.random.default_rng(100 + i) for i in range(present)]
    total = sum(skellam_noise(m, spec.party_variance, g) for g in rngs)
    target = spec.sigma_int**2
    assert total.var() == pytest.approx(target, rel=0.02)
    assert abs(total.mean()) < 5 * spec.sigma_int / math.sqrt(m)
    assert spec.effective_noise_multiplier(present) == pytest.approx(1.5)


def test_effective_noise_multiplier_drops_with_survivors():
    spec = SkellamSpec(L, E, noise_multiplier=10.0, n_parties=6, num_sequences_max=1000)
    assert spec.effective_noise_multiplier(5) == pytest.approx(10.0 * math.sqrt(5 / 6))
    assert spec.dp_params(5)["z_eff"] == pytest.approx(10.0 * math.sqrt(5 / 6))


def _round(spec, parties_seqs, skip_noise=(), seed=0):
    """Encode, share, sum in Z_2^64 and decode one round; returns (true float sum, stats, canaries, int_sum)."""
    rng = np.random.default_rng(seed)
    shares, true = [], np.zeros((spec.layers, spec.experts))
    for i, n in enumerate(parties_seqs):
        m = _per_seq(rng, n, spec.layers, spec.experts)
        true += m.sum(0)
        enc = encode_per_sequence(m, spec.scale)
        share = pack(enc, spec.n_canaries) if i in skip_noise else client_share(enc, spec, n, np.random.default_rng(
            1000 + seed * 10 + i))
        shares.append(ring.to_ring64(share))
    int_sum = ring.from_ring64(np.sum(shares, axis=0, dtype=np.uint64))  # the sum mod 2^64, read as int64
    d = spec.dim
    stats = int_sum[:d].reshape(spec.layers, spec.experts) / spec.scale
    return true, stats, int_sum[d:] / spec.scale, int_sum


def test_canaries_decode_to_noise_with_calibrated_variance():
    spec = SkellamSpec(L, E, noise_multiplier=10.0, n_parties=6, num_sequences_max=400, scale=32, n_canaries=4096)
    spec.check_fits_ring64()
    true, stats, canaries, _ = _round(spec, [400, 300, 350, 200, 250, 380])
    sigma = spec.aggregate_sigma() / spec.scale
    t = canary_chi2_test(canaries, sigma)
    assert t.passed and t.dof == 4096
    assert 0.97 < t.sigma_ratio < 1.03
    assert 1e-3 < t.p_low < 1 - 1e-3  # a two-sided goodness of fit passes too
    # the statistic itself is the truth plus that noise, and rows give the count
    assert np.abs(stats - true).max() < 6 * sigma
    assert stats.sum(-1).mean() == pytest.approx(1880, abs=6 * sigma * math.sqrt(E / L))


def test_missing_noise_share_fails_the_canary_test():
    spec = SkellamSpec(L, E, noise_multiplier=10.0, n_parties=6, num_sequences_max=400, scale=32, n_canaries=4096)
    _, _, honest, _ = _round(spec, [300] * 6, seed=1)
    _, _, faulty, _ = _round(spec, [300] * 6, skip_noise=(2,), seed=1)
    sigma = spec.aggregate_sigma() / spec.scale
    good, bad = canary_chi2_test(honest, sigma), canary_chi2_test(faulty, sigma)
    assert good.passed
    assert not bad.passed and bad.p_low < 1e-8
    assert bad.statistic < good.statistic
    assert bad.sigma_ratio == pytest.approx(math.sqrt(5 / 6), abs=0.03)
    # accounted with the survivors' sigma (one share missing), the same canaries are consistent again
    assert canary_chi2_test(faulty, spec.aggregate_sigma(5) / spec.scale).passed


def test_ring_sum_of_shares_decodes_to_the_plain_sum():
    """DP shares go through the one ring codec: their sum mod 2^64, read as int64, is the plain integer sum,
    and the bits it needs are those of the data-plus-noise bound."""
    spec = SkellamSpec(4, 4, noise_multiplier=1.0, n_parties=3, num_sequences_max=50, scale=32, n_canaries=8)
    spec.check_fits_ring64()
    assert spec.required_bits() == ring.required_bits(spec.sum_bound())
    rng = np.random.default_rng(5)
    shares = []
    for i in range(3):
        enc = encode_per_sequence(_per_seq(rng, 50, 4, 4, alpha=0.05), 32)
        shares.append(client_share(enc, spec, 50, np.random.default_rng(i)))
    plain = np.sum(shares, axis=0)
    assert np.array_equal(ring.from_ring64(np.sum([ring.to_ring64(s) for s in shares], axis=0, dtype=np.uint64)),
                          plain)
    assert int(np.abs(plain).max()) <= spec.sum_bound()


def test_required_bits_grows_with_parties_and_noise():
    base = required_bits(6, 10_000, 32, 1637.0, n_coords=4288)
    assert base == 22  # 6 * 10k * 32.5 ~ 1.95e6 (21 bits) plus sign
    assert required_bits(12, 10_000, 32, 1637.0, n_coords=4288) == base + 1
    assert required_bits(6, 10_000, 32, 1637.0, tail=1e4) > base
    assert base == ring.required_bits(sum_bound(6, 10_000, 32, 1637.0, n_coords=4288))


def test_skellam_tail_bound_holds_and_is_gaussian_like():
    v = 1e6
    t = skellam_tail(v, n_coords=1, fail_prob=1e-12)
    assert 7.0 < t / math.sqrt(v) < 8.0  # ~ sqrt(2 ln(2e12)) = 7.5 sigma for large variance
    x = skellam_noise(1_000_000, v, np.random.default_rng(6))
    assert np.abs(x).max() < skellam_tail(v, n_coords=x.size, fail_prob=1e-6)


def test_client_share_refuses_more_sequences_than_planned():
    spec = SkellamSpec(2, 2, noise_multiplier=1.0, n_parties=2, num_sequences_max=10)
    with pytest.raises(ValueError, match="num_sequences_max"):
        client_share(np.zeros((2, 2), np.int64), spec, 11)
    with pytest.raises(ValueError, match="out of range"):
        client_share(np.full((2, 2), 10_000, np.int64), spec, 10)


def test_crypto_rng_is_fresh_each_time():
    a, b = crypto_rng().integers(0, 2**63, 4), crypto_rng().integers(0, 2**63, 4)
    assert not np.array_equal(a, b)


def test_keystream_uniform_is_aes_ctr_read_as_numpy_doubles_and_consumed_in_order():
    """The stochastic rounding's draws: (w >> 11) * 2^-53 of the AES-256-CTR keystream words, in order across
    calls and chunk edges, uniform on [0, 1), a fresh key per instance."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    key, n = bytes(range(32)), 70_001  # across the 32768-draw chunk edges
    ks = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor().update(bytes(8 * n))
    want = (np.frombuffer(ks, np.uint64) >> np.uint64(11)).astype(np.float64) * 2.0**-53  # [n]
    u = KeystreamUniform(key)
    parts = [u.random(1), u.random(out=np.empty(40_000)), u.random(n - 40_001)]
    got = np.concatenate(parts)
    assert np.array_equal(got, want)
    assert got.min() >= 0.0 and got.max() < 1.0
    assert abs(got.mean() - 0.5) < 5 * np.sqrt(1 / 12 / n) and got.var() == pytest.approx(1 / 12, rel=0.02)
    assert not np.array_equal(KeystreamUniform().random(8), KeystreamUniform().random(8))
    with pytest.raises(TypeError, match="float64"):
        u.random(4, dtype=np.float32)
    with pytest.raises(ValueError, match="float64"):
        u.random(out=np.empty(4, np.float32))
    with pytest.raises(ValueError, match="32-byte"):
        KeystreamUniform(b"short")


# ------------------------------------------------------------------------------ mass-preserving rounding
def test_mass_preserving_rounding_keeps_every_row_on_the_integer_simplex():
    rng = np.random.default_rng(5)
    m = np.concatenate([_per_seq(rng, 300, alpha=a) for a in (0.01, 0.3, 5.0)])  # [N, L, E]
    for s in (32, 64, 100):
        per = np.stack([encode_per_sequence(m[i:i + 1], s, rounding="mass-preserving") for i in range(0, 900, 7)])
        assert (per >= 0).all() and (per.sum(-1) == s).all()  # every sequence's row sums to s exactly
        assert np.abs(per - m[::7] * s).max() < 1.0  # and stays within one unit of s*m per entry
        total = encode_per_sequence(m, s, rounding="mass-preserving")
        assert (total.sum(-1) == len(m) * s).all()
        d2, d1 = int_sensitivity(L, E, s, "mass-preserving")
        assert d2 == pytest.approx(s * math.sqrt(L)) and d1 == s * L
        assert np.sqrt((per.astype(float) ** 2).sum((1, 2))).max() <= d2 + 1e-9
    # nearest-integer rounding per entry does not keep the row sums (why the audit needs this mode)
    assert not (encode_per_sequence(m, 32).sum(-1) == len(m) * 32).all()
    with pytest.raises(ValueError, match="integer scale"):
        encode_per_sequence(m, 32.5, rounding="mass-preserving")


def test_run_specs_use_mass_preserving_rounding_and_refuse_to_wrap_the_64_bit_ring():
    from distmoe.config import parse_run_config
    from distmoe.privacy.releases.stats import spec as stats_spec
    from distmoe.privacy.vectors import StatsLayout

    p = parse_run_config({"privacy.scale": 2**20, "privacy.num-sequences-max": 10**9, "privacy.delta": 1e-10,
                          "federation.min-available": 2}).privacy
    spec = stats_spec(p, 1.0, 8, 8, 3, 2)  # 3 x 1e9 x 2^20 fits in 64 bits
    assert spec.rounding == "mass-preserving" and spec.required_bits() <= 64
    with pytest.raises(WrapError, match="> 64"):  # 10^4 parties x 10^9 sequences x 2^20 does not
        stats_spec(p, 1.0, 8, 8, 10_000, 5_001)
    big = SkellamSpec(8, 8, noise_multiplier=1.0, n_parties=10_000, num_sequences_max=10**9, scale=2**20)
    with pytest.raises(WrapError):
        StatsLayout(big)


def test_default_canaries_detect_one_missing_noise_share_among_six_parties():
    """With the default K, a party that skips its noise share in a 6-party round (threshold 4, so the
    sum should carry 6/4 of the target variance) is caught at the audit's level in (almost) every round."""
    from distmoe.audit.noise_checks import ALPHA
    from distmoe.config import parse_run_config
    from distmoe.privacy.plan import threshold_for

    k = parse_run_config({}).privacy.noise_canaries
    t = threshold_for(6, 2)
    spec = SkellamSpec(L, E, noise_multiplier=0.7, n_parties=6, num_sequences_max=400, scale=64, n_canaries=k,
                       max_dropouts=6 - t, rounding="mass-preserving")
    sigma = spec.aggregate_sigma(6) / spec.scale
    caught = honest_ok = 0
    for seed in range(10):
        _, _, honest, _ = _round(spec, [300] * 6, seed=seed)
        _, _, faulty, _ = _round(spec, [300] * 6, skip_noise=(4,), seed=seed)
        honest_ok += canary_chi2_test(honest, sigma, ALPHA).passed
        caught += not canary_chi2_test(faulty, sigma, ALPHA).passed
    assert honest_ok == 10
    assert caught >= 9, f"default K = {k} caught {caught}/10 rounds with one noise share missing"
