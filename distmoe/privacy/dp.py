"""Distributed DP for router statistics: integer encoding, Skellam noise shares, canaries, no-wrap bit widths.

Guarantee and unit of privacy. The unit is **one sequence** of a party's data, add/remove neighbours,
against the server and all other parties. A sequence contributes its per-layer mean router distribution
``m_x`` (``[L, E]``, every row on the simplex, see ``distmoe.routing.stats``). Since a row ``p`` has
``||p||_2 <= ||p||_1 = 1``, the L2 sensitivity of the summed statistic is ``sqrt(L)`` with no clipping
(:func:`l2_sensitivity`). No count is released: every row of the sum equals the number of sequences, so
the count and the anchor are post-processing of the noisy rows.

Mechanism (Agarwal, Kairouz, Liu, "The Skellam Mechanism for Differentially Private Federated Learning", NeurIPS
2021, https://arxiv.org/abs/2110.04995), per party:

1. encode as integers with scale ``s >= 32``: per sequence, each row rounded so that it stays on the scaled
   simplex (``mass-preserving``: floor, then the largest remainders get the missing units, so every row sums to
   exactly ``s``; the default), per sequence ``rint(s * m_x)`` (``per-sequence``), or ``rint(s * S)`` of the
   float sum (``sum``, :func:`encode_stats`);
2. integer sensitivity after rounding (:func:`int_sensitivity`): ``D2 = s*sqrt(L)`` mass-preserving (an integer
   row with non-negative entries summing to ``s`` has L2 norm <= s), ``s*sqrt(L) + sqrt(L*E)/2`` per-sequence
   (each coordinate's rounding error is <= 1/2), ``s*sqrt(L) + sqrt(L*E)`` for a rounded sum (two roundings).
   Mass-preserving rounding also makes every row of the sum equal ``N*s`` plus noise exactly, which the
   audit's row-sum test relies on;
3. target noise in the *sum*: ``sigma_int = z * D2`` with ``z`` the noise multiplier the accountant takes;
   aggregate Skellam variance ``mu = sigma_int**2``;
4. each of ``n`` parties adds ``Poisson(lam) - Poisson(lam)`` per coordinate with ``lam = mu / (2 (n - d_max))``
   (variance ``2 lam``). Poissons are closed under summation, so the sum over ``n - d_max`` parties is exactly
   ``Poisson(mu/2) - Poisson(mu/2)`` = Skellam with variance ``mu``. ``d_max > 0`` over-provisions for dropouts;
5. add ``K`` known-zero noise-canary coordinates (noised like the rest): their aggregate is pure noise, which
   the audit tests with :func:`canary_chi2_test` (a missing noise share shows as too little variance). Their
   positions among the ``L*E + K`` coordinates are drawn per release (:func:`canary_positions`) from a seed
   that hashes every survivor's fresh per-round SecAgg mask key (:func:`canary_seed`); the statistic's own
   noise is tested through its row sums (:func:`row_noise_test`, below);
6. sum modulo ``2**64`` in secure aggregation (``distmoe.privacy.ring``); :func:`required_bits` counts the bits
   the true sum plus a Chernoff tail bound of the Skellam noise needs, and
   :meth:`SkellamSpec.check_fits_ring64` raises unless that is at most 64 (63 magnitude bits and a sign).

Dropouts and colluders remove their noise share: with ``n_active`` survivors the sum carries
``n_active * 2 lam`` variance, i.e. ``z_eff = z * sqrt(n_active / (n - d_max))``
(:meth:`SkellamSpec.effective_noise_multiplier`); account every release with the survivors' ``z_eff``.
The accountant treats the Skellam release as a Gaussian with that ``z`` (see ``distmoe.privacy.accountant``).

In shapes, for one party with sequence means ``m: [N_seq, L, E]`` (rows on the simplex), ``K`` canaries, ``n``
parties, ``t = n - d_max`` (mass-preserving rounding)::

    c      = sum_x round_s(m_x)                                   [L, E]   integers, every row sums to N_seq * s
    D2     = s * sqrt(L),  D1 = s * L                             []
    share  = concat(flatten(c), zeros(K)) + Sk(sigma_int^2 / t)    [L*E + K]   Sk(v) = Poisson(v/2) - Poisson(v/2)
    vector = share, canaries moved to canary_positions(seed)      [L*E + K]   (``StatsLayout``)
    sum    = sum over n_active survivors of share                 [L*E + K]   noise variance n_active * sigma_int^2 / t
    z_eff  = z * sqrt(n_active / t)                               []

Noise source: a ``numpy`` Generator (PCG64DXSM) seeded with 256 bits from ``secrets`` (OS CSPRNG). PCG64 is not
itself a CSPRNG; the seed cannot be guessed and single noise draws are never observed (they are inside masked
sums), which is the threat model here. numpy's Poisson sampler is floating-point based, so its law is exact only
up to float rounding (no low-bit attack applies: outputs are integers).

Row-sum noise test (the statistic's own noise, not only the canaries'). With mass-preserving rounding every row
of the sum is ``N*s + sum_e noise[l, e]`` and ``N`` is common to all layers of one release, so the row sums
``R_l`` differ only by noise: ``R_l - mean(R)`` is pure noise of variance ``tau^2 = E * sigma_int^2`` per row (a
sum of ``E`` independent Skellams is Skellam, ~ N(0, tau^2), excess kurtosis ``1/tau^2``). Pooled over the
releases ``r`` of a run: ``T = sum_r sum_l (R_rl - mean_r)^2 / tau_r^2 ~ chi2(D)``, ``D = sum_r (L_r - 1)``.
Too little dispersion means noise missing from the statistic (e.g. a party that put its share on the canaries
only: with all parties doing so every row is exactly ``N*s``, ``T = 0``). Row sums are integers: a discrete
``R`` is within 1/2 per row of a continuous Gaussian ``Y``, so ``sqrt(T(Y)) <= sqrt(T(R)) + c`` with
``c^2 = sum_r L_r / (4 tau_r^2)`` and the p-value ``P[chi2_D <= (sqrt(T) + c)^2]`` is conservative (exact
equalities of all rows, ``T = 0``, fail only where that lattice bound is below the level). One of ``n_active``
parties cheating scales the row-noise variance by ``rho = (n_active - 1) / n_active``: detection probability
:func:`row_noise_power`.

Owns: the encoding, the noise calibration (``SkellamSpec``), share generation, decoding, the canary test, the
canary positions, the row-sum noise test and the data-plus-noise bound of the bit-width check (the ring and its
no-wrap rule are ``distmoe.privacy.ring``).
Must not: import ``flwr`` or ``torch``, perform secure aggregation (``distmoe.privacy`` secagg does), account
epsilon (the accountant does), or send anything.

Why hand-written: opacus only implements central/per-sample Gaussian DP-SGD; it has no integer, distributed
(Skellam or discrete-Gaussian) mechanism. TFF's ``DistributedDpSumFactory`` has one but needs TensorFlow and
its own SecAgg runtime; Flower has no distributed-DP mod. The mechanism itself is ~40 lines of numpy.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from scipy import stats as _st

from distmoe.privacy import ring

__all__ = [
    "CanaryTest",
    "KeystreamUniform",
    "RowNoiseTest",
    "SkellamSpec",
    "WrapError",
    "canary_chi2_test",
    "canary_positions",
    "canary_seed",
    "client_share",
    "crypto_rng",
    "decode_stats",
    "encode_per_sequence",
    "encode_stats",
    "int_sensitivity",
    "l2_sensitivity",
    "pack",
    "positions_digest",
    "required_bits",
    "row_noise_power",
    "row_noise_test",
    "sequence_contribution_norm",
    "skellam_noise",
    "skellam_tail",
    "sum_bound",
]

MIN_SCALE = 32
ROUNDINGS = ("mass-preserving", "per-sequence", "sum")
WrapError = ring.WrapError  # the sum could wrap in Z_2^64


# ------------------------------------------------------------------------------------------ sensitivity
def l2_sensitivity(layers: int) -> float:
    """Add/remove L2 sensitivity of the float statistic: ``sqrt(L)`` (each row on the simplex, norm <= 1)."""
    return math.sqrt(layers)


def sequence_contribution_norm(per_seq: np.ndarray) -> np.ndarray:
    """Frobenius norm of each sequence's ``[L, E]`` contribution; ``per_seq`` is ``[..., L, E]``."""
    a = np.asarray(per_seq, dtype=np.float64)
    return np.sqrt((a * a).sum(axis=(-2, -1)))


