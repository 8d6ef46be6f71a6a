"""Fixed-point encoding of real vectors into Z_{2^bits} and the no-wrap check.

Owns: ``encode_fixed`` (round(x * scale), two's complement, no offset, so negative values and sums of
any sign work), ``decode_sum`` (the signed reading of a sum), ``required_bits`` and ``check_no_wrap``
(the bit width at which a sum of n bounded contributions cannot wrap).

Must not: clip silently (an out-of-range value raises), or add noise (DP noise is the DP module's job;
the caller adds its bound to ``max_abs_per_client``). Flower's SecAgg+ quantiser clips every
coordinate to +-8 and wraps silently when the sum overflows (``docs/privacy.md`` §9); here the bound is
checked before anything is sent.
"""

from __future__ import annotations

import math

import numpy as np

from distmoe.privacy.secagg.errors import WrapAroundError
from distmoe.privacy.secagg.primitives import ring_mask, word_dtype


def to_ring(q: np.ndarray, bits: int) -> np.ndarray:
    """Signed integers ``[...]`` -> their residues mod 2^bits in the word dtype ``[...]``."""
    q = np.asarray(q)
    if not np.issubdtype(q.dtype, np.integer):
        raise TypeError(f"integer array required, got {q.dtype}")
    return (q.astype(np.int64).astype(np.uint64) & np.uint64(ring_mask(bits))).astype(word_dtype(bits))


def to_signed(y: np.ndarray, bits: int) -> np.ndarray:
    """Residues mod 2^bits ``[...]`` -> int64 in [-2^(bits-1), 2^(bits-1)) ``[...]``."""
    v = np.asarray(y).astype(np.uint64) & np.uint64(ring_mask(bits))
    if bits == 64:
        return v.view(np.int64)
    s = v.astype(np.int64)
    return np.where(s >= (1 << (bits - 1)), s - (1 << bits), s)


def encode_fixed(x: np.ndarray, scale: float, bits: int) -> np.ndarray:
    """``[...]`` reals -> ``[...]`` words: round(x * scale) mod 2^bits (two's complement)."""
    q = np.rint(np.asarray(x, dtype=np.float64) * scale)
    if not np.all(np.isfinite(q)):
        raise ValueError("non-finite value in encode_fixed")
    half = 2.0 ** (bits - 1)
    if q.size and (q.max() >= half or q.min() < -half):
        raise WrapAroundError(f"|x * scale| up to {np.abs(q).max():.0f} does not fit {bits} signed bits")
    return to_ring(q.astype(np.int64), bits)


def decode_sum(y: np.ndarray, scale: float, bits: int, n: int, *, max_abs_per_client: float | None = None
               ) -> np.ndarray:
    """``[...]`` words (a sum of ``n`` encoded vectors) -> ``[...]`` float64 sum of the reals.

    The rounding error is at most ``n / (2 * scale)`` per coordinate. With ``max_abs_per_client`` the
    bit width is checked first, so a sum that could have wrapped raises instead of decoding garbage.
    """
    if n < 1:
        raise ValueError("a sum needs at least one summand")
    if max_abs_per_client is not None:
        check_no_wrap(max_abs_per_client, n, scale, bits)
    return to_signed(y, bits).astype(np.float64) / scale


def required_bits(max_abs_per_client: float, n_clients: int, scale: float) -> int:
    """Smallest b such that any sum of ``n_clients`` values round(x * scale), |x| <= max_abs, lies in
    the signed range [-2^(b-1), 2^(b-1) - 1]."""
    if max_abs_per_client < 0 or n_clients < 1 or scale <= 0:
        raise ValueError("max_abs_per_client >= 0, n_clients >= 1 and scale > 0 required")
    bound = n_clients * math.ceil(max_abs_per_client * scale)  # |sum| <= bound
    b = bound.bit_length() + 1
    if b > 64:
        raise WrapAroundError(f"a bound of {bound} needs {b} bits, more than 64")
    return b


def check_no_wrap(max_abs_per_client: float, n_clients: int, scale: float, bits: int) -> None:
    need = required_bits(max_abs_per_client, n_clients, scale)
    if need > bits:
        raise WrapAroundError(f"a sum of {n_clients} clients with |x| <= {max_abs_per_client} at scale {scale} "
                              f"needs {need} bits, the ring has {bits}: it could wrap")
