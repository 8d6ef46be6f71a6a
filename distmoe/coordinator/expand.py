"""Dynamic expert expansion at the coordinator (``retention.expand-experts = k``; the surgery and its formula:
``model/expand.py``, Lifelong-MoE).

Owns the decision and its record: at the first round of an ``sft`` phase whose task was not trained before,
once some task was (so at each new task after the first), ``k`` experts are added to every MoE layer of the
server's model, copies of the experts with the most routing mass in the latest anchor (experts ``0..k-1``
without one). The global weights, ``TrainableSpec`` and ``ModelSpec`` follow the new shape, and so does
everything derived from them (the instructions' weights, the update and statistics layouts of secure
aggregation, the probe); the stored anchors are padded with zero mass for the new experts. Each expansion is
appended to ``RoundState.expansions`` (round, task, expert counts, sources), which the checkpoint holds, so a
resumed run replays the same surgery (``replay``) before loading its weights.

The parties see the expert count in the shapes of the global weights every instruction carries; each party
grows its own base to that count before loading them (``party/work.py``), and in ``sft`` rounds freezes every
expert but the ``k`` newest (``party/retention.py``). The count can only grow along the schedule, so the
run's allow-list and secure-aggregation setup are sized up front for every stage (``model.expand.stages``, from
``config.expansion_tasks``).

Must not: import ``flwr``, or see one party's values.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from distmoe.model.build import describe
from distmoe.model.expand import default_sources, expand_experts, pad_anchor, per_expert
from distmoe.model.trainable import load_trainable, spec_of, trainable_state
from distmoe.routing.anchor import Anchor

if TYPE_CHECKING:
    from distmoe.coordinator.loop import Coordinator


def due(co: Coordinator, task: str) -> bool:
    """Whether an ``sft`` phase of ``task`` starting now expands the model (``config.expansion_tasks`` is this rule
    applied along the schedule; the allow-list is sized from it)."""
    s = co.s
    return bool(co.cfg.retention.expand_experts) and task not in s.trained_tasks and bool(s.trained_tasks)


def _grow(co: Coordinator, sources: list[list[int]]) -> None:
    """Apply the surgery to the server's model; global weights, specs follow."""
    module = co.model.module
    load_trainable(module, co.s.weights, co.tspec)
    expand_experts(module, sources)
    tspec = spec_of(module, co.tspec.mode, co.tspec.base_hash)
    weights = trainable_state(module)
    co.model = dataclasses.replace(co.model, weights=weights, tspec=tspec, mspec=describe(module))
    co.tspec, co.mspec = tspec, co.model.mspec
    co.s.weights = weights


def _pad(a: Anchor, experts: int) -> Anchor:
    spec = {**a.meta.router_spec, "num_experts": experts,
            "padded_from": a.meta.router_spec.get("padded_from", a.meta.router_spec["num_experts"])}
    return Anchor(probs=pad_anchor(a.probs, experts), meta=dataclasses.replace(a.meta, router_spec=spec))


def pad_anchors(co: Coordinator) -> None:
    """The anchors the state holds, zero-padded to the model's expert count."""
    s, e = co.s, co.mspec.num_experts
    if s.anchor is not None and s.anchor.probs.shape[1] != e:
        s.anchor = _pad(s.anchor, e)
    s.task_anchors = {t: (_pad(a, e) if a.probs.shape[1] != e else a) for t, a in s.task_anchors.items()}


def expand(co: Coordinator, task: str) -> str:
    """Grow the model by ``retention.expand-experts`` experts per MoE layer for ``task``; returns the progress note."""
    k, before = co.cfg.retention.expand_experts, co.mspec.num_experts
    anchor = co.s.anchor.probs if co.s.anchor is not None else None
    sources = default_sources(anchor, co.mspec.num_moe_layers, before, k)
    _grow(co, sources)
    pad_anchors(co)
    rec = {"round": co.s.round, "task": task, "from": before, "to": co.mspec.num_experts, "sources": sources,
           "anchor_version": co.s.anchor.meta.version if co.s.anchor is not None else 0}
    co.s.expansions.append(rec)
    co.metrics.append({"event": "expand", **rec})
    co.record.update(model={**(co.record.get("model") or {}), "router_spec": co.mspec.router_spec(),
                            "trainable_numel": co.tspec.numel})
    return f"expanded to {co.mspec.num_experts} experts per MoE layer for task {task} (+{k}, copies of {sources[0]}" \
        + (" in MoE layer 0, ...)" if len(sources) > 1 else ")")


def replay(co: Coordinator, expansions: list[dict]) -> None:
    """Resume: the surgery of a checkpoint's recorded expansions on the freshly built server model (its values are
    replaced by the checkpoint's weights next), so the model has the checkpoint's shape."""
    for rec in expansions:
        if int(rec["from"]) != co.mspec.num_experts:
            raise ValueError(f"recorded expansion at round {rec['round']} starts from {rec['from']} experts, the "
                             f"model has {co.mspec.num_experts}")
        module = co.model.module
        expand_experts(module, [list(map(int, s)) for s in rec["sources"]])
        tspec = spec_of(module, co.tspec.mode, co.tspec.base_hash)
        co.model = dataclasses.replace(co.model, weights=trainable_state(module), tspec=tspec,
                                       mspec=describe(module))
        co.tspec, co.mspec = tspec, co.model.mspec


def freeze_delta(co: Coordinator, delta: dict) -> int:
    """After an expansion, zero the aggregated ``sft`` update of every expert but the ``k`` newest and of their router
    rows (the parties already leave them unchanged; this keeps them exact under update noise too). ``delta``:
    name -> ``[E, ...]`` array, its entries replaced. Returns the number of zeroed entries."""
    if not co.s.expansions:
        return 0
    keep = co.mspec.num_experts - co.cfg.retention.expand_experts  # experts [0, keep) are frozen
    n = 0
    for name, d in delta.items():
        if per_expert(name) and d.shape[0] == co.mspec.num_experts:
            d = delta[name] = np.array(d, copy=True)
            n += int(d[:keep].size)
            d[:keep] = 0
    return n