def int_sensitivity(layers: int, experts: int, scale: float, rounding: str = "per-sequence") -> tuple[float, float]:
    """``(D2, D1)`` add/remove sensitivity in integer units after rounding.

    ``mass-preserving``: every rounded row is a non-negative integer vector summing to ``s``, so
    ``D2 <= s*sqrt(L)`` and ``D1 = s*L`` (no slack; ``s`` must be an integer).
    ``per-sequence``: ``rint(s*m_x)`` differs from ``s*m_x`` by <= 1/2 per coordinate, so
    ``D2 <= s*sqrt(L) + sqrt(L*E)/2`` and ``D1 <= s*L + L*E/2``. ``sum``: the rounded sum changes by at most
    ``|s*m_x| + 1`` per coordinate (two roundings), so ``D2 <= s*sqrt(L) + sqrt(L*E)``, ``D1 <= s*L + L*E``.
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    d = layers * experts
    if rounding == "mass-preserving":
        _check_integer_scale(scale)
        return scale * math.sqrt(layers), scale * layers
    slack = 0.5 if rounding == "per-sequence" else 1.0
    return scale * math.sqrt(layers) + slack * math.sqrt(d), scale * layers + slack * d


# -------------------------------------------------------------------------------------------- encoding
def _check_scale(scale: float) -> None:
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale >= MIN_SCALE):
        raise ValueError(f"scale must be a finite number >= {MIN_SCALE} (rounding inflates the sensitivity "
                         f"below that), got {scale!r}")


def _check_integer_scale(scale: float) -> None:
    if float(scale) != int(scale):
        raise ValueError(f"mass-preserving rounding needs an integer scale, got {scale!r}")


def encode_stats(stats: np.ndarray, scale: float) -> np.ndarray:
    """``rint(scale * stats)`` as int64 (``[L, E]``); round-trip error <= 0.5/scale per coordinate."""
    _check_scale(scale)
    a = np.asarray(stats, dtype=np.float64)
    if a.ndim != 2 or not np.isfinite(a).all():
        raise ValueError(f"stats must be a finite [L, E] array, got shape {a.shape}")
    return ring.from_ring64(ring.encode_fixed(a, scale))  # raises WrapError if it does not fit int64


def encode_per_sequence(per_seq: np.ndarray, scale: float, *, rounding: str = "per-sequence",
                        atol: float = 1e-4) -> np.ndarray:
    """Sum over sequences of each sequence's rounded ``s * m_x``: ``[N, L, E]`` simplex rows -> int64 ``[L, E]``.

    ``rounding``: ``per-sequence`` rounds each entry to the nearest integer; ``mass-preserving`` rounds each
    row down and gives the ``s - sum(floor)`` missing units to the entries with the largest remainders
    (ties to the lower expert index), so every rounded row has non-negative entries summing to exactly ``s``.
    Checks every row is on the simplex (entries >= -atol, sums within atol of 1): the sensitivity bound,
    hence the DP guarantee, depends on it, so anything else is refused.
    """
    _check_scale(scale)
    if rounding not in ("per-sequence", "mass-preserving"):
        raise ValueError(f"per-sequence encoding takes rounding 'per-sequence' or 'mass-preserving', got {rounding!r}")
    a = np.asarray(per_seq, dtype=np.float64)
    if a.ndim != 3 or not np.isfinite(a).all():
        raise ValueError(f"per_seq must be a finite [N, L, E] array, got shape {a.shape}")
    if a.size and (a.min() < -atol or np.abs(a.sum(-1) - 1.0).max() > atol):
        raise ValueError("per-sequence rows must lie on the simplex (non-negative, summing to 1)")
    if rounding == "per-sequence":
        return np.rint(a * scale).astype(np.int64).sum(0)
    _check_integer_scale(scale)
    s = int(scale)
    p = np.clip(a, 0.0, None)
    p = p / p.sum(-1, keepdims=True)  # exactly on the simplex (the check above bounds the correction)
    x = p * s  # [N, L, E]
    fl = np.floor(x)
    missing = s - fl.sum(-1, keepdims=True).astype(np.int64)  # [N, L, 1], in [0, E)
    order = np.argsort(-(x - fl), axis=-1, kind="stable")  # [N, L, E] experts by remainder, largest first
    rank = np.argsort(order, axis=-1)  # [N, L, E] each expert's position in that order
    ints = fl.astype(np.int64) + (rank < missing)  # [N, L, E], every row sums to s
    return ints.sum(0)


def decode_stats(int_stats: np.ndarray, scale: float) -> np.ndarray:
    """Inverse of :func:`encode_stats`: integers / scale as float64."""
    return np.asarray(int_stats, dtype=np.float64) / scale


# ----------------------------------------------------------------------------------------------- noise
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
    PCG64DXSM (issue 14: the stochastic rounding was the largest secure-only stage after the masks). The
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


def skellam_noise(shape: Any, variance: float, rng: np.random.Generator | None = None) -> np.ndarray:
    """int64 Skellam noise ``Poisson(v/2) - Poisson(v/2)``: mean 0, variance ``variance``."""
    if not (math.isfinite(variance) and variance >= 0):
        raise ValueError(f"variance must be finite and >= 0, got {variance!r}")
    g = rng if rng is not None else crypto_rng()
    lam = variance / 2.0
    return g.poisson(lam, shape).astype(np.int64) - g.poisson(lam, shape).astype(np.int64)


@dataclass(frozen=True)
class SkellamSpec:
    """Calibration of the distributed Skellam release of one ``[L, E]`` statistic (all values derived).

    ``noise_multiplier`` is ``z`` relative to the integer sensitivity ``D2`` (so it is the ``z`` the
    accountant takes); ``num_sequences_max`` bounds each party's sequences (it fixes the bit width);
    ``max_dropouts`` over-provisions each share so ``z`` still holds with that many parties missing.
    """

    layers: int
    experts: int
    noise_multiplier: float
    n_parties: int
    num_sequences_max: int
    scale: float = 64
    n_canaries: int = 0
    max_dropouts: int = 0
    rounding: str = "per-sequence"

    def __post_init__(self) -> None:
        _check_scale(self.scale)
        if self.layers < 1 or self.experts < 1:
            raise ValueError("layers and experts must be >= 1")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier > 0):
            raise ValueError(f"noise_multiplier must be > 0, got {self.noise_multiplier!r}")
        if self.n_parties < 1 or not 0 <= self.max_dropouts < self.n_parties:
            raise ValueError("need n_parties >= 1 and 0 <= max_dropouts < n_parties")
        if self.num_sequences_max < 1 or self.n_canaries < 0:
            raise ValueError("need num_sequences_max >= 1 and n_canaries >= 0")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        if self.rounding == "mass-preserving":
            _check_integer_scale(self.scale)

    @property
    def dim(self) -> int:
        return self.layers * self.experts

    @property
    def payload_len(self) -> int:
        """Length of one party's flat share: ``L*E`` statistic coordinates then ``K`` canaries."""
        return self.dim + self.n_canaries

    @property
    def delta2_int(self) -> float:
        return int_sensitivity(self.layers, self.experts, self.scale, self.rounding)[0]

    @property
    def delta1_int(self) -> float:
        return int_sensitivity(self.layers, self.experts, self.scale, self.rounding)[1]

    @property
    def sigma_int(self) -> float:
        """Target std of the aggregate noise in integer units: ``z * D2``."""
        return self.noise_multiplier * self.delta2_int

    @property
    def party_variance(self) -> float:
        """Variance of one party's share: ``sigma_int**2 / (n - d_max)``; Poisson rate is half of it."""
        return self.sigma_int**2 / (self.n_parties - self.max_dropouts)

    def aggregate_sigma(self, n_active: int | None = None) -> float:
        """Std of the noise actually in a sum over ``n_active`` parties (integer units)."""
        n = self.n_parties if n_active is None else n_active
        return math.sqrt(n * self.party_variance)

    def effective_noise_multiplier(self, n_active: int | None = None) -> float:
        """``z_eff = z * sqrt(n_active / (n - d_max))``: what the accountant must use for this release."""
        return self.aggregate_sigma(n_active) / self.delta2_int

    def sum_bound(self, **kw: Any) -> float:
        """:func:`sum_bound` for this spec (worst case: all parties present, all canaries)."""
        return sum_bound(self.n_parties, self.num_sequences_max, self.scale, self.aggregate_sigma(),
                         n_coords=self.payload_len, **kw)

    def required_bits(self, **kw: Any) -> int:
        """:func:`required_bits` for this spec (worst case: all parties present, all canaries)."""
        return ring.required_bits(self.sum_bound(**kw))

    def check_fits_ring64(self) -> None:
        """Raise :class:`WrapError` unless the signed sum fits Z_2^64 (``ring.check_fits_ring64``): all parties
        at ``num_sequences_max`` plus the noise tail (``required_bits <= 64``)."""
        ring.check_fits_ring64(self.sum_bound(), f"{self.n_parties} parties x {self.num_sequences_max} sequences "
                               f"at scale {self.scale:g} plus noise (sigma_int={self.aggregate_sigma():.1f})")

    def dp_params(self, n_active: int | None = None) -> dict[str, Any]:
        """JSON-able parameters for the wire ledger's ``dp`` field."""
        return {"mechanism": "skellam", "unit": "sequence", "neighbours": "add/remove",
                "noise_multiplier": self.noise_multiplier, "z_eff": self.effective_noise_multiplier(n_active),
                "scale": self.scale, "rounding": self.rounding, "delta2_int": self.delta2_int,
                "sigma_int": self.aggregate_sigma(n_active), "n_parties": self.n_parties,
                "n_active": self.n_parties if n_active is None else n_active, "max_dropouts": self.max_dropouts,
                "n_canaries": self.n_canaries, "num_sequences_max": self.num_sequences_max}


