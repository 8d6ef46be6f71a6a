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

``load_start`` returns the round-0 state as a ``StartPoint``; the round loop adopts and records it.

Must not: talk to parties, write into the run's state, or choose a resumed run's checkpoint (``resume.restore``
does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from distmoe.checkpoint import CheckpointError, load_checkpoint
from distmoe.config import RunConfig
from distmoe.coordinator.errors import RunFailed
from distmoe.model.adapters import ServerModel
from distmoe.model.build import hash_tensors
from distmoe.model.trainable import TrainableError, TrainableSpec, check_trainable
from distmoe.routing.anchor import Anchor, AnchorVersion
from distmoe.rundir import RunDir
from distmoe.train.warmup import BaseError, build_base


@dataclass(frozen=True)
class StartPoint:
    """Round 0 of a new run taken from a checkpoint: its weights, anchor (or None) with the version count, and
    what ``run.json`` ``started_from`` records."""

    weights: dict[str, torch.Tensor]
    anchor: Anchor | None
    anchor_versions: int
    info: dict
    where: str


def start_point(cfg: RunConfig, run_dir: Path, say: Callable[[str], None]) -> Path | None:
    """The checkpoint this new run starts from (the warm-up base is built here when not cached), or None."""
    if cfg.model.warmup_steps:
        cache = Path(cfg.model.warmup_cache) if cfg.model.warmup_cache else RunDir(run_dir).base_cache
        try:
            return build_base(cfg, cfg.model.warmup_steps, cache, log=say)
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


def load_start(cfg: RunConfig, run_dir: Path, model: ServerModel, say: Callable[[str], None]) -> StartPoint | None:
    """``start_point``'s weights (and anchor), verified against this run's ``model``; None without a start point."""
    path = start_point(cfg, run_dir, say)
    if path is None:
        return None
    where = f"run.init-from {str(path)!r}" if cfg.run.init_from else f"warm-up base {str(path)!r}"
    if not path.is_dir():
        raise RunFailed(f"{where}: not a directory (expected a checkpoint directory such as "
                        "RUN/checkpoints/round-<n>; `distmoe rollback RUN --list` shows the kept rounds)")
    manifest, weights, extra, state = read_checkpoint(path, where)
    verify_weights(weights, manifest, model.tspec, model.base_fingerprint, where)
    anchor, versions = None, 0
    anchor_meta = (state or {}).get("anchor")
    if anchor_meta is not None and "anchor" in extra:
        probs = extra["anchor"]["probs"].numpy().astype(np.float32)
        want = (model.mspec.num_moe_layers, model.mspec.num_experts)
        if probs.shape != want:
            raise RunFailed(f"{where}: its anchor is {list(probs.shape)}, this model routes {list(want)}")
        anchor = Anchor(probs=probs, meta=AnchorVersion(**anchor_meta))
        versions = int((state or {}).get("anchor_versions") or anchor_meta.get("version") or 1)
    info = {"checkpoint": str(path), "round": manifest.get("round"), "run_id": manifest.get("run_id"),
            "trainable_hash": manifest.get("trainable_hash"),
            "anchor_version": anchor.meta.version if anchor is not None else None}
    if "base" in manifest:
        info["base"] = manifest["base"]
    return StartPoint(weights, anchor, versions, info, where)


def start_line(sp: StartPoint) -> str:
    """The progress line of a run started from ``sp``."""
    info = sp.info
    return (f"start: round 0 from {sp.where} (round {info['round']} of run {info['run_id'] or '-'}"
            + (f", anchor v{info['anchor_version']})" if info["anchor_version"] is not None else ", no anchor)"))
