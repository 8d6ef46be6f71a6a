"""The one fixed-point ring codec: reals and integers into Z_2^64, and the one no-wrap check.

Every secure sum of distmoe lives in Z_2^64: each party sends uint64 words, the SecAgg server adds them
modulo 2^64, and the sum is read back as a signed int64. Encoding a real ``x`` at scale ``s`` is
``q = rint(s * x)`` as an int64, sent as its two's-complement word ``q mod 2^64`` (:func:`encode_fixed`,
:func:`to_ring64`); the modular sum of the words, read as int64 (:func:`from_ring64`), is exactly
``sum_i q_i`` as long as that sum lies in the signed range of 64 bits. Negative values and sums of any
sign need no offset.

Bit budget (one rule for every caller): if ``|sum_i q_i| <= B`` then the sum needs
``required_bits(B) = bit_length(ceil(B)) + 1`` bits (magnitude bits plus a sign bit), and it cannot wrap
in Z_2^64 iff ``required_bits(B) <= 64``, i.e. ``ceil(B) <= 2^63 - 1``: 63 bits of magnitude and a sign.
The sum is reduced modulo 2^64 after every addition (uint64 arithmetic), so no intermediate needs more
headroom than the final sum. Callers compute ``B`` from public bounds (parties x largest contribution,
plus a noise tail for DP shares) and call :func:`check_fits_ring64` before anything is sent.

Users: ``distmoe.privacy.dp`` (Skellam shares: the data bound plus the noise tail),
``distmoe.privacy.vectors`` (the fixed-point layouts of updates, statistics and evaluation numbers) and
the SecAgg protocol, whose inputs and sums are these words.

Must not: clip or wrap silently (an input that does not fit raises :class:`WrapError`), add noise, or
import anything of distmoe.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["RING_BITS", "WrapError", "check_fits_ring64", "decode_fixed", "encode_fixed", "from_ring64",
           "required_bits", "to_ring64"]

RING_BITS = 64  # every secure sum lives in Z_2^64
MAX_ABS = 2**63 - 1  # the largest |sum| that fits: 63 magnitude bits and a sign


class WrapError(ValueError):
    """A value or a sum could leave the signed range of Z_2^64 (it would wrap silently)."""


def to_ring64(q: np.ndarray) -> np.ndarray:
    """Signed int64 ``[...]`` -> its two's-complement words in Z_2^64 ``[...]`` (uint64, same bits)."""
    a = np.asarray(q)
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"integer array required, got {a.dtype}")
    return np.ascontiguousarray(a.astype(np.int64, copy=False)).view(np.uint64)


def from_ring64(v: np.ndarray) -> np.ndarray:
    """Words of Z_2^64 ``[...]`` (uint64) -> signed int64 in [-2^63, 2^63) ``[...]``."""
    return np.ascontiguousarray(np.asarray(v, np.uint64)).view(np.int64)


def encode_fixed(x: np.ndarray, scale: float) -> np.ndarray:
    """Reals ``[...]`` -> words ``[...]``: ``rint(x * scale)`` as int64, in two's complement mod 2^64.

    Raises ``ValueError`` for a non-finite value and :class:`WrapError` for one outside the int64 range
    ``[-2^63, 2^63)``. The round-trip error is at most ``1 / (2 * scale)`` per coordinate.
    """
    q = np.rint(np.asarray(x, dtype=np.float64) * scale)
    if not np.all(np.isfinite(q)):
        raise ValueError("non-finite value in encode_fixed")
    if q.size and (q.max() >= 2.0**63 or q.min() < -(2.0**63)):  # exactly the int64 range
        raise WrapError(f"|x * scale| up to {np.abs(q).max():.4g} does not fit 64 signed bits")
    return to_ring64(q.astype(np.int64))


def decode_fixed(total: np.ndarray, scale: float) -> np.ndarray:
    """Words ``[...]`` (an encoded value or the sum of several) -> float64 ``[...]``: signed value / scale."""
    return from_ring64(total).astype(np.float64) / scale


def required_bits(max_abs_sum: float) -> int:
    """Bits ``b`` such that every integer sum with ``|sum| <= max_abs_sum`` lies in ``[-2^(b-1), 2^(b-1))``:
    ``b = bit_length(ceil(max_abs_sum)) + 1`` (magnitude bits and a sign bit)."""
    if not (math.isfinite(max_abs_sum) and max_abs_sum >= 0):
        raise ValueError(f"max_abs_sum must be finite and >= 0, got {max_abs_sum!r}")
    return int(math.ceil(max_abs_sum)).bit_length() + 1


def check_fits_ring64(max_abs_sum: float, what: str = "the sum") -> int:
    """Raise :class:`WrapError` unless a sum with ``|sum| <= max_abs_sum`` fits Z_2^64 read as int64
    (``required_bits(max_abs_sum) <= 64``, i.e. ``ceil(max_abs_sum) <= 2^63 - 1``); return the bits it needs."""
    need = required_bits(max_abs_sum) if math.isfinite(max_abs_sum) else math.inf
    if need > RING_BITS:
        raise WrapError(f"{what}: |sum| up to {max_abs_sum:.4g} needs {need} bits > {RING_BITS} "
                        f"(Z_2^64 holds signed sums up to 2^63 - 1)")
    return int(need)
