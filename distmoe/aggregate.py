"""Weighted federated averaging of model updates (FedAvg on deltas).

Must not: see anything but the deltas and their weights; it never modifies its inputs.
"""

from __future__ import annotations

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
