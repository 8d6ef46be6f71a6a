"""Shared fixtures for the RL tests: a small MoE briefly SFT-trained on synthetic lookup data, so that
routing and output distributions are non-trivial (random init misleads mismatch measurements).

Must not: be imported by test modules (they ask for the fixtures by name).
"""

from __future__ import annotations

import copy

import pytest

from distmoe.config import parse_run_config
from distmoe.data.formats import parse_line
from distmoe.data.synth import generate
from distmoe.data.template import encode_example
from distmoe.model.build import build_model, describe
from distmoe.train.sft import train_sft

SMALL = {"model.hidden-size": 128, "model.moe-intermediate-size": 128, "model.layers": 2, "model.heads": 2,
         "model.kv-heads": 1, "model.head-dim": 64, "train.local-steps": 150, "train.batch-size": 16,
         "train.lr": 3e-3, "train.lr-experts": 3e-3, "train.lr-router": 3e-3, "train.warmup-steps": 5,
         "routing.anchor-kl-coef": 0.0}


def _train_small_lookup() -> dict:
    """A fresh small model after 150 SFT steps (~3-6 s): cfg, model, tok, examples, encoded."""
    cfg = parse_run_config(SMALL)
    model, tok = build_model(cfg.model)
    ms = describe(model)
    examples = [parse_line(o, "synth") for o in generate("lookup", 0, 240, 0)]
    encoded = [encode_example(tok, ex, cfg.model.max_seq_len) for ex in examples]
    res = train_sft(model, encoded, tok.pad_token_id, cfg.train, cfg.routing, ms.num_experts, ms.top_k, None, 0)
    assert res.task_losses[-1] < 0.5 * res.task_losses[0]
    return {"cfg": cfg, "model": model, "tok": tok, "examples": examples, "encoded": encoded}


@pytest.fixture(scope="session")
def train_small_lookup():
    """``train_small_lookup()`` -> the small model after its 150 SFT steps (~3-6 s, trained once per session):
    a deep copy each call, so callers may change it."""
    trained: list[dict] = []

    def fresh() -> dict:
        if not trained:
            trained.append(_train_small_lookup())
        return copy.deepcopy(trained[0])
    return fresh
