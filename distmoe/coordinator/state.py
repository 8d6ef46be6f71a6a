"""The coordinator's state between rounds, and its form inside a checkpoint.

Owns: ``RoundState``, immutable: each step of a round returns a new one (``dataclasses.replace``; the round loop
threads it) and never writes into the one it was handed (round counter, hence the schedule position; the global
trainable weights; the router anchor and its version count; the per-task anchors; the current and trained tasks; the
reference weights and the evaluation baseline for retention; the last evaluation; the anomaly history; the expert
expansions), ``position`` (where a round sits in the schedule) and the round trip through a checkpoint:
``to_checkpoint`` gives ``state.json`` and its tensors, ``from_checkpoint`` rebuilds the state from what
``distmoe.checkpoint`` loaded (``docs/operations.md``, Resume).

Must not: talk to parties, write files, or know about privacy.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from distmoe.config import UPDATE_KINDS, Phase
from distmoe.io import sanitize
from distmoe.routing.anchor import Anchor, AnchorVersion

STATE_FORMAT = 1  # of the coordinator state inside each checkpoint


class StateError(ValueError):
    """A checkpoint's state does not belong to this run or cannot be read."""


@dataclass(frozen=True)
class RoundState:
    round: int = 0
    weights: dict[str, torch.Tensor] = field(default_factory=dict)  # global trainable weights, float32
    anchor: Anchor | None = None
    anchor_versions: int = 0
    task_anchors: dict[str, Anchor] = field(default_factory=dict)  # task -> its latest anchor (`stats:<task>`)
    current_task: str | None = None
    trained_tasks: list[str] = field(default_factory=list)
    ref_weights: dict[str, torch.Tensor] | None = None  # global model before the current task
    last_eval: dict[str, dict[str, float]] = field(default_factory=dict)  # party -> metrics
    baseline: dict[str, dict[str, float]] = field(default_factory=dict)  # eval before the current task
    anomaly_history: dict[str, list[float]] = field(default_factory=dict)  # "event/key" -> aggregate values
    expansions: list[dict] = field(default_factory=list)  # expert expansions so far (coordinator/expand.py)

    def begin_task(self, task: str) -> RoundState:
        """The state as a new task starts: the model and the evaluation before it kept (for retention)."""
        return replace(self.mark_trained(task), ref_weights={k: v.clone() for k, v in self.weights.items()},
                       baseline={p: dict(m) for p, m in self.last_eval.items()}, current_task=task)

    def mark_trained(self, task: str) -> RoundState:
        """The state with ``task`` among the trained tasks."""
        return self if task in self.trained_tasks else replace(self, trained_tasks=[*self.trained_tasks, task])

    def with_weights(self, changed: dict[str, torch.Tensor]) -> RoundState:
        """The state with the global weights of ``changed`` replaced (a new dict; the others shared)."""
        return replace(self, weights={**self.weights, **changed})


def position(phases: tuple[Phase, ...], rnd: int) -> dict | None:
    """Where round ``rnd`` sits in the schedule (None for round 0, before the first phase)."""
    done = 0
    for i, ph in enumerate(phases):
        if rnd <= done + ph.rounds:
            return {"phase": i, "label": ph.label(), "round_in_phase": rnd - done} if rnd > 0 else None
        done += ph.rounds
    return {"phase": len(phases), "label": "end", "round_in_phase": 0}


def pinned(phases: tuple[Phase, ...], rnd: int, current_task: str | None) -> dict:
    """``{"kept": reason}`` when the checkpoint of round ``rnd`` is never pruned (``checkpoint.keep`` does not
    apply): round 0 (the initial model) and the last round before a training phase of another task (the model
    before that task, the rollback points of ``distmoe rollback``); ``{}`` otherwise."""
    if rnd == 0:
        return {"kept": "initial model"}
    nxt = position(phases, rnd + 1)
    if nxt is None or nxt["phase"] >= len(phases) or nxt["round_in_phase"] != 1:
        return {}
    ph = phases[nxt["phase"]]
    if ph.kind in UPDATE_KINDS and ph.task and ph.task != current_task:
        return {"kept": f"before task {ph.task}"}
    return {}


def to_checkpoint(s: RoundState, phases: tuple[Phase, ...], *, run_id: str, session: str, epoch: int
                  ) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """``state.json`` at this round boundary and its tensor files (``ref``, ``anchor``)."""
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    if s.ref_weights is not None:
        tensors["ref"] = s.ref_weights
    if s.anchor is not None:
        tensors["anchor"] = {"probs": torch.from_numpy(np.ascontiguousarray(s.anchor.probs, dtype=np.float32))}
    if s.task_anchors:
        tensors["task_anchors"] = {t: torch.from_numpy(np.ascontiguousarray(a.probs, dtype=np.float32))
                                   for t, a in s.task_anchors.items()}
    state = {"format": STATE_FORMAT, "run_id": run_id, "session": session, "epoch": epoch,
             "round": s.round, "position": position(phases, s.round), "anchor_versions": s.anchor_versions,
             "anchor": asdict(s.anchor.meta) if s.anchor is not None else None,
             "task_anchors": {t: asdict(a.meta) for t, a in s.task_anchors.items()},
             "current_task": s.current_task, "trained_tasks": list(s.trained_tasks),
             "last_eval": sanitize(s.last_eval), "baseline": sanitize(s.baseline),
             "anomaly_history": sanitize(s.anomaly_history),
             **({"expansions": s.expansions} if s.expansions else {})}
    return state, tensors


def _as_float(d: dict | None) -> dict[str, dict[str, float]]:
    return {p: {k: (math.nan if v is None else float(v)) for k, v in m.items()} for p, m in (d or {}).items()}


def from_checkpoint(state: object, weights: dict[str, torch.Tensor], extra: dict[str, dict[str, torch.Tensor]],
                    *, run_id: str, where: str) -> RoundState:
    """The state a checkpoint holds; ``StateError`` naming ``where`` when it is not this run's."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT or state.get("run_id") != run_id:
        raise StateError(f"{where}/state.json: not a state of run {run_id} in format {STATE_FORMAT}")
    anchor = None
    if state.get("anchor") is not None:
        probs = extra.get("anchor", {}).get("probs")
        if probs is None:
            raise StateError(f"{where}: state.json names anchor v{state['anchor'].get('version')}, but "
                             "anchor.safetensors is missing")
        anchor = Anchor(probs=probs.numpy().astype(np.float32), meta=AnchorVersion(**state["anchor"]))
    task_anchors = {}
    for t, meta in (state.get("task_anchors") or {}).items():
        probs = extra.get("task_anchors", {}).get(t)
        if probs is None:
            raise StateError(f"{where}: state.json names the anchor of task {t!r}, but task_anchors.safetensors "
                             "does not hold it")
        task_anchors[t] = Anchor(probs=probs.numpy().astype(np.float32), meta=AnchorVersion(**meta))
    return RoundState(
        round=int(state["round"]), weights=weights, anchor=anchor, anchor_versions=int(state["anchor_versions"]),
        task_anchors=task_anchors,
        current_task=state.get("current_task"), trained_tasks=list(state.get("trained_tasks") or []),
        ref_weights=({k: v.to(torch.float32) for k, v in extra["ref"].items()} if "ref" in extra else None),
        last_eval=_as_float(state.get("last_eval")), baseline=_as_float(state.get("baseline")),
        anomaly_history={k: [float(x) for x in v] for k, v in (state.get("anomaly_history") or {}).items()},
        expansions=[dict(e) for e in (state.get("expansions") or [])])
