"""Weighted federated averaging of model updates (FedAvg on deltas), and the server's robustness checks.

Owns: ``weighted_average`` (plaintext FedAvg), ``divergent_updates`` (plaintext mode: updates whose L2
norm is more than ``max_norm_ratio`` times the round's median are rejected, the usual norm-ratio screen
for broken or hostile clients) and ``aggregate_problem`` (secure mode: the server sees only the decoded
sum, so it checks what every honest sum must satisfy: the total weight is at most ``n`` (uniform weights), and
the average of updates each clipped to ``update-clip`` has norm at most ``update-clip``, plus the noise
when client-level DP is on; a party that bypasses its guard and sends an unclipped or random vector
breaks one of them). Under secure aggregation one party's norm cannot be seen; its bound is the clip its
own guard applies, and this sum check is what the server can verify.

FedAvg (McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017, https://arxiv.org/abs/1602.05629) on deltas, per trainable tensor ``k`` of shape ``shape_k``::

    avg_k = sum_i w_i * delta_{i,k} / sum_i w_i      [shape_k]   over updates with w_i > 0

Must not: see anything but the deltas and their weights; it never modifies its inputs.
"""

from __future__ import annotations

import math

import numpy as np


class AggregationError(ValueError):
    """Updates cannot be combined (different keys or shapes)."""


def weighted_average(updates: list[tuple[dict[str, np.ndarray], float]]) -> dict[str, np.ndarray] | None:
    """sum_i w_i * d_i / sum_i w_i over updates with w_i > 0; None when no update has weight."""
    live = [(d, float(w)) for d, w in updates if w > 0]
    if not live:
        return None
    keys = sorted(live[0][0])
    for d, _ in live[1:]:
        if sorted(d) != keys:
            raise AggregationError("updates carry different tensor keys")
    total = sum(w for _, w in live)
    out: dict[str, np.ndarray] = {}
    for k in keys:
        shape = live[0][0][k].shape
        acc = np.zeros(shape, dtype=np.float64)
        for d, w in live:
            if d[k].shape != shape:
                raise AggregationError(f"tensor {k!r}: shapes differ ({d[k].shape} vs {shape})")
            acc += (w / total) * d[k].astype(np.float64)
        out[k] = acc.astype(np.float32)
    return out


def _norm(delta: dict[str, np.ndarray]) -> float:
    """L2 norm of all tensors in float64: per tensor the pairwise sum of the squares, summed in order. One float64
    copy per tensor, squared in place (the result of ``np.square`` of a float64 copy, bit for bit, without its
    second array: 65 -> 24 ms for three updates of the default model)."""
    total = 0.0
    for v in delta.values():
        a = np.array(v, np.float64)  # [shape_k] always a copy: the input is never modified
        np.multiply(a, a, out=a)
        total += float(a.sum())
    return float(math.sqrt(total))


def divergent_updates(deltas: dict[int, dict[str, np.ndarray]], max_norm_ratio: float) -> dict[int, str]:
    """Node -> reason for each update whose norm exceeds ``max_norm_ratio`` x the median norm of the round.
    Needs at least 3 updates (a median of two is one of them) and a positive median; 0 turns it off."""
    if max_norm_ratio <= 0 or len(deltas) < 3:
        return {}
    norms = {node: _norm(d) for node, d in deltas.items()}
    med = float(np.median(list(norms.values())))
    if not med > 0:
        return {}
    return {node: (f"update norm {n:.4g} is {n / med:.1f}x the round median {med:.4g} "
                   f"(federation.max-norm-ratio = {max_norm_ratio:g}): rejected")
            for node, n in norms.items() if n > max_norm_ratio * med}


def aggregate_problem(layout, avg: dict[str, np.ndarray] | None, weight: float, n_included: int,
                      update_noise_multiplier: float = 0.0, threshold: int = 1) -> str | None:
    """Why a decoded secure sum of updates cannot come from honest parties, or None.

    ``layout`` is the round's ``UpdateLayout``; ``avg`` and ``weight`` its decode. Bounds: total weight in
    ``[0, n * weight_bound]``; the average finite with ``||avg|| <= clip`` (a convex combination of vectors
    of norm <= clip), plus ``sqrt(d) * layout.quantisation_bound()`` for the fixed-point rounding (every
    coordinate of the decoded mean is within it of the exact mean) and ``sigma * (sqrt(d) + 8)`` for the DP
    noise of std ``sigma`` per coordinate.
    """
    if not math.isfinite(weight) or weight < -0.5 or weight > n_included * layout.weight_bound + 0.5:
        return (f"total weight {weight:.6g} outside [0, {n_included} x {layout.weight_bound}] (an undeclared "
                "weight, or a vector that was not a masked input of the declared layout)")
    if avg is None:
        return None
    flat = np.empty(sum(np.size(a) for a in avg.values()), np.float64)  # [D] the average in float64, one copy
    off = 0
    for a in avg.values():  # in the average's order (as concatenating float64 copies would, without the copies)
        np.copyto(flat[off:off + np.size(a)], np.ravel(a), casting="unsafe")
        off += np.size(a)
    if not np.all(np.isfinite(flat)):
        return "the average update is not finite"
    norm = float(np.linalg.norm(flat))
    bound = layout.clip * (1.0 + 1e-6) + 1e-6 + math.sqrt(flat.size) * layout.quantisation_bound()
    if update_noise_multiplier > 0 and weight > 0.5:
        sigma = update_noise_multiplier * layout.clip * math.sqrt(n_included / max(threshold, 1)) / weight
        bound += sigma * (math.sqrt(flat.size) + 8.0)
    if norm > bound:
        return (f"average update norm {norm:.6g} exceeds {bound:.6g}, the bound of updates clipped to "
                f"privacy.update-clip = {layout.clip:g} (a party sent an unclipped or corrupted input)")
    return None


def stats_sum_problem(int_sum: np.ndarray, scale: float, n_included: int, num_sequences_max: int,
                      sigma_int: float) -> str | None:
    """Why a decoded ``[L, E]`` integer router-statistics sum cannot come from honest parties, or None.

    Honest entries lie in ``[0, n * N_max * s]`` plus noise, and with mass-preserving rounding every row is
    ``N * s`` plus the sum of E noise coordinates; both are checked with a 10-sigma margin (a false alarm
    has probability far below 1e-20), so only a party that sent something outside its layout trips it."""
    a = np.asarray(int_sum, np.float64)  # [L, E]
    tail = 10.0 * sigma_int
    top = n_included * num_sequences_max * float(scale) + tail
    if a.size and (a.min() < -tail or a.max() > top):
        return (f"router-statistics entries in [{a.min():.6g}, {a.max():.6g}], outside [-{tail:.6g}, {top:.6g}] "
                f"({n_included} parties x num-sequences-max {num_sequences_max} at scale {scale:g} plus noise)")
    rows = a.sum(1)  # [L]
    spread = float(rows.max() - rows.min()) if rows.size else 0.0
    limit = 2.0 * 10.0 * math.sqrt(a.shape[1]) * sigma_int if a.ndim == 2 else 0.0
    if spread > limit:
        return (f"router-statistics rows differ by {spread:.6g} > {limit:.6g} (each row should be N*s plus noise): "
                "a party's input is not on the declared simplex")
    return None
