"""Cryptographically seeded randomness for the privacy mechanisms: ``crypto_rng`` (noise draws) and
``KeystreamUniform`` (the uniforms of stochastic rounding).

``crypto_rng``: a ``numpy`` Generator (PCG64DXSM) seeded with 256 bits from ``secrets`` (OS CSPRNG). PCG64 is not
itself a CSPRNG; the seed cannot be guessed and single noise draws are never observed (they are inside masked
sums), which is the threat model here. numpy's Poisson sampler is floating-point based, so its law is exact only
up to float rounding (no low-bit attack applies: outputs are integers).

``KeystreamUniform``: uniform doubles from AES-256-CTR under a fresh 256-bit key (a CSPRNG), the source of the
model update's unbiased stochastic rounding (``distmoe.privacy.vectors``, ``distmoe.privacy.ring``).

Owns: the two random sources and the double construction of the keystream draws.
Must not: import ``flwr``, ``torch`` or anything of distmoe, or draw noise of any law (``distmoe.privacy.dp``
does).
"""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

__all__ = ["KeystreamUniform", "crypto_rng"]


def crypto_rng() -> np.random.Generator:
    """A Generator seeded with 256 bits of OS entropy (``secrets``); see the module docstring."""
    return np.random.Generator(np.random.PCG64DXSM(np.random.SeedSequence(secrets.randbits(256))))


_DRAW_CHUNK = 1 << 15  # doubles per keystream chunk: 256 KiB of keystream and scratch, L2-resident
_DRAW_ZEROS = bytes(8 * _DRAW_CHUNK)


class KeystreamUniform:
    """Uniform ``[0, 1)`` doubles from AES-256-CTR under a fresh 256-bit key from ``secrets``: the source of the
    model update's stochastic rounding (``distmoe.privacy.vectors``), used where ``rng.random(out=...)`` of a
    numpy Generator would be. Each draw is one 64-bit keystream word ``w`` (native byte order: the key is
    uniform, so is any fixed reading of its stream), ``(w >> 11) * 2^-53``: numpy's own double construction,
    every multiple of 2^-53 in [0, 1) equally likely. Draws are consumed in order, so ``random(out=a)`` then
    ``random(out=b)`` fill ``a, b`` as one call over their concatenation would.

    Why not ``crypto_rng().random``: AES-CTR is a CSPRNG (PCG64DXSM is not) and, with AES-NI, cheaper; on the
    2-core CI machine 7.1M draws cost ~10 ms of keystream plus two cache-resident passes, against ~24 ms for
    PCG64DXSM (the stochastic rounding was the largest secure-only stage after the masks). The
    stream of one instance never repeats below 2^128 blocks."""

    def __init__(self, key: bytes | None = None) -> None:
        key = secrets.token_bytes(32) if key is None else bytes(key)
        if len(key) != 32:
            raise ValueError("KeystreamUniform takes a 32-byte key")
        self._enc = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
        self._words = np.empty(_DRAW_CHUNK, np.uint64)  # [chunk] keystream words, reused

    def random(self, size: int | None = None, dtype: Any = np.float64, out: np.ndarray | None = None) -> np.ndarray:
        """``size`` doubles ``[size]`` or, with ``out`` (a writeable C-contiguous float64 array), ``out`` filled."""
        if np.dtype(dtype) != np.float64:
            raise TypeError("KeystreamUniform draws float64 only")
        if out is None:
            if size is None:
                raise TypeError("random() needs size or out")
            out = np.empty(int(size), np.float64)
        elif out.dtype != np.float64 or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"out must be a writeable contiguous float64 array, got {out.dtype}")
        flat = out.reshape(-1)  # [n] view
        for a in range(0, flat.size, _DRAW_CHUNK):
            b = min(a + _DRAW_CHUNK, flat.size)
            w = self._words[:b - a]  # [b - a]
            self._enc.update_into(_DRAW_ZEROS[:8 * (b - a)], memoryview(w).cast("B"))
            np.right_shift(w, np.uint64(11), out=w)  # 53 uniform bits
            np.multiply(w, 2.0**-53, out=flat[a:b], casting="unsafe")  # exact: w < 2^53
        return out
