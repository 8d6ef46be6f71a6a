"""Checkpoints store each content once: hard links for files equal to one already written, each checkpoint
directory still whole (verifies, loads, survives the pruning of another)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from distmoe.checkpoint import _prune, disk_bytes, load_checkpoint, save_checkpoint, verify_checkpoint
from distmoe.config import parse_run_config
from distmoe.model.adapters import server_model
from distmoe.model.build import build_model, hash_tensors

TINY = {"model.hidden-size": 64, "model.moe-intermediate-size": 64, "model.layers": 2, "model.heads": 2,
        "model.kv-heads": 1, "model.head-dim": 32, "model.experts": 4, "model.top-k": 2}


def _ino(p: Path) -> int:
    return p.stat().st_ino


def test_a_full_model_checkpoint_stores_its_weights_once_and_still_loads(tmp_path: Path):
    cfg = parse_run_config(TINY)
    sm = server_model(cfg.model)
    w0 = {k: v.clone() for k, v in sm.weights.items()}
    root = tmp_path / "checkpoints"
    save = lambda rnd, w, **kw: save_checkpoint(root, rnd, w, hash_tensors(w), keep=10,  # noqa: E731
                                                write_model=lambda d: sm.save(d, w), **kw)
    c0 = save(0, w0, tensors={"ref": w0})
    # the full model's weights, the trainable weights and the reference weights: one content, one inode
    assert (_ino(c0 / "model" / "model.safetensors") == _ino(c0 / "trainable.safetensors")
            == _ino(c0 / "ref.safetensors"))
    w1 = {k: v + 0.01 for k, v in w0.items()}
    c1 = save(1, w1, tensors={"ref": w0})  # a training round: new weights, the reference is round 0's
    assert _ino(c1 / "trainable.safetensors") != _ino(c0 / "trainable.safetensors")
    assert _ino(c1 / "ref.safetensors") == _ino(c0 / "trainable.safetensors")
    c2 = save(2, w1, tensors={"ref": w0})  # an evaluation round: nothing changed, nothing stored again
    weight = (c1 / "trainable.safetensors").stat().st_size
    assert disk_bytes(root) < 2.2 * weight  # two weight contents (rounds 0 and 1), not 9 weight files
    for c in (c0, c1, c2):
        verify_checkpoint(c)
    # pruning round 0 (it owned the first copy of the reference) leaves round 1 and 2 whole
    _prune(root, keep=2)
    assert not c0.exists()
    _, trainable, extra, _ = load_checkpoint(c2)
    assert all(torch.equal(extra["ref"][k], w0[k]) and torch.equal(trainable[k], w1[k]) for k in w0)
    model, _ = build_model(cfg.model, model_path=str(c2 / "model"))  # model/ loads as a Hugging Face model
    params = dict(model.named_parameters())
    assert all(torch.equal(params[k], w1[k]) for k in w1)
    assert os.stat(c2 / "model" / "model.safetensors").st_nlink >= 2
