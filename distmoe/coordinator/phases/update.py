"""Applying an aggregated model update, shared by the ``sft`` and ``rl`` phases, and the released training
figures of its round line (``released``).

Must not: import ``flwr``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from distmoe.coordinator import expand
from distmoe.coordinator.aggregator import Skip, UpdateSum
from distmoe.coordinator.divergence import check_update
from distmoe.coordinator.phases import settle

if TYPE_CHECKING:
    from distmoe.coordinator.loop import Coordinator


def apply_update(co: Coordinator, out: UpdateSum | Skip, event: dict) -> UpdateSum | str:
    """Add an aggregated update to the global weights, log it, watch it for anomalies and per-tensor divergence
    (``divergence.py``), settle the routing bias on the new weights when configured (``phases/settle.py``) and
    checkpoint;
    or log a skipped round (``Skip``) and return its line."""
    if isinstance(out, Skip):
        text = co.round_failed(out.text, failed=out.failed)
        co.metrics.append({**event, "party": "all", "num_examples": 0, "skipped": True})
        return text
    s = co.s
    if event["event"] == "train":  # sft / dpo: the experts frozen after an expansion stay exact
        expand.freeze_delta(co, out.delta)
    for k, d in out.delta.items():
        s.weights[k] = s.weights[k] + torch.from_numpy(d)
    # secure aggregation: the weight sum is the number of contributing parties (uniform weights), not examples
    count = {"contributors": out.num_examples} if co.cfg.privacy.secure else {"num_examples": out.num_examples}
    co.metrics.append({**event, "party": "all", **count, "parties": out.parties, **out.metrics})
    co.flag_anomalies(event["event"], out.metrics)
    check_update(co, event["event"], out.delta)  # federation.divergence-max: a warning, the update stays applied
    settle.after_update(co)  # routing.balance-settle-steps: the bias settled on the new weights, before the checkpoint
    if co.checkpoint_due(event["phase_label"].split(":")[0]):
        co.checkpoint()
    return out


def released(metrics: dict[str, float], noise: dict[str, float], names: tuple[tuple[str, str, str], ...]) -> str:
    """The training-metric slots' means of a secure round as ``name value`` (``± std`` where the update noise is
    on), for the round line; ``names``: ``(key, label, format)``."""
    parts = []
    for key, label, fmt in names:
        v = metrics.get(key, math.nan)
        if math.isfinite(v):
            sd = noise.get(key)
            parts.append(f"{label} {v:{fmt}}" + (f" ± {sd:{fmt}}" if sd else ""))
    return ", ".join(parts) if parts else "no training figures (no contributor)"
