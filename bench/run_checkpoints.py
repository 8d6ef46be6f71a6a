"""A finished run's kept checkpoints, read for the benches: the manifests by round, the run's config, a kept
round's model (the base from its ``model/`` plus the round's trainable tensors, as a party has it) and the
noise-free held-out scores of a model pooled over the run's parties.

Used by ``continual_anchor.py`` (top-1 consistency), ``retention_fed.py`` and ``retention_chain.py`` (noise-free
endpoints), ``probe_size.py`` and ``balance_set.py``. Must not: run anything, or write into a run directory.
"""

from __future__ import annotations

import json
from pathlib import Path


def run_config(run_dir: Path):
    """The run's parsed run config (``run.json``)."""
    from distmoe.config import parse_run_config

    return parse_run_config(json.loads((run_dir / "run.json").read_text())["config"])


def kept(run_dir: Path) -> dict[int, tuple[dict, Path]]:
    """Round -> (manifest, checkpoint directory) of every checkpoint the run kept."""
    out = {}
    for m in (run_dir / "checkpoints").glob("round-*/manifest.json"):
        man = json.loads(m.read_text())
        out[man["round"]] = (man, m.parent)
    return out


def model_at(cfg, ckpt: Path):
    """``(model, tokenizer)`` of a kept checkpoint: its base, then the round's trainable tensors (the routing bias
    of ``routing.balance = "bias"`` lives only there)."""
    from distmoe.checkpoint import load_trainable_file
    from distmoe.model.build import build_model
    from distmoe.model.trainable import apply_trainable, load_trainable, spec_of

    model, tok = build_model(cfg.model, str(ckpt / "model"))
    model = apply_trainable(model, cfg.model)
    load_trainable(model, load_trainable_file(ckpt), spec_of(model, cfg.model.trainable))
    return model, tok


def party_data(run_dir: Path, cfg) -> list:
    """The parties' data as ``distmoe simulate`` wrote it for the run (``work/data/party-*``)."""
    from distmoe.data.party import load_party

    return [load_party(p, cfg.data) for p in sorted((run_dir / "work" / "data").glob("party-*"))]


def pooled_scores(model, tok, cfg, data: list, task: str) -> list[tuple[bool, float]]:
    """``(exact match, answer NLL)`` of every held-out item of ``task`` over the parties that fits
    ``model.max-seq-len``, noise-free (``distmoe.train.evaluate.example_scores``)."""
    from distmoe.data.template import encode_fitting
    from distmoe.train.evaluate import example_scores

    scores = []
    for pd in data:
        held = pd.heldout(task) if pd.has(task) else []
        fits, _, _ = encode_fitting(tok, held, cfg.model.max_seq_len)
        if fits:
            scores += example_scores(model, tok, task, fits, cfg.model.max_seq_len, cfg.eval)
    return scores
