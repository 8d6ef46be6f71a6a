"""Atomic checkpoints of the global model with a SHA-256 hash manifest.

Layout: ``checkpoints/round-<n>/`` holding ``trainable.safetensors`` (exactly the tensors that
travel), the model in the form its trainable mode calls for (written by the caller's ``write_model``:
``adapter/`` in ``lora`` mode, peft's ``adapter_model.safetensors`` + ``adapter_config.json`` with the base
fingerprint in the manifest; ``model/`` otherwise, a Hugging Face directory with config, weights and
tokenizer, loadable with ``model.path``), and ``manifest.json`` (round, sha256 of every file, hash of the
trainable weights). A checkpoint is written into a hidden temporary directory, every file fsynced, then
renamed into place, and ``checkpoints/LATEST`` is replaced atomically: a crash never leaves a
half-written checkpoint under a real name. ``verify_checkpoint`` recomputes the hashes. Each content is stored
once: a file equal (SHA-256) to one already written under ``checkpoints/`` is a hard link to it
(``_link_duplicates``), so a round that changes no weights, the reference weights and a full model's
``model/`` weights cost no second copy. A checkpoint whose
manifest says ``kept`` (the coordinator pins the initial model and the model before each task) is never
pruned; ``checkpoint.keep`` counts the others.

Resume state: a checkpoint may also hold ``state.json`` (the coordinator's state at that round
boundary: schedule position, tasks, anchor version and file hash, last evaluation, ...) and extra
tensor files (``ref.safetensors``: the reference weights for retention), all in the manifest. The model
and the state of one round therefore stand or fall together: falling back to an older checkpoint falls
back both consistently. ``resumable`` picks the newest checkpoint that verifies; each newer one that does
not (truncated, corrupted, no manifest) is moved aside to ``corrupt-round-<n>-<time>`` with a warning
(kept for inspection, never used), and leftover ``.tmp-round-*`` directories of an interrupted write are
removed.

Must not: decide when to checkpoint (the ServerApp does) or read party data.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from distmoe.io import file_sha256, fsync_dir, write_text_atomic
from distmoe.rundir import RunDir

SAFETENSORS_META = {"format": "pt"}  # every tensor file as transformers writes it (equal tensors, equal bytes)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated or does not match its manifest."""


def round_dir(root: Path, round_num: int) -> Path:
    """The checkpoint of round ``round_num`` in the checkpoints folder ``root`` (``RunDir.checkpoints``)."""
    return Path(root) / f"round-{int(round_num)}"


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with p.open("rb") as fh:
                os.fsync(fh.fileno())