def pack(int_stats: np.ndarray, n_canaries: int) -> np.ndarray:
    """Flatten ``[L, E]`` integers and append ``n_canaries`` zeros (no noise: see :func:`client_share`)."""
    a = np.asarray(int_stats)
    if a.ndim != 2 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"int_stats must be an integer [L, E] array, got {a.dtype} {a.shape}")
    return np.concatenate([a.astype(np.int64).ravel(), np.zeros(n_canaries, np.int64)])


def client_share(int_stats: np.ndarray, spec: SkellamSpec, num_sequences: int,
                 rng: np.random.Generator | None = None) -> np.ndarray:
    """One party's noisy share: ``pack(int_stats) + Skellam(party_variance)`` on every coordinate.

    Refuses a party with more sequences than ``spec.num_sequences_max`` or entries outside the bound
    implied by it: either would void the no-wrap guarantee.
    """
    a = np.asarray(int_stats)
    if a.shape != (spec.layers, spec.experts):
        raise ValueError(f"int_stats shape {a.shape} != spec ({spec.layers}, {spec.experts})")
    if not 0 <= num_sequences <= spec.num_sequences_max:
        raise ValueError(f"party has {num_sequences} sequences, above num_sequences_max={spec.num_sequences_max}")
    if a.size and (a.min() < 0 or a.max() > num_sequences * (spec.scale + 0.5) + 1):
        raise ValueError("encoded statistics out of range for the number of sequences")
    flat = pack(a, spec.n_canaries)
    return flat + skellam_noise(flat.shape, spec.party_variance, rng)


