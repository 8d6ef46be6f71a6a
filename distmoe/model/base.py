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
from distmoe.io import file_sha256, write_text_atomic
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
            out[p.name] = file_sha256(p)
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
        h.update(p.name.encode() + b"\0" + file_sha256(p).encode())
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


def prepared_model(cfg: ModelConfig, model_path: str = "", rt: Runtime = CPU,
                   cache_dir: Path | None = None) -> tuple[nn.Module, object]:
    """``(model, tokenizer)``: the base on ``rt``, prepared per ``model.trainable``; cached per process.

    ``cache_dir`` (a party's ``base-cache``): where the loaded base is kept as one memory-mappable file so
    that the next process maps it instead of loading the checkpoint again (see ``mapped_base``).
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
    path = model_path or cfg.path
    # (a model with a routing bias, routing.balance "bias", is not mapped: the bias is not part of the checkpoint)
    # (nor are 4-bit experts, model.quantize-experts: they are quantised while the checkpoint loads, and the cache
    # would hold the full-precision base the 4-bit load exists to avoid)
    keep = (bool(path) and cache_dir is not None and rt.quantize == "none" and not cfg.balance_bias
            and cfg.quantize_experts == "none")
    fingerprint = base_fingerprint(cfg, model_path) if keep else ""
    mapped = mapped_base(Path(path), cache_dir, fingerprint, rt) if keep else None
    if mapped is not None:
        model, tok = mapped
    else:
        model, tok = build_model(cfg, model_path, rt)
        if keep:
            write_mapped_base(model, cache_dir, fingerprint, rt)
    model = apply_trainable(model, cfg)
    keep_trainable_fp32(model)
    model.eval()
    _PREPARED[key] = (model, tok, stamp)
    return model, tok


# ---------------------------------------------------------------------------------------------- the mapped base
def _mapped_file(cache_dir: Path, fingerprint: str, rt: Runtime) -> Path:
    import transformers

    dtype = str(rt.dtype).removeprefix("torch.")
    return cache_dir / f"base-{fingerprint[:20]}-{dtype}-tf{transformers.__version__}.pt"


def write_mapped_base(model: nn.Module, cache_dir: Path, fingerprint: str, rt: Runtime) -> Path:
    """Keep the freshly loaded base (its state and every buffer, in its dtype, in the in-memory layout, e.g.
    fused experts) as one file for ``torch.load(mmap=True)``; other bases' files in ``cache_dir`` are removed
    (one base per party). Written to a temporary name and renamed: a reader sees all of it or nothing."""
    target = _mapped_file(cache_dir, fingerprint, rt)
    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    buffers = {k: v.detach().to("cpu") for k, v in model.named_buffers()}
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(tmp, "wb", opener=lambda p, f: os.open(p, f, 0o600)) as fh:
        torch.save({"fingerprint": fingerprint, "state": state, "buffers": buffers}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, target)
    for old in cache_dir.glob("base-*.pt"):
        if old != target:
            old.unlink(missing_ok=True)
    size = target.stat().st_size / 2**30
    print(f"distmoe: kept the prepared base ({size:.2f} GB) in {target} so that the next messages map it instead "
          "of loading the checkpoint (node config base-cache = \"off\" to disable)", flush=True)
    return target


def mapped_base(path: Path, cache_dir: Path, fingerprint: str, rt: Runtime) -> tuple[nn.Module, object] | None:
    """The base mapped from its cache file (no copy: the tensors are the page cache's pages, shared by every
    process of this owner; on an accelerator they are copied there once), or None when there is none yet.

    The architecture is built on the ``meta`` device from ``config.json`` and the mapped tensors are assigned
    to it; a file that does not fit the architecture is ignored (and rebuilt by the caller)."""
    file = _mapped_file(cache_dir, fingerprint, rt)
    if not file.is_file():
        return None
    from transformers import AutoModelForCausalLM, GenerationConfig

    from distmoe.model.build import finish_loaded, read_hf_config

    try:
        saved = torch.load(file, mmap=True, weights_only=True)
        if saved.get("fingerprint") != fingerprint:
            return None
        hf_cfg = read_hf_config(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_cfg, dtype=rt.dtype)
        model.load_state_dict(saved["state"], assign=True, strict=True)
        for name, buf in saved["buffers"].items():
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = buf
        if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            return None
        model.tie_weights()
    except (RuntimeError, KeyError, ValueError, OSError, AttributeError):
        return None  # a stale or foreign file: load the checkpoint and rewrite it
    try:
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        pass  # no generation_config.json: the model config's defaults, as from_pretrained would use
    if rt.device.type != "cpu":
        model = model.to(rt.device)
    model.eval()
    return model, finish_loaded(model, path)


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