def save_checkpoint(root: Path, round_num: int, trainable: dict[str, torch.Tensor], trainable_hash: str, *,
                    write_model: Callable[[Path], object] | None = None, meta: dict | None = None,
                    keep: int = 2, state: dict | None = None,
                    tensors: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """Write ``round-<round_num>`` atomically; ``write_model(dir)`` writes the model's files into the checkpoint
    directory (a subdirectory: ``adapter/`` or ``model/``), ``state`` (JSON) and ``tensors`` (name -> tensors,
    each written as ``<name>.safetensors``) travel inside it; all of it is covered by the manifest."""
    root.mkdir(parents=True, exist_ok=True)
    final = round_dir(root, round_num)
    tmp = root / f".tmp-round-{round_num}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file({k: v.contiguous() for k, v in trainable.items()}, str(tmp / "trainable.safetensors"),
                  metadata=SAFETENSORS_META)
        for name, group in (tensors or {}).items():
            if name in ("trainable", "manifest", "state") or not name.isidentifier():
                raise ValueError(f"checkpoint tensor file name {name!r} is reserved or not an identifier")
            save_file({k: v.contiguous() for k, v in group.items()}, str(tmp / f"{name}.safetensors"),
                      metadata=SAFETENSORS_META)
        if state is not None:
            (tmp / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True, allow_nan=False))
        if write_model is not None:
            write_model(tmp)
        files = {str(p.relative_to(tmp)): file_sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        _link_duplicates(root, tmp, files)
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
    fsync_dir(root)
    write_text_atomic(root / "LATEST", final.name + "\n")
    _prune(root, keep)
    return final


def _link_duplicates(root: Path, tmp: Path, files: dict[str, str]) -> None:
    """Store each file's content once: a file of the new checkpoint ``tmp`` whose SHA-256 equals a file already
    written (earlier in ``tmp``, or in a checkpoint under ``root``) becomes a hard link to it. Checkpoint files
    are never written again once in place, so a link changes nothing a reader sees: every checkpoint directory
    stays whole (its manifest, ``verify_checkpoint``, a copy, ``distmoe export``), and pruning one directory
    leaves the content of the others. Typical links: a round that changes no weights (evaluation, statistics),
    the reference weights (``ref``: the model of an earlier round), ``model/model.safetensors`` of a model whose
    every weight trains (byte-identical to ``trainable.safetensors``, ``distmoe.model.adapters``). A file
    system without hard links keeps the copies."""
    known: dict[str, Path] = {}
    for _, d in _round_dirs(root):
        try:
            for rel, digest in json.loads((d / "manifest.json").read_text()).get("files", {}).items():
                if (d / rel).is_file():
                    known.setdefault(digest, d / rel)
        except (OSError, ValueError, AttributeError):
            continue
    for rel, digest in files.items():
        new = tmp / rel
        src = known.get(digest)
        if src is None or src == new:
            known.setdefault(digest, new)
            continue
        if src.stat().st_size != new.stat().st_size or file_sha256(src) != digest:  # never trust a stale manifest
            continue
        link = new.with_name(new.name + ".link")
        try:
            os.link(src, link)
            os.replace(link, new)
        except OSError:
            link.unlink(missing_ok=True)


def disk_bytes(root: Path) -> int:
    """Bytes under ``root``, each stored file once (hard links counted once)."""
    seen, total = set(), 0
    for p in Path(root).rglob("*"):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def _round_dirs(root: Path) -> list[tuple[int, Path]]:
    out = []
    for p in root.glob("round-*"):
        tail = p.name[len("round-"):]
        if p.is_dir() and tail.isdigit():
            out.append((int(tail), p))
    return sorted(out)


def kept_reason(path: Path) -> str | None:
    """Why the checkpoint at ``path`` is never pruned (its manifest's ``kept``), or None."""
    try:
        reason = json.loads((path / "manifest.json").read_text()).get("kept")
    except (OSError, json.JSONDecodeError):
        return None
    return str(reason) if reason else None


def _prune(root: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` checkpoints, except the pinned ones (``kept`` in the manifest: the
    initial model and the model before each task), which are never pruned and do not count against ``keep``."""
    rounds = [(n, p) for n, p in _round_dirs(root) if kept_reason(p) is None]
    for _, p in rounds[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def kept_rounds(root: Path) -> list[tuple[int, Path, str | None]]:
    """Every checkpoint under ``root``: (round, directory, why it is pinned or None), oldest first."""
    return [(n, p, kept_reason(p)) for n, p in _round_dirs(root)]


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
        if file_sha256(f) != digest:
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


def load_checkpoint(path: Path
                    ) -> tuple[dict, dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], dict | None]:
    """Verify, then return ``(manifest, trainable, extra tensor files by name, state or None)``."""
    manifest = verify_checkpoint(path)
    trainable = load_file(str(path / "trainable.safetensors"))
    extra = {rel[:-len(".safetensors")]: load_file(str(path / rel)) for rel in manifest.get("files", {})
             if rel.endswith(".safetensors") and "/" not in rel and rel != "trainable.safetensors"}
    state = None
    if "state.json" in manifest.get("files", {}):
        try:
            state = json.loads((path / "state.json").read_text())
        except json.JSONDecodeError as exc:  # unreachable after a hash match, unless written corrupt
            raise CheckpointError(f"{path / 'state.json'}: unreadable: {exc}") from None
    return manifest, trainable, extra, state


def resumable(root: Path, *, require_state: bool = True) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under ``root`` that verifies (and holds ``state.json`` when
    ``require_state``), and the warnings about each newer one that did not (moved aside, see the
    module docstring) and about leftovers of an interrupted write (removed)."""
    warnings: list[str] = []
    if not root.is_dir():
        return None, warnings
    for tmp in sorted(root.glob(".tmp-round-*")):
        shutil.rmtree(tmp, ignore_errors=True)
        warnings.append(f"{tmp.name}: an interrupted checkpoint write (never completed) was removed")
    (root / ".LATEST.tmp").unlink(missing_ok=True)
    for rnd, path in reversed(_round_dirs(root)):
        try:
            manifest = verify_checkpoint(path)
            if require_state and "state.json" not in manifest.get("files", {}):
                raise CheckpointError(f"{path}: no state.json (written by a distmoe without resume support)")
            if manifest.get("round") != rnd:
                raise CheckpointError(f"{path}: the manifest says round {manifest.get('round')!r}")
        except CheckpointError as exc:
            aside = root / f"corrupt-round-{rnd}-{int(time.time())}"
            os.replace(path, aside)
            warnings.append(f"checkpoint round {rnd} is unusable ({exc}); moved aside to {aside.name}, "
                            "falling back to the previous checkpoint")
            continue
        return path, warnings
    return None, warnings


def rollback_point(run_dir: Path, round_num: int) -> Path:
    """The verified checkpoint of round ``round_num`` of the run in ``run_dir``, the starting point of a new run
    (``run.init-from``); ``CheckpointError`` saying why not: no such run, a round never reached, a round pruned
    (naming the kept ones) or one that does not verify."""
    root = RunDir(run_dir).checkpoints
    if not root.is_dir():
        raise CheckpointError(f"{run_dir}: no checkpoints/ directory (not a distmoe run directory?)")
    rounds = kept_rounds(root)
    kept = ", ".join(f"{n}" + (f" ({why})" if why else "") for n, _, why in rounds) or "none"
    path = round_dir(root, round_num)
    if not path.is_dir():
        last = rounds[-1][0] if rounds else -1
        if round_num > last:
            raise CheckpointError(f"{run_dir}: round {round_num} has no checkpoint (the run's last checkpoint is "
                                  f"round {last}); kept rounds: {kept}")
        raise CheckpointError(f"{run_dir}: the checkpoint of round {round_num} was pruned (checkpoint.keep keeps "
                              "the newest ones besides the initial model and the model before each task); kept "
                              f"rounds: {kept}")
    verify_checkpoint(path)
    return path


def copy_checkpoint(src: Path, out: Path) -> Path:
    """Copy the checkpoint ``src`` to the new directory ``out`` (refused when it exists) and verify the copy."""
    out = Path(out)
    if out.exists():
        raise CheckpointError(f"{out}: already exists (choose a new directory)")
    verify_checkpoint(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    try:
        verify_checkpoint(tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
