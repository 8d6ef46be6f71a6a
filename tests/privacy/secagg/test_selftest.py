"""The uniformity statistic of a masked input in the words of its ring (issue 14: 32-bit releases)."""

from __future__ import annotations

import numpy as np

from distmoe.privacy import ring
from distmoe.privacy.secagg import primitives as P
from distmoe.privacy.secagg.selftest import mask_check_failure, mask_statistic, sign_run


def test_sign_run_counts_in_the_word_width():
    assert sign_run(np.array([0, 0xFFFFFFFF, 1 << 30], np.uint32)) == 31 + 31 + 0
    assert sign_run(np.array([0, 1 << 62], np.uint64)) == 63 + 0


def test_uniform_32_bit_words_pass_and_a_32_bit_plaintext_fails():
    masked = P.prg(bytes(range(32)), 100_000, 32)
    assert mask_check_failure(mask_statistic(masked)) is None
    # as uint64 the same words would look like plaintext (32 leading zeros each): the width matters
    assert mask_check_failure(mask_statistic(masked.astype(np.uint64))) is not None
    plain = ring.encode_fixed(np.random.default_rng(0).normal(0, 1e-3, 1000), 2.0**23, 32, np.random.default_rng(1))
    assert mask_check_failure(mask_statistic(plain)) is not None  # y = x: zero masks are caught at 32 bits too
