"""Checks that a party's masks are masks: a known-answer test of the PRG and a uniformity statistic of
every masked input it sends.

Owns: ``prg_known_answer()`` (expands fixed keys with ``primitives.prg`` and ``primitives.derive_key`` and
compares the bytes with outputs pinned here, computed once from the real AES-256-CTR implementation: a PRG
that was patched, stubbed or broken returns ``False``) and the mask statistic of a masked input
(``mask_statistic(y)`` -> the facts a party records in its ledger ``out`` entry, ``mask_check_failure(facts)``
-> why they fail, or ``None``; the audit recomputes the verdict from the recorded counts).

The statistic (the "sign run"): a fixed-point plaintext word in Z_2^64 (``distmoe.privacy.ring.encode_fixed``
of a bounded value) is sign-extended, so its leading bits all equal its sign bit; a uniform word's run of
bits equal to the top bit is geometric. For each ``[n]`` uint64 word let ``g`` be the number of bits after
the top bit that equal it (0..63; for the uint32 words of a 32-bit release, 0..31 in their own width); for
uniform words ``g`` is Geometric(1/2) on {0, 1, ...} (capped at 63 or 31, which only makes it smaller),
so ``S = sum g`` is at most NegativeBinomial(n, 1/2) in distribution. The
input fails when ``P(NB(n, 1/2) >= S) < ALPHA = 2^-40`` (about 9.1e-13): a genuinely masked vector fails
with probability below ``ALPHA`` whatever its length. A plaintext-like vector (zero masks) has ``g >= 20``
on nearly every word (values below 2^43 in magnitude) and fails from two such words on (``p ~ 2^-37`` for
two words at g = 20 is the weakest case; three words give ``p < 2^-50``).

What it does not catch: a PRG that is deterministic but uniform-looking (a keyed stream whose key the
server knows) passes both checks; only the code the party runs can rule that out (``docs/privacy.md``).

Must not: import ``flwr``, do I/O, or look at anything but the vector it is given.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats as _st

from distmoe.privacy.secagg import primitives as P

ALPHA_LOG2 = -40  # the per-vector false-alarm level of the statistic: 2^-40
TEST = "sign-run"
LOG2_P_FLOOR = -1e6  # p-values below 2^-1e6 are recorded as that (JSON has no -inf)
# Known answers, computed once from the real implementation (cryptography's AES-256-CTR, HKDF-SHA256; protocol v2).
KAT_KEY = bytes(range(32))
KAT_PRG64 = "f29000b62a499fd0a9f39a6add2e7780f05d76ae4ab99fe5a6f69b3148c2363d"  # prg(KAT_KEY, 4, 64), AES-256-CTR
KAT_PRG20 = "f29000002a490f00a9f30a00dd2e0700"  # prg(KAT_KEY, 4, 20): uint32 words masked to 20 bits
KAT_DERIVED = "21d18c3e382206fa897b2a6624c389b639b2a36f63e9c54fe7642c91b5734611"  # derive_key(KAT_KEY, b"distmoe-kat")


def _kat_values() -> tuple[str, str, str, str, str]:
    """The reference PRG, the in-place expansion the protocol actually masks with (``combine_masks``: a broken
    fast path must fail here too, not only ``prg``) and the key derivation."""
    fast64 = P.combine_masks(np.ones(4, np.uint64), [(KAT_KEY, 0)], 64)  # overwrite: the keystream itself
    fast20 = P.combine_masks(np.zeros(4, np.uint32), [(KAT_KEY, 1)], 20)  # add to zeros, masked to 20 bits
    return (P.prg(KAT_KEY, 4, 64).astype("<u8").tobytes().hex(), P.prg(KAT_KEY, 4, 20).astype("<u4").tobytes().hex(),
            fast64.astype("<u8").tobytes().hex(), fast20.astype("<u4").tobytes().hex(),
            P.derive_key(KAT_KEY, b"distmoe-kat").hex())


def prg_known_answer() -> str | None:
    """``None`` when the PRG and the key derivation give the pinned outputs, else why not (for the log)."""
    try:
        got = _kat_values()
    except Exception as exc:  # a broken PRG may raise anything
        return f"the PRG known-answer test raised {type(exc).__name__}"
    want = (KAT_PRG64, KAT_PRG20, KAT_PRG64, KAT_PRG20, KAT_DERIVED)
    names = ("prg-64", "prg-20", "masks-64", "masks-20", "derive-key")
    bad = [name for name, g, w in zip(names, got, want, strict=True) if g != w]
    return f"the PRG known-answer test failed ({', '.join(bad)})" if bad else None


SIGN_RUN_CHUNK = 1 << 18  # words per pass: the chunk's temporaries stay in L2 (60x faster than whole-vector passes)


def _bit_lengths(v: np.ndarray) -> np.ndarray:
    """``[c]`` bit lengths of ``[c]`` uint32 words: the exponent of their exact float64 value (0 for 0)."""
    return np.frexp(v.astype(np.float64))[1]


def sign_run(y: np.ndarray) -> int:
    """``S``: over the ``[n]`` words of ``y`` (uint32 words of a 32-bit ring in their own width, anything else
    as uint64), the bits after the top bit that equal it, summed (0..31 or 0..63 per word).

    Per word: flip a negative word's bits (top bit 0 after it: its leading zeros are the run), then
    ``g = top - bit_length``; bit lengths are exact float64 exponents of 32-bit halves (a uint64 word is split
    into its high and low halves, since float64 rounds above 2^53). Chunked so that a 7M-word update costs
    about 10 ms instead of 0.6 s (``tests/privacy/secagg/test_selftest.py`` pins it to the bit-by-bit definition)."""
    a = np.asarray(y).ravel()
    if a.dtype == np.uint32:
        return _sign_run32(a)
    a = a.astype(np.uint64, copy=False)
    top = 63
    dt = a.dtype.type
    total = 0
    for lo in range(0, a.size, SIGN_RUN_CHUNK):
        c = a[lo:lo + SIGN_RUN_CHUNK]  # [c]
        v = c ^ (dt(0) - (c >> dt(top)))  # [c] negative words flipped: top bit 0
        hi = (v >> dt(32)).astype(np.uint32)  # [c]
        bl = np.where(hi > 0, _bit_lengths(hi) + 32, _bit_lengths(v.astype(np.uint32)))  # low half when hi = 0
        total += c.size * top - int(bl.sum(dtype=np.int64))
    return total


def _sign_run32(a: np.ndarray) -> int:
    """:func:`sign_run` of ``[n]`` uint32 words (the SFT update's ring) through two reused L2-sized scratch
    buffers: the flipped word ``v`` is widened to float64 (exact), whose biased exponent field is
    ``bit_length(v) + 1022`` for ``v > 0`` and 0 for ``v = 0``; so the chunk's bit lengths sum to the exponent
    fields' sum minus 1022 per non-zero word. No ``frexp`` (its mantissa output is a wasted pass): ~6 ms for
    7.1M words."""
    total = 0
    n = min(a.size, SIGN_RUN_CHUNK)
    flipped = np.empty(n, np.uint32)  # [chunk]
    wide = np.empty(n, np.float64)  # [chunk]
    for lo in range(0, a.size, SIGN_RUN_CHUNK):
        c = a[lo:lo + SIGN_RUN_CHUNK]  # [c]
        k = c.size
        v, f = flipped[:k], wide[:k]
        np.right_shift(c, np.uint32(31), out=v)  # the top bit
        np.subtract(np.uint32(0), v, out=v)  # all ones for a negative word, else 0
        np.bitwise_xor(c, v, out=v)  # negative words flipped: top bit 0
        np.copyto(f, v, casting="unsafe")
        e = f.view(np.uint64)
        np.right_shift(e, np.uint64(52), out=e)  # the biased exponent (sign bit 0)
        total += k * 31 - (int(e.sum(dtype=np.uint64)) - 1022 * int(np.count_nonzero(v)))
    return total


def log2_p(words: int, s: int) -> float:
    """``log2 P(NB(words, 1/2) >= s)``: the statistic's p-value (0 for an empty vector)."""
    if words <= 0 or s <= 0:
        return 0.0
    return max(float(_st.nbinom.logsf(s - 1, words, 0.5)) / math.log(2), LOG2_P_FLOOR)


def mask_statistic(y: np.ndarray) -> dict:
    """The facts a party records for one masked input ``y`` (``[n]`` uint32 or uint64)."""
    n = int(np.asarray(y).size)
    s = sign_run(y)
    return {"test": TEST, "words": n, "sign_run": s, "log2_p": round(log2_p(n, s), 3), "alpha_log2": ALPHA_LOG2}


def mask_check_failure(facts: object) -> str | None:
    """Why recorded facts fail (recomputed from ``words`` and ``sign_run``), or ``None`` when they pass."""
    if not isinstance(facts, dict) or facts.get("test") != TEST:
        return "no mask statistic recorded"
    n, s = facts.get("words"), facts.get("sign_run")
    if not (isinstance(n, int) and isinstance(s, int) and n >= 0 and 0 <= s <= 63 * n):
        return f"mask statistic malformed (words {n!r}, sign_run {s!r})"
    lp = log2_p(n, s)
    if lp < ALPHA_LOG2:
        return (f"masked input of {n} words has sign run {s} (expected about {n} for uniform words): "
                f"p = 2^{lp:.1f} < 2^{ALPHA_LOG2}; its masks are not uniform (zero or broken PRG)")
    return None
