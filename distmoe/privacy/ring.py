"""The one fixed-point ring codec: reals and integers into Z_2^32 or Z_2^64, and the one no-wrap check.

Every secure sum of distmoe lives in Z_2^b with ``b`` in ``RING_WIDTHS = (32, 64)``, declared per release
(``UpdateLayout.bits``; router statistics and evaluation sums use 64): each party sends ``b``-bit words,
the SecAgg server adds them modulo 2^b, and the sum is read back as a signed ``b``-bit integer. Encoding a
real ``x`` at scale ``s`` is ``q = rint(s * x)`` (or, with a generator, the unbiased stochastic rounding
``q = floor(s * x + U)``, ``U ~ Uniform[0, 1)``, so ``E[q] = s * x`` and ``|q - s * x| < 1``), sent as its
two's-complement word ``q mod 2^b`` (:func:`encode_fixed`, :func:`to_ring`); the modular sum of the words,
read as a signed integer (:func:`from_ring`), is exactly ``sum_i q_i`` as long as that sum lies in the
signed range of ``b`` bits. Negative values and sums of any sign need no offset.

Bit budget (one rule for every caller): if ``|sum_i q_i| <= B`` then the sum needs
``required_bits(B) = bit_length(ceil(B)) + 1`` bits (magnitude bits plus a sign bit), and it cannot wrap
in Z_2^b iff ``required_bits(B) <= b``, i.e. ``ceil(B) <= 2^(b-1) - 1``. The sum is reduced modulo 2^b
after every addition, so no intermediate needs more headroom than the final sum. Callers compute ``B``
from public bounds (parties x largest contribution, plus a noise tail for DP shares) and call
:func:`check_fits_ring` (``check_fits_ring64`` for 64 bits) before anything is sent; :func:`choose_bits`
picks the narrowest width that passes it.

Users: ``distmoe.privacy.dp`` (Skellam shares: the data bound plus the noise tail),
``distmoe.privacy.vectors`` (the fixed-point layouts of updates, statistics and evaluation numbers) and
the SecAgg protocol, whose inputs and sums are these words.

Must not: clip or wrap silently (an input that does not fit raises :class:`WrapError`), add noise, or
import anything of distmoe.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

__all__ = ["RING_BITS", "RING_WIDTHS", "WrapError", "check_fits_ring", "check_fits_ring64", "choose_bits",
           "decode_fixed", "encode_fixed", "encode_fixed_into", "from_ring", "from_ring64", "required_bits", "to_ring",
           "to_ring64", "UniformSource"]

RING_BITS = 64  # the widest ring (statistics and evaluation sums; updates whose bound needs it)
RING_WIDTHS = (32, 64)  # the word sizes a release may declare
MAX_ABS = 2**63 - 1  # the largest |sum| that fits 64 bits: 63 magnitude bits and a sign
_UNSIGNED = {32: np.uint32, 64: np.uint64}
_CHUNK = 1 << 15  # elements per encoding chunk (256 KiB of float64 scratch)
_SIGNED = {32: np.int32, 64: np.int64}


class UniformSource(Protocol):
    """What stochastic rounding draws from: a numpy Generator, or ``distmoe.privacy.dp.KeystreamUniform``."""

    def random(self, size: int | None = None, dtype=np.float64, out: np.ndarray | None = None) -> np.ndarray: ...


class WrapError(ValueError):
    """A value or a sum could leave the signed range of the ring (it would wrap silently)."""


def _check_width(bits: int) -> int:
    if bits not in RING_WIDTHS:
        raise ValueError(f"ring width must be one of {RING_WIDTHS}, got {bits!r}")
    return int(bits)


def to_ring(q: np.ndarray, bits: int = 64) -> np.ndarray:
    """Signed integers ``[...]`` (within ``bits`` signed bits) -> their two's-complement words in Z_2^bits
    ``[...]`` (uint32/uint64, same bits). Raises :class:`WrapError` for a value outside the signed range."""
    a = np.asarray(q)
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"integer array required, got {a.dtype}")
    sdt = _SIGNED[_check_width(bits)]
    if a.dtype.itemsize * 8 > bits and a.size:
        info = np.iinfo(sdt)
        if int(a.max()) > info.max or int(a.min()) < info.min:
            raise WrapError(f"integers up to {max(abs(int(a.max())), abs(int(a.min())))} do not fit {bits} signed bits")
    return np.ascontiguousarray(a.astype(sdt, copy=False)).view(_UNSIGNED[bits])


def from_ring(v: np.ndarray) -> np.ndarray:
    """Words of Z_2^32 (uint32) or Z_2^64 (uint64) ``[...]`` -> signed integers of the same width ``[...]``."""
    a = np.asarray(v)
    if a.dtype == np.uint32:
        return np.ascontiguousarray(a).view(np.int32)
    if a.dtype == np.uint64:
        return np.ascontiguousarray(a).view(np.int64)
    raise TypeError(f"ring words must be uint32 or uint64, got {a.dtype}")


def to_ring64(q: np.ndarray) -> np.ndarray:
    """Signed int64 ``[...]`` -> its two's-complement words in Z_2^64 ``[...]`` (uint64, same bits)."""
    a = np.asarray(q)
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"integer array required, got {a.dtype}")
    return np.ascontiguousarray(a.astype(np.int64, copy=False)).view(np.uint64)


