"""Atomic checkpoints of the global model with a SHA-256 hash manifest.

Layout: ``checkpoints/round-<n>/`` holding ``trainable.safetensors`` (exactly the tensors that
travel), ``model/`` (a Hugging Face directory with config, weights and tokenizer, loadable with
``model.path``), and ``manifest.json`` (round, sha256 of every file, hash of the trainable
weights). A checkpoint is written into a hidden temporary directory, every file fsynced, then
renamed into place, and ``checkpoints/LATEST`` is replaced atomically: a crash never leaves a
half-written checkpoint under a real name. ``verify_checkpoint`` recomputes the hashes.

Must not: decide when to checkpoint (the ServerApp does) or read party data.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated or does not match its manifest."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with p.open("rb") as fh:
                os.fsync(fh.fileno())


def _export_model(model: nn.Module, tokenizer, out: Path) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no per-shard progress bars in the run log
    export = model
    if hasattr(model, "merge_and_unload"):  # peft: export merged weights so model.path can load it
        import copy

        export = copy.deepcopy(model).merge_and_unload()
    export.save_pretrained(out)
    tokenizer.save_pretrained(out)


def save_checkpoint(root: Path, round_num: int, model: nn.Module, tokenizer,
                    trainable: dict[str, torch.Tensor], trainable_hash: str, meta: dict | None = None,
                    keep: int = 2) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"round-{round_num}"
    tmp = root / f".tmp-round-{round_num}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file({k: v.contiguous() for k, v in trainable.items()}, str(tmp / "trainable.safetensors"))
        _export_model(model, tokenizer, tmp / "model")
        files = {str(p.relative_to(tmp)): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {"round": round_num, "time": time.time(), "trainable_hash": trainable_hash,
                    "files": files, **(meta or {})}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    latest_tmp = root / ".LATEST.tmp"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, root / "LATEST")
    _prune(root, keep)
    return final


def _prune(root: Path, keep: int) -> None:
    rounds = sorted((int(p.name.split("-")[1]), p) for p in root.glob("round-*") if p.is_dir())
    for _, p in rounds[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def verify_checkpoint(path: Path) -> dict:
    """Return the manifest if every file's hash matches; raise CheckpointError otherwise."""
    mf = path / "manifest.json"
    if not mf.exists():
        raise CheckpointError(f"{path}: no manifest.json (incomplete checkpoint)")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{mf}: corrupt manifest: {exc}") from None
    for rel, digest in manifest.get("files", {}).items():
        f = path / rel
        if not f.exists():
            raise CheckpointError(f"{path}: file {rel} is missing")
        if _sha256(f) != digest:
            raise CheckpointError(f"{path}: file {rel} does not match its hash (corrupted or truncated)")
    return manifest


def load_trainable_file(path: Path) -> dict[str, torch.Tensor]:
    verify_checkpoint(path)
    return load_file(str(path / "trainable.safetensors"))


def latest(root: Path) -> Path | None:
    p = root / "LATEST"
    if not p.exists():
        return None
    target = root / p.read_text().strip()
    return target if target.exists() else None