# ------------------------------------------------------------------------------------------ bit widths
def _skellam_log_tail(mu: float, t: float) -> float:
    """Chernoff bound ``log P(X >= t)`` for X ~ Skellam of variance ``mu`` (log-MGF ``mu (cosh th - 1)``)."""
    if t <= 0:
        return 0.0
    if mu <= 0:
        return -math.inf
    r = t / mu
    return mu * (math.sqrt(1.0 + r * r) - 1.0) - t * math.asinh(r)


def skellam_tail(variance: float, n_coords: int = 1, fail_prob: float = 1e-12) -> float:
    """Smallest t with ``P(max over n_coords of |noise| >= t) <= fail_prob`` (Chernoff + union bound)."""
    if not 0 < fail_prob < 1:
        raise ValueError("fail_prob must be in (0, 1)")
    target = math.log(fail_prob / (2.0 * max(n_coords, 1)))
    if variance <= 0:
        return 0.0
    lo, hi = 0.0, max(1.0, math.sqrt(variance))
    while _skellam_log_tail(variance, hi) > target:
        hi *= 2.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _skellam_log_tail(variance, mid) > target else (lo, mid)
    return hi


def sum_bound(n_parties: int, num_sequences_max: int, scale: float, sigma_int: float,
              tail: float | None = None, *, n_coords: int = 1, fail_prob: float = 1e-12) -> float:
    """Bound ``B`` on ``|sum|`` per coordinate of the noisy integer sum: data plus noise.

    Data bound per coordinate: ``n_parties * num_sequences_max * (scale + 1/2)`` (a rounded simplex entry
    is <= scale + 1/2). Noise bound: ``tail * sigma_int`` if ``tail`` (in standard deviations) is given,
    else the Chernoff bound of a Skellam of variance ``sigma_int**2`` exceeded with probability
    <= ``fail_prob`` over ``n_coords`` coordinates. Pass the largest aggregate sigma (with over-provisioning,
    the one with every party present).
    """
    data = n_parties * num_sequences_max * (scale + 0.5)
    noise = tail * sigma_int if tail is not None else skellam_tail(sigma_int**2, n_coords, fail_prob)
    return data + noise


