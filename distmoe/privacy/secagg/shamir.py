"""Shamir secret sharing over the prime field GF(2^521 - 1).

Owns: splitting a 32-byte secret (a self-mask seed or an X25519 private key) into shares for holders
with x-coordinates ``holder_id + 1``, reconstruction by Lagrange interpolation at 0 from any ``t``
shares, and the fixed 66-byte share encoding.

Must not: use x = 0 (that share is the secret), draw coefficients from a non-cryptographic generator,
or accept a share outside the field. ``cryptography`` has no Shamir, and Flower's SecAgg+ uses
pycryptodome's GF(2^128) sharing inside a protocol we do not use (``docs/privacy.md`` §9), so this small
implementation lives here, next to the tests that check its threshold property.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

from distmoe.privacy.secagg.primitives import RandomBytes

PRIME = 2**521 - 1  # a Mersenne prime; every 32-byte secret is a field element
SHARE_BYTES = 66  # ceil(521 / 8)
SECRET_BYTES = 32


def holder_x(holder_id: int) -> int:
    return holder_id + 1


def random_element(rng: RandomBytes) -> int:
    """Uniform over [0, PRIME) by rejection (acceptance probability ~1 - 2^-521)."""
    while True:
        v = int.from_bytes(rng(SHARE_BYTES), "big") & PRIME  # keep 521 bits
        if v < PRIME:
            return v


def split(secret: bytes, xs: Sequence[int], t: int, rng: RandomBytes) -> dict[int, int]:
    """Shares ``{x: f(x)}`` of a random degree-(t-1) polynomial with ``f(0) = secret``."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"secret must be {SECRET_BYTES} bytes")
    return split_int(int.from_bytes(secret, "big"), xs, t, rng)


def split_int(secret: int, xs: Sequence[int], t: int, rng: RandomBytes) -> dict[int, int]:
    """Shares of a field element (the contributor bit of the consistency check: shares are linear, so
    summing each holder's shares of several secrets gives its share of their sum)."""
    if not 0 <= secret < PRIME:
        raise ValueError("secret outside the field")
    if not 1 <= t <= len(xs):
        raise ValueError(f"threshold {t} must be in [1, {len(xs)}]")
    if len(set(xs)) != len(xs) or any(not 0 < x < PRIME for x in xs):
        raise ValueError("x-coordinates must be distinct and in (0, PRIME)")
    coeffs = [secret] + [random_element(rng) for _ in range(t - 1)]
    out = {}
    for x in xs:
        acc = 0
        for c in reversed(coeffs):  # Horner
            acc = (acc * x + c) % PRIME
        out[x] = acc
    return out


@lru_cache(maxsize=64)
def _lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    """l_i(0) = prod_{j != i} x_j / (x_j - x_i) mod PRIME, for each x_i in xs."""
    coeffs = []
    for i, xi in enumerate(xs):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        coeffs.append(num * pow(den, -1, PRIME) % PRIME)
    return tuple(coeffs)


def reconstruct_int(shares: Mapping[int, int], t: int) -> int:
    """f(0) from the ``t`` shares with the smallest x (the others are ignored)."""
    if len(shares) < t:
        raise ValueError(f"{len(shares)} shares, need {t}")
    xs = tuple(sorted(shares)[:t])
    lam = _lagrange_at_zero(xs)
    return sum(shares[x] * li for x, li in zip(xs, lam, strict=True)) % PRIME


def reconstruct(shares: Mapping[int, int], t: int) -> bytes | None:
    """The 32-byte secret, or None when the interpolated value is not a 32-byte secret (too few or
    corrupt shares typically give a value of ~521 bits)."""
    v = reconstruct_int(shares, t)
    return v.to_bytes(SECRET_BYTES, "big") if v < 2 ** (8 * SECRET_BYTES) else None


def encode_share(y: int) -> bytes:
    return y.to_bytes(SHARE_BYTES, "big")


def decode_share(b: bytes) -> int:
    if len(b) != SHARE_BYTES:
        raise ValueError(f"share must be {SHARE_BYTES} bytes, got {len(b)}")
    y = int.from_bytes(b, "big")
    if y >= PRIME:
        raise ValueError("share outside the field")
    return y


def interpolate(points: Iterable[tuple[int, int]], x: int) -> int:
    """Value at ``x`` of the polynomial through ``points`` (degree len(points) - 1); tests use it to
    show that t-1 shares fit every candidate secret."""
    pts = list(points)
    total = 0
    for i, (xi, yi) in enumerate(pts):
        num, den = 1, 1
        for j, (xj, _) in enumerate(pts):
            if j != i:
                num = num * (x - xj) % PRIME
                den = den * (xi - xj) % PRIME
        total = (total + yi * num * pow(den, -1, PRIME)) % PRIME
    return total
