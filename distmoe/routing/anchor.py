"""The global router anchor: built from aggregated router statistics, versioned, saved, loaded.

An anchor is ``[L, E]`` (each row a routing distribution over experts) plus its version: the
round it was built in, the hash of the checkpoint it came from, and the router specification
(family, MoE layers, experts, top-k). Stored as ``anchors/round-<n>.npz`` + ``round-<n>.json``,
each written atomically.

Must not: compute statistics (``stats.py``) or see per-party values (it receives the sum).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from distmoe.io import write_text_atomic


class AnchorError(ValueError):
    """An anchor does not fit the model or the statistics it came from are unusable."""


@dataclass(frozen=True)
class AnchorVersion:
    version: int
    round: int
    source_checkpoint: str  # sha256 of the global trainable weights the stats were computed on
    router_spec: dict
    num_sequences: float
    task: str | None


@dataclass(frozen=True)
class Anchor:
    probs: np.ndarray  # [L, E], rows sum to 1
    meta: AnchorVersion


def build_anchor(summed: np.ndarray, meta: AnchorVersion) -> Anchor:
    """Row-normalise the aggregated ``[L, E]`` sum (no separate count is needed: rows sum to N)."""
    s = np.asarray(summed, dtype=np.float64)
    spec = meta.router_spec
    expected = (len(spec["moe_layers"]), int(spec["num_experts"]))
    if s.shape != expected:
        raise AnchorError(f"router statistics have shape {s.shape}, expected {expected}")
    if not np.all(np.isfinite(s)):
        raise AnchorError("router statistics contain NaN or Inf")
    s = np.clip(s, 0.0, None)  # noise may push entries below zero; a distribution cannot be negative
    rows = s.sum(1, keepdims=True)
    if np.any(rows <= 0):
        raise AnchorError("router statistics have an empty row (no sequences)")
    return Anchor(probs=(s / rows).astype(np.float32), meta=meta)


def save_anchor(anchor: Anchor, directory: Path) -> Path:
    import io

    stem = directory / f"round-{anchor.meta.round}"
    buf = io.BytesIO()
    np.savez(buf, probs=anchor.probs)
    write_text_atomic(stem.with_suffix(".npz"), buf.getvalue())
    write_text_atomic(stem.with_suffix(".json"), json.dumps(asdict(anchor.meta), indent=2).encode())
    return stem.with_suffix(".npz")


def load_anchor(npz_path: Path) -> Anchor:
    meta = AnchorVersion(**json.loads(npz_path.with_suffix(".json").read_text()))
    with np.load(npz_path) as z:
        probs = z["probs"].astype(np.float32)
    return Anchor(probs=probs, meta=meta)
