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

Noise source: ``distmoe.privacy.csprng`` (``crypto_rng``: OS-seeded PCG64DXSM; see there).

Row-sum noise test, canary test and canary positions: ``distmoe.privacy.canaries`` (re-exported here).

Owns: the encoding, the noise calibration (``SkellamSpec``), share generation, decoding and the
data-plus-noise bound of the bit-width check (the ring and its no-wrap rule are ``distmoe.privacy.ring``; the
random sources are ``distmoe.privacy.csprng``; the canary and row-sum noise tests are ``distmoe.privacy.canaries``,
whose names this module re-exports).
Must not: import ``flwr`` or ``torch``, perform secure aggregation (``distmoe.privacy`` secagg does), account
epsilon (the accountant does), or send anything.

Why hand-written: opacus only implements central/per-sample Gaussian DP-SGD; it has no integer, distributed
(Skellam or discrete-Gaussian) mechanism. TFF's ``DistributedDpSumFactory`` has one but needs TensorFlow and
its own SecAgg runtime; Flower has no distributed-DP mod. The mechanism itself is ~40 lines of numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from distmoe.privacy import ring
from distmoe.privacy.canaries import (
    CANARY_DOMAIN,
    CanaryTest,
    RowNoiseTest,
    canary_chi2_test,
    canary_positions,
    canary_seed,
    positions_digest,
    row_noise_power,
    row_noise_test,
)
from distmoe.privacy.csprng import KeystreamUniform, crypto_rng

__all__ = [
    "CANARY_DOMAIN",
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
