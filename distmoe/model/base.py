"""The frozen base at a party: loaded once per process on its device and dtype, prepared for
training (``model.trainable``) and kept; and the base's fingerprint, computed once per checkpoint.

Loading once: Flower's Simulation Engine keeps a party's process (a Ray actor) across messages, so
the second and later messages of a run reuse the prepared model: ``prepared_model`` returns the
cached one after checking that nothing it was built from changed (the checkpoint's files, the
model and runtime settings). Every caller then loads the round's global trainable weights into it
(``load_trainable`` overwrites every trainable tensor), so nothing of an earlier message survives
in what is trained; gradients are dropped on reuse. In deployment every message starts a new
ClientApp process, so each message loads the base once: from safetensors, memory-mapped, directly
in ``train.dtype`` (no float32 copy) and, on CUDA, directly onto the device.

The fingerprint (``base_fingerprint``) identifies the base every node must share, instead of
hashing every weight in float32 on every message: SHA-256 over ``config.json``, the tokenizer's
files and each weight file's name, size and content hash. Content hashes are computed once per file
and cached in ``<checkpoint>/.distmoe-fingerprint.json`` keyed by (size, mtime); where the checkpoint
directory is read-only the cache lives in process memory only. For the tiny default (no files) it is
a hash of the seeded tiny weights, memoised per process.

Owns: the per-process cache of prepared models, the fingerprint and its sidecar.

Must not: read party data, download anything, or decide the wire format.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import astuple
from pathlib import Path

import torch
from torch import nn

from distmoe.config import ModelConfig
from distmoe.io import write_text_atomic
from distmoe.model.build import ModelError, build_model, hash_tensors, tiny_config
from distmoe.model.device import CPU, Runtime
from distmoe.model.trainable import apply_trainable

SIDECAR = ".distmoe-fingerprint.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# small files whose exact bytes every node must share: the architecture and the tokenisation
META_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")

_PREPARED: dict[tuple, tuple[nn.Module, object, tuple]] = {}
_FINGERPRINTS: dict[tuple, str] = {}


# ---------------------------------------------------------------------------------------------- fingerprint
def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def checkpoint_files(root: Path) -> tuple[list[Path], list[Path]]:
    """(meta files, weight files) of a checkpoint directory, sorted by name."""
    meta = sorted(p for p in root.iterdir() if p.name in META_FILES and p.is_file())
    weights = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    return meta, weights


def _weight_hashes(root: Path, weights: list[Path]) -> dict[str, str]:
    """Content hash of every weight file, from the sidecar when its (size, mtime) still match."""
    sidecar = root / SIDECAR
    try:
        cached = json.loads(sidecar.read_text(encoding="utf-8"))
        if not isinstance(cached, dict):
            cached = {}
    except (OSError, ValueError):
        cached = {}
    out, changed = {}, False
    for p in weights:
        size, mtime = _stamp(p)
        entry = cached.get(p.name)
        memo = _FINGERPRINTS.get((str(p), size, mtime))
        if isinstance(entry, dict) and entry.get("size") == size and entry.get("mtime_ns") == mtime \
                and isinstance(entry.get("sha256"), str):
            out[p.name] = entry["sha256"]
        elif memo is not None:
            out[p.name] = memo
        else:
            out[p.name] = _file_sha256(p)
            _FINGERPRINTS[(str(p), size, mtime)] = out[p.name]
            cached[p.name] = {"size": size, "mtime_ns": mtime, "sha256": out[p.name]}
            changed = True
    if changed and os.access(root, os.W_OK):
        try:
            write_text_atomic(sidecar, json.dumps({k: cached[k] for k in sorted(cached)}, indent=1) + "\n")
        except OSError:
            pass  # a read-only or full volume: the process memo still spares a second hash in this process
    return out


def base_fingerprint(cfg: ModelConfig, model_path: str = "") -> str:
    """The identity of the frozen base every node must share (see the module docstring)."""
    path = model_path or cfg.path
    if not path:
        tiny = (cfg.seed, cfg.hidden_size, cfg.layers, cfg.experts, cfg.top_k, cfg.moe_intermediate_size,
                cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.max_seq_len)
        key = ("tiny", *tiny)
        if key not in _FINGERPRINTS:
            model, _ = build_model(cfg)
            h = hashlib.sha256(b"distmoe-tiny-v1")
            h.update(json.dumps(tiny_config(cfg, model.config.vocab_size).to_dict(), sort_keys=True).encode())
            h.update(hash_tensors(dict(model.named_parameters())).encode())
            _FINGERPRINTS[key] = h.hexdigest()
        return _FINGERPRINTS[key]
    root = Path(path)
    if not root.is_dir():
        raise ModelError(f"model.path {str(root)!r}: not a directory (expected a local Hugging Face checkpoint)")
    meta, weights = checkpoint_files(root)
    if not weights:
        raise ModelError(f"model.path {str(root)!r}: no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    h = hashlib.sha256(b"distmoe-checkpoint-v1")
    for p in meta:
        h.update(p.name.encode() + b"\0" + _file_sha256(p).encode())
    for name, digest in _weight_hashes(root, weights).items():
        h.update(name.encode() + b"\0" + str((root / name).stat().st_size).encode() + b"\0" + digest.encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- the cache
def _source_stamp(cfg: ModelConfig, model_path: str) -> tuple:
    path = model_path or cfg.path
    if not path:
        return ()
    meta, weights = checkpoint_files(Path(path))
    return tuple((p.name, *_stamp(p)) for p in meta + weights)


def prepared_model(cfg: ModelConfig, model_path: str = "", rt: Runtime = CPU) -> tuple[nn.Module, object]:
    """``(model, tokenizer)``: the base on ``rt``, prepared per ``model.trainable``; cached per process.

    The returned model's trainable tensors hold whatever the last caller left in them: load the
    global weights (``load_trainable``) before using it.
    """
    key = (astuple(cfg), model_path, rt.key)
    stamp = _source_stamp(cfg, model_path)
    hit = _PREPARED.get(key)
    if hit is not None and hit[2] == stamp:
        model, tok, _ = hit
        for p in model.parameters():
            p.grad = None
        model.eval()
        return model, tok
    _PREPARED.clear()  # one base per process: a different one replaces it (memory stays one model)
    model, tok = build_model(cfg, model_path, rt)
    model = apply_trainable(model, cfg)
    keep_trainable_fp32(model)
    model.eval()
    _PREPARED[key] = (model, tok, stamp)
    return model, tok


def is_cached(cfg: ModelConfig, model_path: str = "", rt: Runtime = CPU) -> bool:
    """Whether ``prepared_model`` would reuse this process's model (for progress lines)."""
    hit = _PREPARED.get((astuple(cfg), model_path, rt.key))
    return hit is not None and hit[2] == _source_stamp(cfg, model_path)


def keep_trainable_fp32(model: nn.Module) -> None:
    """Trainable tensors in float32 (master weights), whatever the base's dtype (see ``device.py``)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.to(torch.float32)


def clear_cache() -> None:
    """Drop the cached model (tests; or to free memory)."""
    _PREPARED.clear()
