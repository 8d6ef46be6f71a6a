"""``distmoe export RUN_DIR``: a run's checkpoint as a standalone Hugging Face model directory.

Owns: reading the run's config (``RUN_DIR/config.toml``), picking the checkpoint (``checkpoints/LATEST`` or
``--round N``) and verifying it against its manifest, then writing ``--out`` (default
``RUN_DIR/export/round-<n>``) atomically (a hidden temporary directory renamed into place):

- an adapter checkpoint (``lora``: ``adapter/``): the base is loaded from ``model.path`` of the run's config,
  or ``--model-path`` (each owner keeps its own copy), its fingerprint checked against the one in the manifest
  (the base the run trained on), the adapters applied with ``peft`` and merged
  (``distmoe.model.adapters.merge_adapters``); written in the dtype the base's ``config.json`` declares,
  with the base's tokenizer;
- a full checkpoint (``all``, ``router+experts``: ``model/``): that directory, copied.

The result loads with ``AutoModelForCausalLM.from_pretrained(out)`` (and as ``model.path`` of a new run).

Must not: change anything in the run directory but ``export/`` (the default output), or download anything.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from distmoe.checkpoint import CheckpointError, latest, verify_checkpoint
from distmoe.config import RENAMED, RETIRED, ConfigError, RunConfig, load_override_file, parse_run_config
from distmoe.model.adapters import ADAPTER_DIR, MODEL_DIR, merge_adapters
from distmoe.model.base import base_fingerprint
from distmoe.model.build import ModelError

DTYPES = ("float32", "bfloat16", "float16")


class ExportError(ValueError):
    """The run directory, its checkpoint or the base model cannot be exported (the message says why)."""


def run_config(run_dir: Path) -> RunConfig:
    """The run's config as it was resolved (``config.toml``; keys renamed since are read under their new name)."""
    path = run_dir / "config.toml"
    if not path.is_file():
        raise ExportError(f"{run_dir}: no config.toml (not a distmoe run directory?)")
    flat = {RENAMED.get(k, k): v for k, v in load_override_file(path).items() if k in RENAMED or k not in RETIRED}
    try:
        return parse_run_config(flat)
    except ConfigError as exc:
        raise ExportError(f"{path}: {exc}") from None


def pick_checkpoint(run_dir: Path, round_num: int | None = None) -> tuple[Path, dict]:
    """``(checkpoint dir, verified manifest)``: round ``round_num``, else the newest (``LATEST``)."""
    root = run_dir / "checkpoints"
    if round_num is None:
        path = latest(root)
        if path is None:
            raise ExportError(f"{run_dir}: no checkpoint (no {root / 'LATEST'} naming an existing round directory)")
    else:
        path = root / f"round-{round_num}"
        if not path.is_dir():
            have = sorted(p.name for p in root.glob("round-*")) if root.is_dir() else []
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


def export_run(run_dir: str | Path, round_num: int | None = None, out: str | Path | None = None,
               model_path: str = "") -> Path:
    """Write the checkpoint of ``run_dir`` as a standalone Hugging Face directory; returns it."""
    import torch

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    cfg = run_config(run_dir)
    ck, manifest = pick_checkpoint(run_dir, round_num)
    files = manifest.get("files", {})
    target = Path(out) if out is not None else run_dir / "export" / ck.name
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ExportError(f"--out {target}: exists and is not an empty directory")
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        if f"{MODEL_DIR}/config.json" in files:
            shutil.copytree(ck / MODEL_DIR, tmp)
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
