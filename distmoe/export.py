"""``distmoe export RUN_DIR``: a run's checkpoint as a standalone Hugging Face model directory.

Owns: reading the run's config (``RUN_DIR/config.toml``), picking the checkpoint (``checkpoints/LATEST`` or
``--round N``) and verifying it against its manifest, then writing ``--out`` (default
``RUN_DIR/export/round-<n>``) atomically (a hidden temporary directory renamed into place):

- an adapter checkpoint (``lora``: ``adapter/``): the base is loaded from ``model.path`` of the run's config,
  or ``--model-path`` (each owner keeps its own copy), its fingerprint checked against the one in the manifest
  (the base the run trained on), the adapters applied with ``peft`` and merged
  (``distmoe.model.adapters.merge_adapters``); written in the dtype the base's ``config.json`` declares,
  with the base's tokenizer;
- a full checkpoint (``all``, ``router+experts``: ``model/``): that directory, copied. A run with a routing bias
  (``routing.balance`` ``bias`` / ``aux+bias``) is refused unless ``drop_routing_bias``: the bias
  (``<router>.balance_bias``, ``distmoe.model.balance``) chooses the experts and no Hugging Face MoE class of the
  supported families has a slot for it, so ``from_pretrained`` would silently drop it (a report line) and the
  exported model would route differently from the one trained and evaluated. With the flag the bias tensors are
  removed from the weight files (and the shard index), so the load is clean and the difference is explicit.

The result loads with ``AutoModelForCausalLM.from_pretrained(out)`` (and as ``model.path`` of a new run).

Must not: change anything in the run directory but ``export/`` (the default output), or download anything.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from distmoe.checkpoint import CheckpointError, kept_rounds, latest, round_dir, verify_checkpoint
from distmoe.config import RENAMED, RETIRED, ConfigError, RunConfig, load_override_file, parse_run_config
from distmoe.model.adapters import ADAPTER_DIR, MODEL_DIR, merge_adapters
from distmoe.model.balance import BIAS_NAME
from distmoe.model.base import base_fingerprint
from distmoe.model.build import ModelError
from distmoe.rundir import RunDir

DTYPES = ("float32", "bfloat16", "float16")


class ExportError(ValueError):
    """The run directory, its checkpoint or the base model cannot be exported (the message says why)."""


def run_config(run_dir: Path) -> RunConfig:
    """The run's config as it was resolved (``config.toml``; keys renamed since are read under their new name)."""
    path = RunDir(run_dir).config
    if not path.is_file():
        raise ExportError(f"{run_dir}: no {path.name} (not a distmoe run directory?)")
    flat = {RENAMED.get(k, k): v for k, v in load_override_file(path).items() if k in RENAMED or k not in RETIRED}
    try:
        return parse_run_config(flat)
    except ConfigError as exc:
        raise ExportError(f"{path}: {exc}") from None


def pick_checkpoint(run_dir: Path, round_num: int | None = None) -> tuple[Path, dict]:
    """``(checkpoint dir, verified manifest)``: round ``round_num``, else the newest (``LATEST``)."""
    root = RunDir(run_dir).checkpoints
    if round_num is None:
        path = latest(root)
        if path is None:
            raise ExportError(f"{run_dir}: no checkpoint (no {root / 'LATEST'} naming an existing round directory)")
    else:
        path = round_dir(root, round_num)
        if not path.is_dir():
            have = [p.name for _, p, _ in kept_rounds(root)] if root.is_dir() else []
            raise ExportError(f"{run_dir}: no checkpoint for round {round_num} (have: {', '.join(have) or 'none'})")
    try:
        return path, verify_checkpoint(path)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None


def _declared_dtype(model_path: str) -> str:
    """The dtype a base checkpoint's ``config.json`` declares (float32 for the tiny default or when unknown)."""
    if not model_path:
        return "float32"
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    return dtype if dtype in DTYPES else "float32"


def _bias_keys(model_dir: Path) -> dict[str, list[str]]:
    """``{weight file name: [routing-bias tensor names]}`` of a ``model/`` directory (files without one left out)."""
    found = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            keys = [k for k in sf.keys() if k.endswith("." + BIAS_NAME)]
        if keys:
            found[f.name] = keys
    return found


def _drop_bias(model_dir: Path, found: dict[str, list[str]]) -> None:
    """Rewrite the weight files of ``found`` without their routing-bias tensors, and the shard index's map."""
    for name, keys in found.items():
        path = model_dir / name
        with safe_open(str(path), framework="pt") as sf:
            meta = sf.metadata() or {}
        tensors = {k: v for k, v in load_file(str(path)).items() if k not in keys}
        save_file(tensors, str(path), metadata={**meta, "format": meta.get("format", "pt")})
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        dropped = {k for keys in found.values() for k in keys}
        data["weight_map"] = {k: v for k, v in data.get("weight_map", {}).items() if k not in dropped}
        index.write_text(json.dumps(data, indent=2))


def export_run(run_dir: str | Path, round_num: int | None = None, out: str | Path | None = None,
               model_path: str = "", drop_routing_bias: bool = False) -> Path:
    """Write the checkpoint of ``run_dir`` as a standalone Hugging Face directory; returns it.

    A ``model/`` checkpoint with a routing bias raises ``ExportError`` unless ``drop_routing_bias`` (module
    docstring)."""
    import torch

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    cfg = run_config(run_dir)
    ck, manifest = pick_checkpoint(run_dir, round_num)
    files = manifest.get("files", {})
    target = Path(out) if out is not None else RunDir(run_dir).export / ck.name
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ExportError(f"--out {target}: exists and is not an empty directory")
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        if f"{MODEL_DIR}/config.json" in files:
            found = _bias_keys(ck / MODEL_DIR)
            if found and not drop_routing_bias:
                n = sum(len(k) for k in found.values())
                raise ExportError(f"{ck / MODEL_DIR}: the run trained with a routing bias (routing.balance = "
                                  f"{cfg.routing.balance!r}: {n} '{BIAS_NAME}' tensors, one per MoE layer), which "
                                  "chooses the experts and has no slot in the Hugging Face model class; "
                                  "from_pretrained would drop it and the exported model would route differently "
                                  "from the one trained. Start new runs from the checkpoint itself (run.init-from, "
                                  "with the same routing.balance, keeps the bias), or pass --drop-routing-bias to "
                                  "export the model without it")
            shutil.copytree(ck / MODEL_DIR, tmp)
            if found:
                _drop_bias(tmp, found)
        elif f"{ADAPTER_DIR}/adapter_config.json" in files:
            base = model_path or cfg.model.path
            want = manifest.get("base_fingerprint")
            try:
                have = base_fingerprint(cfg.model, base)
                if want and have != want:
                    raise ExportError(f"the base model {base or '(tiny default)'!r} is not the one run {run_dir} "
                                      f"trained on (fingerprint {have[:12]}, the checkpoint's {want[:12]}); pass "
                                      "--model-path with the run's base checkpoint")
                merged, tok = merge_adapters(cfg.model, ck / ADAPTER_DIR, base)
            except ModelError as exc:
                raise ExportError(str(exc)) from None
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            merged.to(getattr(torch, _declared_dtype(base))).save_pretrained(tmp)
            tok.save_pretrained(tmp)
        else:
            raise ExportError(f"{ck}: holds neither {MODEL_DIR}/ nor {ADAPTER_DIR}/ (nothing to export)")
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
