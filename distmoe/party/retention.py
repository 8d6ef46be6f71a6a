"""A party's side of retention (``docs/algorithms.md``, Retention): the ``Retention`` context of one SFT round,
built from the instruction, the run's ``retention.*`` / ``train.*`` keys and the party's own work directory.

Owns the pre-task model kept at the party for output distillation: when an instruction's global weights
hash to its ``ref_hash`` (the hash of the global model at the start of the task, so the task's first round
as received), the party writes them to ``<work-dir>/retention/pretask-<hash>.safetensors`` (atomically,
replacing the previous task's) and uses them for the rest of the task. A party that missed that round
has no pre-task model of the task and trains without distillation (its progress line says so).

After a dynamic expert expansion (``retention.expand-experts``) the context freezes every expert but the newest
``k`` (and their router rows) for the round (``train/retention.frozen_masks``).

Must not: import ``flwr``, read another party's directory, or send anything (the context stays local).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from distmoe.config import RunConfig
from distmoe.io import write_text_atomic
from distmoe.model.build import hash_tensors
from distmoe.model.expand import frozen_set
from distmoe.routing.retention import check_task_anchors, protected_experts
from distmoe.rundir import WorkDir
from distmoe.train.retention import Retention
from distmoe.wire.schema import SftInstruction


def _pretask(work_dir: Path, instr: SftInstruction, weights: dict[str, torch.Tensor]
             ) -> dict[str, torch.Tensor] | None:
    from safetensors.torch import load_file, save

    files = WorkDir(work_dir)
    folder = files.retention
    path = files.pretask(instr.ref_hash[:32])
    if path.exists():
        return load_file(str(path))
    if hash_tensors(weights) != instr.ref_hash:
        return None  # the task's first round was missed: no pre-task model here
    folder.mkdir(parents=True, exist_ok=True)
    for old in files.pretask_files():
        old.unlink()
    write_text_atomic(path, save({k: v.contiguous() for k, v in weights.items()}))
    return {k: v.clone() for k, v in weights.items()}


def round_retention(cfg: RunConfig, work_dir: Path, instr: SftInstruction, layers: int, experts: int,
                    base_experts: int | None = None) -> Retention | None:
    """The round's ``Retention`` (None when no mechanism is on); ``ValueError`` on anchors that do not fit.
    ``base_experts``: the model's expert count before any expansion (``retention.expand-experts``: once the model
    has grown, every expert but the newest ``k`` is frozen)."""
    ret, train = cfg.retention, cfg.train
    r = Retention(task_anchor_reduce=ret.task_anchors, protect_lr_scale=ret.protect_lr_scale,
                  distill_weight=ret.distill_weight, distill_temperature=ret.distill_temperature,
                  router_warmup_steps=train.router_warmup_steps,
                  task_step_offset=max(instr.task_round - 1, 0) * train.local_steps)
    if instr.task_anchors is not None:
        anchors = torch.from_numpy(np.array(instr.task_anchors, dtype=np.float32, copy=True))  # [T, L, E]
        check_task_anchors(anchors, layers, experts)
        r.task_anchors = anchors
        if ret.protect:
            r.protected = protected_experts(anchors, ret.protect_mass)  # [L, E]
            r.notes.append(f"{int(r.protected.sum())} protected experts")
    if ret.distill_weight > 0 and instr.ref_hash:
        weights = {k: torch.from_numpy(np.array(v, dtype=np.float32, copy=True)) for k, v in instr.weights.items()}
        r.ref_state = _pretask(work_dir, instr, weights)
        if r.ref_state is None:
            r.notes.append("no pre-task model (missed the task's first round): no distillation")
    k = ret.expand_experts
    if k and base_experts is not None and experts > base_experts:
        r.frozen = frozen_set(layers, experts, k)  # [L, E]
        r.notes.append(f"{experts - k} of {experts} experts frozen (expansion)")
    on = (r.task_anchors is not None and r.task_anchor_reduce != "off") or r.protected is not None \
        or r.ref_state is not None or r.router_warmup_steps > 0 or r.frozen is not None
    return r if on else None


def drop_pretask(work_dir: Path) -> int:
    """Remove the pre-task reference copy of a run that has ended (``retention/pretask-*``): state a resume needs while
    the run can continue, nothing once it completed (a completed run is never resumed). Returns the bytes freed."""
    freed = 0
    for path in WorkDir(work_dir).pretask_files():
        freed += path.stat().st_size
        path.unlink()
    return freed

