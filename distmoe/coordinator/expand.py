"""Dynamic expert expansion at the coordinator (``retention.expand-experts = k``; the surgery and its formula:
``model/expand.py``, Lifelong-MoE).

Owns the decision and its record: at the first round of an ``sft`` phase whose task was not trained before,
once some task was (so at each new task after the first), ``k`` experts are added to every MoE layer of the
server's model, copies of the experts with the most routing mass in the latest anchor (experts ``0..k-1``
without one). The global weights, ``TrainableSpec`` and ``ModelSpec`` follow the new shape, and so does
everything derived from them (the instructions' weights, the update and statistics layouts of secure
aggregation, the probe); the stored anchors are padded with zero mass for the new experts. Each expansion is
appended to ``RoundState.expansions`` (round, task, expert counts, sources), which the checkpoint holds, so a
resumed run replays the same surgery (``replay``) before loading its weights. ``expand`` and ``replay`` return the
grown model (and ``expand`` the padded anchors and the record) as an ``Expansion``; the ``sft`` phase adopts it.

The parties see the expert count in the shapes of the global weights every instruction carries; each party
grows its own base to that count before loading them (``party/work.py``), and in ``sft`` rounds freezes every
expert but the ``k`` newest (``party/retention.py``). The count can only grow along the schedule, so the
run's allow-list and secure-aggregation setup are sized up front for every stage (``model.expand.stages``, from
``config.expansion_tasks``).

Must not: import ``flwr``, or see one party's values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from distmoe.config import RunConfig
from distmoe.coordinator.state import RoundState
from distmoe.model.adapters import ServerModel
from distmoe.model.build import describe
from distmoe.model.expand import default_sources, expand_experts, pad_anchor, per_expert
from distmoe.model.trainable import load_trainable, spec_of, trainable_state
from distmoe.routing.anchor import Anchor


@dataclass(frozen=True)
class Expansion:
    """One expansion's outcome: the grown model (its ``weights`` are the new global weights), the state's anchors
    padded to its expert count, the record for ``RoundState.expansions`` and ``metrics.jsonl``, the progress note."""

    model: ServerModel
    anchor: Anchor | None
    task_anchors: dict[str, Anchor]
    record: dict
    note: str


def due(cfg: RunConfig, s: RoundState, task: str) -> bool:
    """Whether an ``sft`` phase of ``task`` starting now expands the model (``config.expansion_tasks`` is this rule
    applied along the schedule; the allow-list is sized from it)."""
    return bool(cfg.retention.expand_experts) and task not in s.trained_tasks and bool(s.trained_tasks)


def _grown(model: ServerModel, sources: list[list[int]], weights: dict | None = None) -> ServerModel:
    """The surgery on the server's module (``weights``: loaded first, when given); its spec and weights follow."""
    module = model.module
    if weights is not None:
        load_trainable(module, weights, model.tspec)
    expand_experts(module, sources)
    tspec = spec_of(module, model.tspec.mode, model.tspec.base_hash)
    return dataclasses.replace(model, weights=trainable_state(module), tspec=tspec, mspec=describe(module))


def _pad(a: Anchor, experts: int) -> Anchor:
    spec = {**a.meta.router_spec, "num_experts": experts,
            "padded_from": a.meta.router_spec.get("padded_from", a.meta.router_spec["num_experts"])}
    return Anchor(probs=pad_anchor(a.probs, experts), meta=dataclasses.replace(a.meta, router_spec=spec))


def padded_anchors(s: RoundState, experts: int) -> tuple[Anchor | None, dict[str, Anchor]]:
    """The anchors the state holds (latest, per task), zero-padded to ``experts``."""
    anchor = _pad(s.anchor, experts) if s.anchor is not None and s.anchor.probs.shape[1] != experts else s.anchor
    return anchor, {t: (_pad(a, experts) if a.probs.shape[1] != experts else a) for t, a in s.task_anchors.items()}


def expand(cfg: RunConfig, model: ServerModel, s: RoundState, task: str) -> Expansion:
    """Grow the model (holding the global weights ``s.weights``) by ``retention.expand-experts`` experts per MoE
    layer for ``task``."""
    k, before, layers = cfg.retention.expand_experts, model.mspec.num_experts, model.mspec.num_moe_layers
    sources = default_sources(s.anchor.probs if s.anchor is not None else None, layers, before, k)
    grown = _grown(model, sources, s.weights)
    after = grown.mspec.num_experts
    anchor, task_anchors = padded_anchors(s, after)
    rec = {"round": s.round, "task": task, "from": before, "to": after, "sources": sources,
           "anchor_version": anchor.meta.version if anchor is not None else 0}
    note = f"expanded to {after} experts per MoE layer for task {task} (+{k}, copies of {sources[0]}" \
        + (" in MoE layer 0, ...)" if len(sources) > 1 else ")")
    return Expansion(grown, anchor, task_anchors, rec, note)


def replay(model: ServerModel, expansions: list[dict]) -> ServerModel:
    """Resume: the surgery of a checkpoint's recorded expansions on the freshly built server model (its values are
    replaced by the checkpoint's weights next), so the model has the checkpoint's shape."""
    for rec in expansions:
        if int(rec["from"]) != model.mspec.num_experts:
            raise ValueError(f"recorded expansion at round {rec['round']} starts from {rec['from']} experts, the "
                             f"model has {model.mspec.num_experts}")
        model = _grown(model, [list(map(int, src)) for src in rec["sources"]])
    return model


def freeze_delta(cfg: RunConfig, s: RoundState, experts: int, delta: dict) -> int:
    """After an expansion, zero the aggregated ``sft`` update of every expert but the ``k`` newest and of their router
    rows (the parties already leave them unchanged; this keeps them exact under update noise too). ``experts``: the
    model's expert count now; ``delta``: name -> ``[E, ...]`` array, its entries replaced. Returns the number of
    zeroed entries."""
    if not s.expansions:
        return 0
    keep = experts - cfg.retention.expand_experts  # experts [0, keep) are frozen
    n = 0
    for name, d in delta.items():
        if per_expert(name) and d.shape[0] == experts:
            d = delta[name] = np.array(d, copy=True)
            n += int(d[:keep].size)
            d[:keep] = 0
    return n