def required_bits(n_parties: int, num_sequences_max: int, scale: float, sigma_int: float,
                  tail: float | None = None, *, n_coords: int = 1, fail_prob: float = 1e-12) -> int:
    """Bits ``b`` such that the signed sum fits in ``[-2**(b-1), 2**(b-1))`` and therefore never wraps:
    ``ring.required_bits(sum_bound(...))`` (see :func:`sum_bound`); it fits Z_2^64 iff ``b <= 64``."""
    return ring.required_bits(sum_bound(n_parties, num_sequences_max, scale, sigma_int, tail, n_coords=n_coords,
                                        fail_prob=fail_prob))


# ----------------------------------------------------------------------------------------- canary test
@dataclass(frozen=True)
class CanaryTest:
    """Noise-presence test on K canaries: ``T = sum(c**2) / sigma**2`` against chi-square(K)."""

    statistic: float
    dof: int
    sigma_ratio: float  # sigma_hat / sigma
    p_low: float  # P[chi2_K <= T]: small when noise is missing
    p_high: float  # P[chi2_K >= T]
    alpha: float
    passed: bool


def canary_chi2_test(canaries: np.ndarray, sigma: float, alpha: float = 1e-3) -> CanaryTest:
    """Fail (``passed=False``) when the canaries carry significantly less noise than ``sigma``.

    Skellam(mu) is approximately N(0, mu) (excess kurtosis 1/mu), so ``T ~ chi2_K`` under the claim.
    One-sided: too little noise is a privacy failure, too much is not. Use ``alpha = 1e-3 / rounds`` over
    many rounds. ``sigma`` must be in the canaries' units (``aggregate_sigma(n_active) / scale``).
    """
    c = np.asarray(canaries, dtype=np.float64).ravel()
    k = c.size
    if k == 0 or not sigma > 0:
        raise ValueError("need at least one canary and sigma > 0")
    t = float((c * c).sum() / sigma**2)
    p_low, p_high = float(_st.chi2.cdf(t, k)), float(_st.chi2.sf(t, k))
    return CanaryTest(t, k, math.sqrt(t / k), p_low, p_high, alpha, p_low >= alpha)


