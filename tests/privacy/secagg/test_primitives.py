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
    start = 64 // P.word_dtype(bits).itemsize * 3  # 192 bytes (twelve AES blocks) in
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


def test_the_positioned_keystream_is_nist_aes256_ctr():
    """NIST SP 800-38A F.5.5 (CTR-AES256.Encrypt), independent of this code: the keystream block at counter c is
    plaintext XOR ciphertext; ``_stream_at(key, 16 * c)`` must give it, and the next block at c + 1 (the
    protocol's counter layout: block index as the 128-bit big-endian counter)."""
    key = bytes.fromhex("603deb1015ca71be2b73aef0857d77811f352c073b6108d72d9810a30914dff4")
    counter = int("f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff", 16)
    pts = ["6bc1bee22e409f96e93d7e117393172a", "ae2d8a571e03ac9c9eb76fac45af8e51"]
    cts = ["601ec313775789a5b7a7f504bbf3d228", "f443e3ca4d62b59aca84e990cacaf5c5"]
    want = b"".join(bytes(a ^ b for a, b in zip(bytes.fromhex(p), bytes.fromhex(c), strict=True))
                    for p, c in zip(pts, cts, strict=True))
    assert P._stream_at(key, 16 * counter).update(bytes(32)) == want
    with pytest.raises(ValueError, match="16-byte block"):
        P._stream_at(key, 8)
