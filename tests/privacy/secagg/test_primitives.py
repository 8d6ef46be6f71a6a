"""The fast mask expansion (``primitives.combine_masks`` / ``prg_into``) equals the reference ``prg`` arithmetic
word for word: every width, lengths off the chunk and block grid, one or several threads, signs in any order."""

from __future__ import annotations

import numpy as np
import pytest

from distmoe.privacy.secagg import primitives as P

KEYS = [bytes([i]) * 32 for i in range(1, 6)]


def _reference(x: np.ndarray, terms, bits: int) -> np.ndarray:
    y = x.copy()
    for k, sign in terms:
        m = P.prg(k, len(x), bits)
        if sign > 0:
            y += m
        else:
            y -= m
    if bits not in (32, 64):
        y &= y.dtype.type(P.ring_mask(bits))
    return y


@pytest.mark.parametrize("bits", [64, 32, 20, 40])
@pytest.mark.parametrize("n", [1, 15, 16, 17, P.CHUNK_BYTES // 4 + 3, 3 * P.CHUNK_BYTES // 8 + 11])
@pytest.mark.parametrize("threads", [1, 3])
def test_combine_equals_reference(bits: int, n: int, threads: int) -> None:
    dt = P.word_dtype(bits)
    x = np.random.default_rng(n).integers(0, 2 ** min(bits, 63), n, dtype=np.uint64).astype(dt)
    terms = [(KEYS[0], 1), (KEYS[1], -1), (KEYS[2], -1), (KEYS[3], 1)]
    out = x.copy()
    P.combine_masks(out, terms, bits, threads=threads)
    assert np.array_equal(out, _reference(x, terms, bits))


@pytest.mark.parametrize("bits", [64, 32, 20])
def test_prg_into_equals_prg(bits: int) -> None:
    n = P.CHUNK_BYTES // 4 + 5
    out = np.full(n, 7, P.word_dtype(bits))
    P.prg_into(KEYS[4], out, bits)
    assert np.array_equal(out, P.prg(KEYS[4], n, bits))
    # a positioned stream (what a thread starts from) continues the keystream exactly
    start = 64 // P.word_dtype(bits).itemsize * 3  # three ChaCha20 blocks in
    full = np.zeros(n, P.word_dtype(bits))
    P._combine_range(full, [(KEYS[4], 0)], bits, start, n)
    ref = P.prg(KEYS[4], n, bits)
    assert not full[:start].any()
    got = full[start:] if bits in (32, 64) else full[start:] & full.dtype.type(P.ring_mask(bits))
    assert np.array_equal(got, ref[start:])


def test_combine_rejects_bad_buffers() -> None:
    with pytest.raises(ValueError, match="out must be"):
        P.combine_masks(np.zeros(4, np.uint64), [(KEYS[0], 1)], 32)
    with pytest.raises(ValueError, match="out must be"):
        P.combine_masks(np.zeros(8, np.uint32)[::2], [(KEYS[0], 1)], 32)
    with pytest.raises(ValueError, match="signs"):
        P.combine_masks(np.zeros(4, np.uint32), [(KEYS[0], 1), (KEYS[1], 0)], 32)
