"""Noise-presence tests of the distributed Skellam release: the canary chi-square test, the canary positions and
the row-sum noise test of the statistic itself.

Canaries (``distmoe.privacy.dp``, step 5): ``K`` known-zero coordinates noised like the rest, so their aggregate
is pure noise; :func:`canary_chi2_test` fails when it carries significantly less noise than claimed (a missing
noise share). Their positions among the ``L*E + K`` coordinates are drawn per release (:func:`canary_positions`,
a partial Fisher-Yates shuffle driven by SHAKE-256) from a seed that hashes every survivor's fresh per-round
SecAgg mask key (:func:`canary_seed`), so no party alone and not the coordinator can place them.

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

Owns: the canary test, the canary seed and positions (and their digest), the row-sum noise test and its power.
Must not: import ``flwr``, ``torch`` or anything of distmoe, calibrate or draw noise (``distmoe.privacy.dp``
does), or decide a verdict (the audit does, from these tests' results).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as _st

__all__ = [
    "CANARY_DOMAIN",
    "CanaryTest",
    "RowNoiseTest",
    "canary_chi2_test",
    "canary_positions",
    "canary_seed",
    "positions_digest",
    "row_noise_power",
    "row_noise_test",
]


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