def from_ring64(v: np.ndarray) -> np.ndarray:
    """Words of Z_2^64 ``[...]`` (uint64) -> signed int64 in [-2^63, 2^63) ``[...]``."""
    return np.ascontiguousarray(np.asarray(v, np.uint64)).view(np.int64)


def encode_fixed(x: np.ndarray, scale: float, bits: int = 64, rng: UniformSource | None = None) -> np.ndarray:
    """Reals ``[...]`` -> words ``[...]`` of Z_2^bits: ``rint(x * scale)``, or with ``rng`` the stochastic rounding
    ``floor(x * scale + U)``, ``U ~ Uniform[0, 1)`` (unbiased: ``E[q] = x * scale``), in two's complement.

    Raises ``ValueError`` for a non-finite value and :class:`WrapError` for one outside the signed ``bits``
    range. The round-trip error is at most ``1 / (2 * scale)`` per coordinate (``rint``) or below
    ``1 / scale`` with zero mean (stochastic).
    """
    _check_width(bits)
    src = np.asarray(x)
    shape = src.shape
    src = np.ascontiguousarray(src).reshape(-1)  # [N] (a view when already contiguous)
    out = np.empty(src.size, _UNSIGNED[bits])  # [N]
    encode_fixed_into(src, scale, out, rng)
    return out.reshape(shape)


