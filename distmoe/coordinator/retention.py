"""What an ``sft`` instruction carries for retention (``docs/algorithms.md``, Retention): the earlier tasks'
anchors, the round's index within its phase, and the hash of the pre-task global model.

- ``task_anchors`` ``[T, L, E]``: the latest anchor of every task other than the one now training, in the
  order they were built (``RoundState.task_anchors``, filled by ``stats:<task>`` phases), when
  ``retention.task-anchors`` is on or expert protection is (``retention.protect-mass`` > 0). At most one per
  task of the schedule: the allow-list's byte budget is sized for that (``wire/server_guard.build_policy``).
  Each anchor is post-processing of a DP-noised secure sum, so sending it back to the parties costs no privacy.
- ``task_round``: 1 in a phase's first round (the router-only warm-up counts the task's steps from it).
- ``ref_hash``: ``hash_tensors`` of the global model at the start of the task (``RoundState.ref_weights``)
  when ``retention.distill-weight`` > 0 and an earlier task was trained (the first task has nothing to keep):
  each party keeps the weights it received whose hash is this as its
  pre-task model for output distillation (``party/retention.py``).

Must not: import ``flwr``, or see one party's values.
"""

from __future__ import annotations

import numpy as np

from distmoe.coordinator.state import position
from distmoe.model.build import hash_tensors


def earlier_anchors(s, task: str) -> np.ndarray | None:
    """``[T, L, E]`` anchors of the tasks other than ``task``, oldest version first; None when there are none."""
    earlier = sorted((a for t, a in s.task_anchors.items() if t != task), key=lambda a: a.meta.version)
    return np.stack([a.probs for a in earlier]).astype(np.float32) if earlier else None


def sft_fields(co, phase) -> dict:
    """The retention fields of this round's ``SftInstruction`` (keyword arguments)."""
    s, ret = co.s, co.cfg.retention
    fields: dict = {}
    if ret.task_anchors != "off" or ret.protect:
        fields["task_anchors"] = earlier_anchors(s, phase.task)
    pos = position(co.cfg.schedule.phases, s.round)
    fields["task_round"] = int(pos["round_in_phase"]) if pos else 1
    if ret.distill_weight > 0 and s.ref_weights is not None and len(s.trained_tasks) > 1:
        fields["ref_hash"] = hash_tensors(s.ref_weights)
    return fields


def sends_latest_anchor(co) -> bool:
    """With per-task anchors on, the per-task KL replaces the KL to the latest anchor."""
    return co.cfg.retention.task_anchors == "off"


def anchor_version(co, task: str, use_latest: bool) -> int:
    """The version the instruction names (0 = no anchor KL): the latest anchor's, or with per-task anchors the
    newest of the earlier tasks' anchors it carries."""
    s = co.s
    if use_latest:
        return s.anchor.meta.version
    if co.cfg.retention.task_anchors != "off" and co.cfg.routing.anchor_kl_coef > 0:
        return max((a.meta.version for t, a in s.task_anchors.items() if t != task), default=0)
    return 0
