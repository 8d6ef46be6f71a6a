"""The uniformity statistic of a masked input in the words of its ring (32-bit releases too)."""

from __future__ import annotations

import numpy as np

from distmoe.privacy import ring
from distmoe.privacy.secagg import primitives as P
from distmoe.privacy.secagg.selftest import mask_check_failure, mask_statistic, sign_run


def test_sign_run_counts_in_the_word_width():
    assert sign_run(np.array([0, 0xFFFFFFFF, 1 << 30], np.uint32)) == 31 + 31 + 0
    assert sign_run(np.array([0, 1 << 62], np.uint64)) == 63 + 0


def _sign_run_by_bits(a: np.ndarray, top: int) -> int:
    """The definition, word by word in Python integers: bits after the top bit equal to it."""
    s = 0
    for w in a.tolist():
        bits = [(w >> k) & 1 for k in range(top, -1, -1)]
        g = 0
        while g < top and bits[g + 1] == bits[0]:
            g += 1
        s += g
    return s


def test_sign_run_equals_the_bit_by_bit_definition_at_every_power_of_two_and_across_chunks(monkeypatch):
    from distmoe.privacy.secagg import selftest

    for bits, dt in ((32, np.uint32), (64, np.uint64)):
        edge = [(1 << k) + d for k in range(bits) for d in (-1, 0, 1) if 0 <= (1 << k) + d < (1 << bits)]
        rnd = np.random.default_rng(bits).integers(0, 1 << bits, 500, dtype=dt, endpoint=False)
        a = np.concatenate([np.array(edge, dt), ~np.array(edge, dt), rnd])  # positives, their negations, uniform
        want = _sign_run_by_bits(a, bits - 1)
        assert sign_run(a) == want
        monkeypatch.setattr(selftest, "SIGN_RUN_CHUNK", 7)  # many chunks, a ragged last one
        assert sign_run(a) == want
        monkeypatch.undo()


def test_uniform_32_bit_words_pass_and_a_32_bit_plaintext_fails():
    masked = P.prg(bytes(range(32)), 100_000, 32)
    assert mask_check_failure(mask_statistic(masked)) is None
    # as uint64 the same words would look like plaintext (32 leading zeros each): the width matters
    assert mask_check_failure(mask_statistic(masked.astype(np.uint64))) is not None
    plain = ring.encode_fixed(np.random.default_rng(0).normal(0, 1e-3, 1000), 2.0**23, 32, np.random.default_rng(1))
    assert mask_check_failure(mask_statistic(plain)) is not None  # y = x: zero masks are caught at 32 bits too