def encode_fixed_into(x: np.ndarray, scale: float, out: np.ndarray, rng: UniformSource | None = None, *,
                      pre: float = 1.0, buf: np.ndarray | None = None, bound: float | None = None) -> np.ndarray:
    """:func:`encode_fixed` of ``pre * x`` written into ``out`` (``[N]`` uint32 or uint64 words, its width is the
    ring's): one read of ``x`` (any real dtype, ``[N]`` contiguous) and one write of the words, chunk by chunk
    through ``buf`` (float64 scratch of at least one chunk, allocated when not given). The arithmetic is
    ``(float64(x) * pre) * scale`` then rounding, exactly as scaling a float64 copy first would give; the
    stochastic draws are consumed in element order (one ``rng.random`` double per element; ``rng`` is any
    :class:`UniformSource`), so splitting a vector into consecutive pieces encodes it to the same words as one
    call. ``bound``: a caller's proof that ``|pre * x| <= bound`` elementwise and every value is finite (e.g. a
    finite L2 norm of the clipped vector); when ``bound * scale + 1`` fits the signed range, the per-chunk range
    check is skipped (it cannot fail)."""
    bits = {np.dtype(np.uint32): 32, np.dtype(np.uint64): 64}.get(out.dtype)
    if bits is None:
        raise TypeError(f"ring words must be uint32 or uint64, got {out.dtype}")
    src = np.asarray(x).reshape(-1)
    if out.shape != src.shape:
        raise ValueError(f"output of shape {out.shape} for {src.shape} values")
    dst = out.view(_SIGNED[bits])  # [N] the signed view of the same words
    if buf is None or buf.size < min(src.size, _CHUNK):
        buf = np.empty(min(src.size, _CHUNK), np.float64)  # [chunk] scratch, cache-resident
    lim = 2.0 ** (bits - 1)
    proven = bound is not None and math.isfinite(bound) and bound * scale + 1.0 < lim
    draws = np.empty(min(src.size, _CHUNK), np.float64) if rng is not None else None  # [chunk] reused U draws
    for a in range(0, src.size, _CHUNK):
        b = min(a + _CHUNK, src.size)
        y = buf[:b - a]
        if pre != 1.0:
            np.copyto(y, src[a:b], casting="unsafe")  # exact for float32/float64 inputs
            np.multiply(y, pre, out=y)
            np.multiply(y, scale, out=y)
        else:  # the float64 loop on the (exactly) widened input: the same product as copying first
            np.multiply(src[a:b], scale, out=y, dtype=np.float64, casting="unsafe")
        if rng is None:
            np.rint(y, out=y)
        else:
            u = draws[:b - a]
            rng.random(out=u)  # the same stream, in the same order, as rng.random(b - a)
            np.floor(np.add(y, u, out=y), out=y)
        if not proven:
            lo, hi = float(y.min()), float(y.max())
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise ValueError("non-finite value in encode_fixed")
            if hi >= lim or lo < -lim:  # exactly the signed range
                raise WrapError(f"|x * scale| up to {max(abs(lo), abs(hi)):.4g} does not fit {bits} signed bits")
        np.copyto(dst[a:b], y, casting="unsafe")
    return out


def decode_fixed(total: np.ndarray, scale: float) -> np.ndarray:
    """Words ``[...]`` (uint32 or uint64: an encoded value or the sum of several) -> float64 ``[...]``: signed
    value / scale, in the width of the words."""
    return from_ring(total).astype(np.float64) / scale


def required_bits(max_abs_sum: float) -> int:
    """Bits ``b`` such that every integer sum with ``|sum| <= max_abs_sum`` lies in ``[-2^(b-1), 2^(b-1))``:
    ``b = bit_length(ceil(max_abs_sum)) + 1`` (magnitude bits and a sign bit)."""
    if not (math.isfinite(max_abs_sum) and max_abs_sum >= 0):
        raise ValueError(f"max_abs_sum must be finite and >= 0, got {max_abs_sum!r}")
    return int(math.ceil(max_abs_sum)).bit_length() + 1


def check_fits_ring(max_abs_sum: float, bits: int, what: str = "the sum") -> int:
    """Raise :class:`WrapError` unless a sum with ``|sum| <= max_abs_sum`` fits Z_2^bits read as a signed
    integer (``required_bits(max_abs_sum) <= bits``, i.e. ``ceil(max_abs_sum) <= 2^(bits-1) - 1``); return the
    bits it needs."""
    _check_width(bits)
    need = required_bits(max_abs_sum) if math.isfinite(max_abs_sum) else math.inf
    if need > bits:
        raise WrapError(f"{what}: |sum| up to {max_abs_sum:.4g} needs {need} bits > {bits} "
                        f"(Z_2^{bits} holds signed sums up to 2^{bits - 1} - 1)")
    return int(need)


def check_fits_ring64(max_abs_sum: float, what: str = "the sum") -> int:
    """:func:`check_fits_ring` at 64 bits (the ring of statistics and evaluation sums)."""
    return check_fits_ring(max_abs_sum, 64, what)


def choose_bits(max_abs_sum: float, what: str = "the sum") -> int:
    """The narrowest width of ``RING_WIDTHS`` the bound passes :func:`check_fits_ring` in (else its WrapError)."""
    for bits in RING_WIDTHS[:-1]:
        if math.isfinite(max_abs_sum) and required_bits(max_abs_sum) <= bits:
            return bits
    check_fits_ring(max_abs_sum, RING_WIDTHS[-1], what)
    return RING_WIDTHS[-1]
