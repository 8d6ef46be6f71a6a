"""The one ring codec (``distmoe.privacy.ring``): fixed point in Z_2^64 and the exact no-wrap boundary."""

from __future__ import annotations

import numpy as np
import pytest

from distmoe.privacy import ring
from distmoe.privacy.dp import SkellamSpec, client_share, encode_per_sequence
from distmoe.privacy.metric_noise import EvalSpec
from distmoe.privacy.vectors import StatsLayout


def _sum(words) -> np.ndarray:
    return np.sum(np.stack(words), axis=0, dtype=np.uint64)  # uint64 addition: mod 2^64


def test_round_trip_and_negative_values():
    x = np.array([0.0, 1.5, -1.5, -0.25, 1e6, -1e6, 3.0000001])
    w = ring.encode_fixed(x, 2.0**20)
    assert w.dtype == np.uint64 and w.shape == x.shape
    assert np.abs(ring.decode_fixed(w, 2.0**20) - x).max() <= 0.5 / 2**20
    assert w[2] == np.uint64(2**64 - int(1.5 * 2**20))  # two's complement, no offset
    assert np.array_equal(ring.from_ring64(ring.to_ring64(np.array([-(2**63), -1, 0, 2**63 - 1]))),
                          [-(2**63), -1, 0, 2**63 - 1])
    # a sum of mixed signs decodes to the sum of the rounded values
    xs = [np.array([-3.25, 2.0]), np.array([1.0, -7.5]), np.array([0.125, 0.0])]
    got = ring.decode_fixed(_sum([ring.encode_fixed(v, 8.0) for v in xs]), 8.0)
    assert np.array_equal(got, np.sum(xs, axis=0))
    with pytest.raises(ValueError, match="non-finite"):
        ring.encode_fixed(np.array([np.nan]), 1.0)
    with pytest.raises(TypeError):
        ring.to_ring64(np.array([1.5]))


def test_required_bits_is_magnitude_bits_plus_sign():
    assert ring.required_bits(0) == 1
    assert ring.required_bits(1) == 2
    assert ring.required_bits(10 * 1024) == 15  # 10240 < 2^14
    assert ring.required_bits(2**14 - 0.5) == 16  # ceil first: 2^14 needs 15 magnitude bits
    assert ring.required_bits(2**63 - 1) == 64
    assert ring.required_bits(2**63) == 65
    with pytest.raises(ValueError):
        ring.required_bits(-1)


def test_the_exact_no_wrap_boundary_both_sides():
    """|sum| <= 2^63 - 1 fits (and decodes exactly); 2^63 does not (and would wrap)."""
    assert ring.check_fits_ring64(2**63 - 1) == 64
    with pytest.raises(ring.WrapError, match="65 bits > 64"):
        ring.check_fits_ring64(2**63)
    with pytest.raises(ring.WrapError):
        ring.check_fits_ring64(float("inf"))
    a, b = 2**62, 2**62 - 1
    ok = _sum([ring.to_ring64(np.array([a, -a])), ring.to_ring64(np.array([b, -b]))])
    assert ring.from_ring64(ok).tolist() == [2**63 - 1, -(2**63 - 1)]
    wrapped = _sum([ring.to_ring64(np.array([a])), ring.to_ring64(np.array([a]))])
    assert ring.from_ring64(wrapped).tolist() == [-(2**63)]  # one unit past the boundary wraps
    # a single encoded value obeys the same limit
    assert ring.from_ring64(ring.encode_fixed(np.array([-(2.0**62)]), 2.0)).tolist() == [-(2**63)]
    with pytest.raises(ring.WrapError):
        ring.encode_fixed(np.array([2.0**62]), 2.0)


def test_one_codec_for_dp_shares_and_the_layouts():
    """DP shares, the stats layout and the float layouts all produce ring words, and their bounds are
    checked by the same ``check_fits_ring64``."""
    spec = SkellamSpec(2, 4, noise_multiplier=1.0, n_parties=3, num_sequences_max=20, scale=64, n_canaries=3,
                       rounding="mass-preserving")
    rng = np.random.default_rng(0)
    per_seq = rng.dirichlet(np.ones(4), size=(20, 2))  # [N, L, E]
    ints = encode_per_sequence(per_seq, 64, rounding="mass-preserving")
    share = client_share(ints, spec, 20, np.random.default_rng(1))
    layout = StatsLayout(spec)
    words = layout.encode(per_seq, np.random.default_rng(1))
    assert np.array_equal(words, ring.to_ring64(share))  # the layout's words are the ring encoding of the share
    noisy, canaries = layout.decode(_sum([words, words]))
    assert np.array_equal(canaries, 2 * share[8:]) and np.allclose(noisy, 2 * share[:8].reshape(2, 4) / 64)
    assert spec.required_bits() == ring.required_bits(spec.sum_bound())
    with pytest.raises(ring.WrapError, match="> 64"):
        SkellamSpec(2, 4, 1.0, n_parties=10_000, num_sequences_max=10**9, scale=2**20).check_fits_ring64()
    ev = EvalSpec(("t",), 1.0, n_parties=3, max_dropouts=1, examples_max=100, loss_bound=16.0)
    sums = ev.sums({"t": [(True, 8.0), (False, 40.0)]})  # the second loss is clipped to the bound
    assert sums.tolist() == [64, 32 + 64, 128]
    with pytest.raises(ring.WrapError, match="> 64"):
        EvalSpec(("t",), 1.0, n_parties=10_000, max_dropouts=0, examples_max=10**15, loss_bound=1.0
                 ).check_fits_ring64()


def test_encode_into_pieces_gives_the_words_of_one_float64_encoding():
    """The update encoder writes each float32 tensor straight into its words (no float64 copy of the update):
    the words must equal encoding the scaled float64 vector in one call, stochastic draws included."""
    from distmoe.privacy.ring import encode_fixed_into

    rng = np.random.default_rng(3)
    parts = [rng.standard_normal(n).astype(np.float32) for n in (1, 40_000, 7, 70_001)]  # across chunk edges
    pre, scale = 0.37, 2.0**23
    whole = np.concatenate([p.astype(np.float64) for p in parts]) * pre
    for bits in (32, 64):
        want = ring.encode_fixed(whole, scale, bits, np.random.default_rng(9) if bits == 32 else None)
        out = np.empty(whole.size, np.uint32 if bits == 32 else np.uint64)
        g, off = (np.random.default_rng(9) if bits == 32 else None), 0
        for p in parts:
            encode_fixed_into(p, scale, out[off:off + p.size], g, pre=pre)
            off += p.size
        np.testing.assert_array_equal(out, want)
    with pytest.raises(ring.WrapError):
        encode_fixed_into(np.array([300.0], np.float32), 2.0**23, np.empty(1, np.uint32))