# ------------------------------------------------------------------------------------- canary positions
CANARY_DOMAIN = b"distmoe/stats-canary-positions/v1"


def canary_seed(secagg_run: bytes, round_: int, participants: Sequence[tuple[int, bytes]]) -> bytes:
    """SHA-256 over the round's public material every survivor contributed: the SecAgg run id, the round and
    U1 as ``(node id, fresh per-round mask public key s_pk)`` sorted by id (``RoundStart.participants``).

    Every honest party draws its ``s_pk`` from its own CSPRNG for this round, so as long as one party in U1 is
    honest nobody (no party alone, not the coordinator) can fix or predict the seed before that key exists.
    The coordinator chooses *which* parties form U1 (at most ``2^n`` subsets to try), which lets it pick among
    a few pseudo-random layouts but not a layout of its choosing."""
    h = hashlib.sha256(CANARY_DOMAIN)
    run = bytes(secagg_run)
    h.update(len(run).to_bytes(2, "big") + run + int(round_).to_bytes(8, "big") + len(participants).to_bytes(4, "big"))
    for cid, pk in sorted((int(c), bytes(k)) for c, k in participants):
        h.update(cid.to_bytes(8, "big") + len(pk).to_bytes(2, "big") + pk)
    return h.digest()


def canary_positions(seed: bytes, length: int, k: int) -> np.ndarray:
    """``[k]`` sorted distinct positions in ``[0, length)``: a partial Fisher-Yates shuffle driven by
    SHAKE-256(seed) (8 bytes per draw, reduced mod the remaining range: bias <= length / 2^64)."""
    if not 0 <= k <= length:
        raise ValueError(f"need 0 <= k <= length, got k={k}, length={length}")
    words = np.frombuffer(hashlib.shake_256(bytes(seed)).digest(8 * k), dtype=">u8") if k else ()
    perm = np.arange(length, dtype=np.int64)  # [length]
    for i, w in enumerate(words):
        j = i + int(w) % (length - i)
        perm[i], perm[j] = perm[j], perm[i]
    return np.sort(perm[:k])


