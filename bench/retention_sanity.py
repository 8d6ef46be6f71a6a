"""A quick, local sanity check of the retention mechanisms (not the federated experiment: that is
``bench/continual_anchor.py``): one party, task A then task B with the real local SFT loop, the anchor from
task A's router statistics (exact, no DP noise, no secure aggregation), then task A's held-out answer loss and
accuracy and task B's, per arm and seed.

    python bench/retention_sanity.py --seeds 0 1 2 --steps 150

Arms: none, anchor (the latest-anchor KL), protection, distillation, router-warmup (+ cosine experts, low
router), all. The tiny model of the tests by default (``--model tiny``) so that it runs in minutes on a CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

import torch

from distmoe.config import parse_run_config
from distmoe.data.party import load_party
from distmoe.data.synth import write_synthetic
from distmoe.data.template import collate, encode_example
from distmoe.model.build import build_model, describe
from distmoe.model.trainable import apply_trainable, trainable_state
from distmoe.routing.retention import protected_experts
from distmoe.routing.stats import per_sequence_stats
from distmoe.train.evaluate import example_scores
from distmoe.train.retention import Retention
from distmoe.train.sft import train_sft

TINY = {"model.hidden-size": 64, "model.moe-intermediate-size": 64, "model.layers": 2, "model.heads": 2,
        "model.kv-heads": 1, "model.head-dim": 32, "model.experts": 4, "model.top-k": 2}
ARMS = ("none", "anchor", "protection", "distillation", "router-warmup", "all")


def overrides(arm: str) -> dict:
    o = {"routing.anchor-kl-coef": 0.5 if arm in ("anchor", "all") else 0.0}
    if arm in ("router-warmup", "all"):
        o.update({"train.router-warmup-steps": 20, "train.expert-schedule": "cosine", "train.router-lr-scale": 0.1})
    return o


def scores(model, tok, task, examples, cfg) -> tuple[float, float]:
    s = example_scores(model, tok, task, examples, cfg.model.max_seq_len, cfg.eval)
    return sum(c for c, _ in s) / len(s), sum(lo for _, lo in s) / len(s)


def run(arm: str, seed: int, party, base: dict, steps: int, a: str, b: str) -> dict[str, float]:
    cfg = parse_run_config({**base, **overrides(arm), "train.local-steps": steps, "run.seed": seed})
    model, tok = build_model(cfg.model)
    model = apply_trainable(model, cfg.model)
    ms = describe(model)
    enc = {t: [encode_example(tok, ex, cfg.model.max_seq_len) for ex in party.train(t)] for t in (a, b)}
    train_sft(model, enc[a], tok.pad_token_id, cfg.train, cfg.routing, ms.num_experts, ms.top_k, None, seed=seed)
    acc_a0, loss_a0 = scores(model, tok, a, party.heldout(a), cfg)
    bs = cfg.eval.batch_size
    stats = per_sequence_stats(model, (collate(enc[a][i:i + bs], tok.pad_token_id)
                                       for i in range(0, len(enc[a]), bs))).sum(0)  # [L, E]
    anchor = torch.from_numpy(stats / stats.sum(1, keepdims=True)).float()  # [L, E]
    r = Retention(task_anchors=anchor[None], router_warmup_steps=cfg.train.router_warmup_steps)
    if arm in ("protection", "all"):
        r.protected, r.protect_lr_scale = protected_experts(anchor[None], 1.5 / ms.num_experts), 0.0
    if arm in ("distillation", "all"):
        r.ref_state, r.distill_weight = {k: v.clone() for k, v in trainable_state(model).items()}, 1.0
    train_sft(model, enc[b], tok.pad_token_id, cfg.train, cfg.routing, ms.num_experts, ms.top_k, anchor,
              seed=seed + 1, retention=r)
    acc_a, loss_a = scores(model, tok, a, party.heldout(a), cfg)
    acc_b, loss_b = scores(model, tok, b, party.heldout(b), cfg)
    return {"acc A before B": acc_a0, "acc A after B": acc_a, "retention A": acc_a / acc_a0 if acc_a0 else float("nan"),
            "loss A before B": loss_a0, "loss A after B": loss_a, "acc B": acc_b, "loss B": loss_b}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=ARMS)
    ap.add_argument("--tasks", nargs=2, default=["lookup", "arith"])
    ap.add_argument("--model", choices=["tiny", "default"], default="tiny")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = {**(TINY if args.model == "tiny" else {}), "train.batch-size": 16, "data.max-eval-examples": 40,
            "train.lr": 5e-3, "train.lr-experts": 5e-3, "train.lr-router": 5e-3}
    d = write_synthetic(Path(tempfile.mkdtemp()), parties=1, examples_per_task=200, seed=0)[0]
    party = load_party(d, parse_run_config(base).data)
    rows: dict[str, list[dict[str, float]]] = {}
    for arm in args.arms:
        for s in args.seeds:
            rows.setdefault(arm, []).append(run(arm, s, party, base, args.steps, *args.tasks))
            print(json.dumps({"arm": arm, "seed": s, **rows[arm][-1]}), flush=True)  # every seed's row, as it lands
    metrics = list(next(iter(rows.values()))[0])
    print("| metric | " + " | ".join(f"{a} (n={len(r)})" for a, r in rows.items()) + " |")
    print("|---|" + "---|" * len(rows))
    for m in metrics:
        cells = []
        for r in rows.values():
            v = [x[m] for x in r if math.isfinite(x[m])]
            if not v:
                cells.append("–")
                continue
            sd = statistics.stdev(v) if len(v) > 1 else 0.0
            cells.append(f"{statistics.mean(v):.3f} ± {sd:.3f} ({', '.join(f'{x:.3f}' for x in v)})")
        print(f"| {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
