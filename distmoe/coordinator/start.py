"""Where a new run starts: the global weights and anchor of round 0 from a checkpoint (``run.init-from``:
a kept round of an earlier run, ``distmoe rollback``) or from the cached warm-up base
(``model.warmup-steps``, ``distmoe.train.warmup``), instead of the model's own initialisation.

What is taken: the trainable weights (checked against this run's model: keys, shapes, finite values,
the manifest's hash, and in ``lora`` mode the base fingerprint) and, when the checkpoint holds one, the
router anchor (with its version metadata: the next ``stats`` release makes version ``n + 1``). What is
not: the schedule position, tasks, evaluations, ledgers and privacy accounting; the new run has its own
(``docs/operations.md``, Rollback).

Also owns reading a checkpoint of the global model and verifying its weights (:func:`read_checkpoint`,
:func:`verify_weights`), which a resumed run uses on its own checkpoint too.

Must not: talk to parties, or choose a resumed run's checkpoint (``resume.restore`` does).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from distmoe.checkpoint import CheckpointError, load_checkpoint
from distmoe.coordinator.errors import RunFailed
from distmoe.model.build import hash_tensors
from distmoe.model.trainable import TrainableError, TrainableSpec, check_trainable
from distmoe.routing.anchor import Anchor, AnchorVersion
from distmoe.train.warmup import BaseError, build_base

if TYPE_CHECKING:
    from distmoe.coordinator.loop import Coordinator


def start_point(co: Coordinator) -> Path | None:
    """The checkpoint this new run starts from (the warm-up base is built here when not cached), or None."""
    cfg = co.cfg
    if cfg.model.warmup_steps:
        cache = Path(cfg.model.warmup_cache) if cfg.model.warmup_cache else co.run_dir.parent / "base-cache"
        try:
            return build_base(cfg, cfg.model.warmup_steps, cache, log=co.say)
        except BaseError as exc:
            raise RunFailed(str(exc)) from None
    return Path(cfg.run.init_from) if cfg.run.init_from else None


def read_checkpoint(path: Path, where: str) -> tuple[dict, dict[str, torch.Tensor], dict, dict | None]:
    """``(manifest, trainable weights in float32, extra tensor files, state)`` of the checkpoint at ``path``;
    ``RunFailed`` naming ``where`` when it does not verify against its manifest."""
    try:
        manifest, weights, extra, state = load_checkpoint(path)
    except CheckpointError as exc:
        raise RunFailed(f"{where}: {exc}") from None
    return manifest, {k: v.to(torch.float32) for k, v in weights.items()}, extra, state


def verify_weights(weights: dict[str, torch.Tensor], manifest: dict, tspec: TrainableSpec, base_fingerprint: str,
                   where: str) -> None:
    """``RunFailed`` naming ``where`` unless the weights fit this run's model (keys, shapes, finite values), match
    the manifest's hash and were trained on this run's base (``lora`` mode: the adapters' base fingerprint)."""
    try:
        check_trainable(weights, tspec)
    except TrainableError as exc:
        raise RunFailed(f"{where}: the checkpoint does not fit this run's model ({tspec.mode}): {exc}") from None
    if hash_tensors(weights) != manifest.get("trainable_hash"):
        raise RunFailed(f"{where}: trainable weights do not match the manifest's trainable_hash")
    theirs = manifest.get("base_fingerprint", base_fingerprint)
    if theirs != base_fingerprint:
        raise RunFailed(f"{where}: the adapters were trained on another base model (fingerprint {theirs[:12]}, "
                        f"this run's base {base_fingerprint[:12]})")


def apply_start(co: Coordinator) -> None:
    """Load ``start_point``'s weights (and anchor) into the coordinator's round-0 state."""
    path = start_point(co)
    if path is None:
        return
    where = f"run.init-from {str(path)!r}" if co.cfg.run.init_from else f"warm-up base {str(path)!r}"
    if not path.is_dir():
        raise RunFailed(f"{where}: not a directory (expected a checkpoint directory such as "
                        "RUN/checkpoints/round-<n>; `distmoe rollback RUN --list` shows the kept rounds)")
    manifest, weights, extra, state = read_checkpoint(path, where)
    verify_weights(weights, manifest, co.tspec, co.model.base_fingerprint, where)
    co.s.weights = weights
    anchor_meta = (state or {}).get("anchor")
    if anchor_meta is not None and "anchor" in extra:
        probs = extra["anchor"]["probs"].numpy().astype(np.float32)
        want = (co.mspec.num_moe_layers, co.mspec.num_experts)
        if probs.shape != want:
            raise RunFailed(f"{where}: its anchor is {list(probs.shape)}, this model routes {list(want)}")
        co.s.anchor = Anchor(probs=probs, meta=AnchorVersion(**anchor_meta))
        co.s.anchor_versions = int((state or {}).get("anchor_versions") or anchor_meta.get("version") or 1)
    info = {"checkpoint": str(path), "round": manifest.get("round"), "run_id": manifest.get("run_id"),
            "trainable_hash": manifest.get("trainable_hash"),
            "anchor_version": co.s.anchor.meta.version if co.s.anchor is not None else None}
    if "base" in manifest:
        info["base"] = manifest["base"]
    co.record.update(started_from=info)
    co.metrics.append({"event": "start_from", **info})
    co.say(f"start: round 0 from {where} (round {info['round']} of run {info['run_id'] or '-'}"
           + (f", anchor v{info['anchor_version']})" if info["anchor_version"] is not None else ", no anchor)"))