def positions_digest(positions: np.ndarray) -> str:
    """SHA-256 hex of the positions as big-endian int64 (what the release entry records)."""
    return hashlib.sha256(np.asarray(positions, dtype=">i8").tobytes()).hexdigest()


# -------------------------------------------------------------------------------------- row-sum noise test
@dataclass(frozen=True)
class RowNoiseTest:
    """Noise in the statistic itself: pooled row-sum dispersion ``T`` against chi-square(``dof``), lower tail
    with the lattice correction ``c`` (module docstring)."""

    statistic: float  # T = sum_r sum_l (R_rl - mean_r)^2 / tau_r^2
    dof: int  # D = sum_r (L_r - 1)
    lattice: float  # c: sqrt(sum_r L_r / (4 tau_r^2))
    ratio: float  # T / D: the estimated share of the claimed row-noise variance that is present
    p_low: float  # P[chi2_D <= (sqrt(T) + c)^2]: small when noise is missing
    alpha: float
    passed: bool


def row_noise_test(releases: Sequence[tuple[Sequence[float], float]], alpha: float = 1e-6) -> RowNoiseTest:
    """``releases``: per release ``(row_sums [L], tau)`` with ``tau = sqrt(E) * sigma_int`` the claimed std of
    one row sum's noise (integer units). Fails (``passed=False``) when the rows disagree significantly less than
    that noise implies; one-sided (too much dispersion is the ``row-sums`` check). Releases with one layer add
    nothing. Raises ``ValueError`` on non-finite input or ``tau <= 0``."""
    t, dof, c2 = 0.0, 0, 0.0
    for rows, tau in releases:
        v = np.asarray(rows, dtype=np.float64).ravel()  # [L]
        if not (math.isfinite(tau) and tau > 0) or not np.isfinite(v).all():
            raise ValueError(f"row sums must be finite and tau > 0, got tau={tau!r}")
        if v.size < 2:
            continue
        t += float(((v - v.mean()) ** 2).sum() / tau**2)
        dof += v.size - 1
        c2 += v.size / (4.0 * tau**2)
    if dof == 0:
        raise ValueError("need a release with at least two layers")
    c = math.sqrt(c2)
    p = float(_st.chi2.cdf((math.sqrt(t) + c) ** 2, dof))
    return RowNoiseTest(t, dof, c, t / dof, p, alpha, p >= alpha)


def row_noise_power(n_active: int, n_noisy: int, dof: int, alpha: float = 1e-6) -> float:
    """Probability that :func:`row_noise_test` fails when only ``n_noisy`` of ``n_active`` equal noise shares
    reach the statistic (the rest went to the canaries): ``T ~ rho * chi2_D``, ``rho = n_noisy / n_active``, so
    the power is ``P[chi2_D <= q_alpha(D) / rho]`` (the lattice term ``c``, ~1e-3 at run sizes, is ignored;
    ``n_noisy = 0`` gives 1: then ``T = 0`` and the test fails iff ``P[chi2_D <= c^2] < alpha``)."""
    if not 0 <= n_noisy <= n_active or n_active < 1 or dof < 1:
        raise ValueError("need 0 <= n_noisy <= n_active, n_active >= 1 and dof >= 1")
    if n_noisy == 0:
        return 1.0
    q = float(_st.chi2.ppf(alpha, dof))
    return float(_st.chi2.cdf(q * n_active / n_noisy, dof))
