"""Applying an aggregated model update (a new round state), shared by the ``sft``, ``dpo`` and ``rl`` phases, and
the released training figures of their round line (``released``, ``contributors``).

Must not: import ``flwr``, or talk to a party (the loop settles the routing bias and checkpoints afterwards).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from distmoe.coordinator import expand
from distmoe.coordinator.aggregator import UpdateSum
from distmoe.coordinator.context import RunContext
from distmoe.coordinator.divergence import check_update
from distmoe.coordinator.state import RoundState
from distmoe.report.progress import within_noise


def apply_update(co: RunContext, out: UpdateSum, event: dict) -> RoundState:
    """The round state with an aggregated update added to the global weights; logged, and watched for anomalies and
    per-tensor divergence (``divergence.py``). ``co.s`` is left as it was."""
    s = co.s
    if event["event"] == "train":  # sft / dpo: the experts frozen after an expansion stay exact
        expand.freeze_delta(co.cfg, s, co.mspec.num_experts, out.delta)
    weights = {k: s.weights[k] + torch.from_numpy(d) for k, d in out.delta.items()}
    # a secure release: the weight sum is the number of contributing parties (uniform weights), not examples
    count = {"contributors": out.num_examples} if out.uniform else {"num_examples": out.num_examples}
    # with update noise, each released slot's noise std beside its mean (``<key>_sd``, public: from z_u, the bound
    # and the contributors), so metrics.jsonl, the report and TensorBoard show the figure with its scale
    sds = {f"{k}_sd": v for k, v in out.noise.items() if k in out.metrics and math.isfinite(v) and v > 0}
    co.metrics.append({**event, "party": "all", **count, "parties": out.parties, **out.metrics, **sds})
    _, history = co.flag_anomalies(event["event"], out.metrics)
    check_update(co, event["event"], out.delta)  # federation.divergence-max: a warning, the update stays applied
    return replace(s.with_weights(weights), anomaly_history=history)


def released(metrics: dict[str, float], noise: dict[str, float], names: tuple[tuple[str, str, str], ...]) -> str:
    """The training-metric slots' means of a secure round as ``name value`` (``± std`` where the update noise is
    on, and ``≈ 0 (within noise)`` for a mean within one std of 0), for the round line; ``names``: ``(key, label,
    format)``; one round-line field per figure, so the line packs into 100 columns (``distmoe.report.progress.fit``)."""
    parts = []
    for key, label, fmt in names:
        v = metrics.get(key, math.nan)
        if math.isfinite(v):
            sd = noise.get(key)
            if sd and within_noise(v, sd):
                parts.append(f"{label} ≈ 0 (within noise)")
            else:
                parts.append(f"{label} {v:{fmt}}" + (f" ± {sd:{fmt}}" if sd else ""))
    return " | ".join(parts) if parts else "no training figures (no contributor)"  # a field each: fit() packs them


def contributors(out: UpdateSum) -> str:
    """``3/3 parties``, or ``3/3 parties, 2 with data`` when not every answering party contributed."""
    text = f"{out.parties}/{out.nodes} parties"
    return text if out.num_examples == out.parties else f"{text}, {out.num_examples} with data"
