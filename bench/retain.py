"""Forgetting and expert load of the tiny model on the continual pair lookup -> arith, centralised on one
party's data (the same local SFT loop the parties run, ``distmoe.train.sft.train_sft``; no federation, so it
runs in minutes on a CPU): the arms differ in the starting point (random initialisation vs the cached warm-up
base, ``distmoe.train.warmup``) and in the load balancing (``routing.balance``, ``routing.aux-loss-coef``,
``routing.balance-count``, ``routing.aux-loss-scope``: the arms named before 2026-12-03 pin the aux loss pooled over
layers, as it was then).

    python bench/retain.py --seeds 0 1 2 --arms random warm random-bias warm-bias --steps-a 200 --steps-b 200
    python bench/retain.py --seeds 0 1 2 --arms random random-aux-0.1 random-aux-1 random-bias random-bias-first \
        random-aux-0.1+bias-first --steps-a 200 --steps-b 200        # where the load CV comes from
    python bench/retain.py --seeds 0 1 2 --arms random random-bias-first random-bias-first-slow-router \
        --steps-a 200 --steps-b 200                                   # the same, with the per-family probe rows
    python bench/retain.py --seeds 0 1 2 --arms random-layer-aux random-layer-aux-0.1 random-layer-aux-1 \
        random-layer-aux-0.1+bias-first --steps-a 200 --steps-b 200   # the aux loss per MoE layer

Per arm and seed: accuracy on task A's held-out set after A and after B (retention = after / before), accuracy
on B after B, and the expert-load CV (std/mean of the top-1 loads of the experts the router chooses, bias
included, over every held-out example of A and B; < 0.2 is healthy) after A and after B, and the CV of the
top-k loads (what the bias balances) and the top-1 load CV on the trained task's held-out set alone, and the
run's own metric: the top-1 load CV on the default public probe (``--probe`` prompts of every synthetic family,
prompt tokens only: ``distmoe.routing.probe``), on a larger probe (``--probe-large``) and on 80 probe prompts of
each family alone (which distribution the imbalance comes from). Prints a Markdown table (mean ± sample std
over seeds, and every seed's value) and writes the rows as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from distmoe.checkpoint import load_checkpoint
from distmoe.config import parse_run_config
from distmoe.data.party import load_party
from distmoe.data.synth import TASK_FAMILIES, write_synthetic
from distmoe.data.template import encode_example
from distmoe.model.build import build_model, describe
from distmoe.model.trainable import apply_trainable, load_trainable, spec_of
from distmoe.routing import metrics as rm
from distmoe.routing.probe import default_probe_prompts, expert_counts, family_probe_prompts, probe_routing
from distmoe.train.evaluate import routing_on, task_accuracy
from distmoe.train.sft import train_sft
from distmoe.train.warmup import build_base

POOLED = {"routing.aux-loss-scope": "pooled"}  # the aux loss as transformers pools it (the default before 2026-12-03)
ARMS = {  # arm -> (warm base, the arm's routing.* keys; the bias arms also take --rate)
    "random": (False, {"routing.balance": "aux", **POOLED}),
    "warm": (True, {"routing.balance": "aux", **POOLED}),
    "random-bias": (False, {"routing.balance": "bias"}),
    "warm-bias": (True, {"routing.balance": "bias"}),
    "random-aux-0.1": (False, {"routing.balance": "aux", "routing.aux-loss-coef": 0.1, **POOLED}),
    "random-aux-1": (False, {"routing.balance": "aux", "routing.aux-loss-coef": 1.0, **POOLED}),
    "random-bias-first": (False, {"routing.balance": "bias", "routing.balance-count": "first"}),
    "random-aux-0.1+bias-first": (False, {"routing.balance": "aux+bias", "routing.aux-loss-coef": 0.1,
                                          "routing.balance-count": "first", **POOLED}),
    "random-bias-first-slow-router": (False, {"routing.balance": "bias", "routing.balance-count": "first",
                                              "train.lr-router": 1e-4}),
    # the aux loss per MoE layer (routing.aux-loss-scope = layer, the default since 2026-12-03)
    "random-layer-aux": (False, {"routing.balance": "aux", "routing.aux-loss-scope": "layer"}),
    "random-layer-aux-0.1": (False, {"routing.balance": "aux", "routing.aux-loss-scope": "layer",
                                     "routing.aux-loss-coef": 0.1}),
    "random-layer-aux-1": (False, {"routing.balance": "aux", "routing.aux-loss-scope": "layer",
                                   "routing.aux-loss-coef": 1.0}),
    "random-layer-aux-0.1+bias-first": (False, {"routing.balance": "aux+bias", "routing.aux-loss-scope": "layer",
                                                "routing.aux-loss-coef": 0.1, "routing.balance-count": "first"}),
    "warm-layer-aux-0.1+bias-first": (True, {"routing.balance": "aux+bias", "routing.aux-loss-scope": "layer",
                                             "routing.aux-loss-coef": 0.1, "routing.balance-count": "first"}),
}


def run_arm(arm: str, seed: int, args, data_root: Path) -> dict[str, float]:
    warm, routing = ARMS[arm]
    over = {"run.seed": seed, **routing, "routing.balance-rate": args.rate, "train.threads": args.threads}
    cfg = parse_run_config(over)
    torch.set_num_threads(args.threads)
    model, tok = build_model(cfg.model)
    model = apply_trainable(model, cfg.model)
    if warm:
        base = build_base(cfg, args.warmup_steps, Path(args.cache))
        _, weights, _, _ = load_checkpoint(base)
        load_trainable(model, weights, spec_of(model, cfg.model.trainable))
    ms = describe(model)
    party_dir = data_root / f"s{seed}" / "party-0"
    if not party_dir.exists():
        write_synthetic(data_root / f"s{seed}", 1, cfg.data.synth_examples, seed)
    party = load_party(party_dir, cfg.data)
    a, b = args.task_a, args.task_b
    held = {t: party.heldout(t)[: cfg.data.max_eval_examples] for t in (a, b)}
    fixed = held[a] + held[b]
    max_len = cfg.model.max_seq_len

    def acc(task: str) -> float:
        return task_accuracy(model, tok, task, held[task], max_len, cfg.eval)

    def cv(task: str = "") -> float:
        """Top-1 load CV on both tasks' held-out examples, or on ``task``'s alone (the distribution just trained)."""
        _, valid = routing_on(model, tok, held[task] if task else fixed, max_len, cfg.eval.batch_size)
        return rm.load_cv(rm.top1_counts(valid, ms.num_experts))

    def cv_probe(n: int, family: str = "") -> float:
        """The run's own metric: top-1 load CV on the public probe (``n`` prompts; the default run has 16), or on
        ``n`` probe prompts of one synthetic family alone."""
        prompts = tuple(family_probe_prompts(family, seed, n)) if family else default_probe_prompts(seed, n)
        _, top1 = probe_routing(model, tok, prompts, max_len, cfg.eval.batch_size)
        return rm.load_cv(torch.from_numpy(expert_counts(top1, ms.num_experts)))

    def cv_k(task: str) -> float:
        """CV of the top-k loads (what the bias balances) on ``task``'s held-out set."""
        _, valid = routing_on(model, tok, held[task], max_len, cfg.eval.batch_size)
        counts = torch.stack([torch.bincount(torch.topk(v, ms.top_k, -1).indices.reshape(-1), minlength=ms.num_experts)
                              for v in valid])  # [L, E]
        return rm.load_cv(counts)

    row = {"seed": float(seed), "acc A start": acc(a), "load CV start": cv()}
    for task, steps in ((a, args.steps_a), (b, args.steps_b)):
        enc = [encode_example(tok, ex, max_len) for ex in party.train(task)]
        train = dataclasses.replace(cfg.train, local_steps=steps)
        train_sft(model, enc, tok.pad_token_id, train, cfg.routing, ms.num_experts, ms.top_k, None, seed)
        if task == a:
            row.update({"acc A after A": acc(a), "load CV after A": cv(), "top-1 load CV on A after A": cv(a),
                        "top-k load CV on A after A": cv_k(a), "probe load CV after A": cv_probe(args.probe)})
    row.update({"acc A after B": acc(a), "acc B after B": acc(b), "load CV after B": cv(),
                "top-1 load CV on B after B": cv(b), "top-k load CV on B after B": cv_k(b),
                "probe load CV after B": cv_probe(args.probe),
                f"probe load CV after B, {args.probe_large} prompts": cv_probe(args.probe_large),
                **{f"probe load CV after B, {f} prompts only": cv_probe(80, f) for f in TASK_FAMILIES}})
    before = row["acc A after A"]
    row["retention A"] = row["acc A after B"] / before if before > 0 else math.nan
    return row


def table(rows: dict[str, list[dict[str, float]]]) -> str:
    metrics = [k for k in next(iter(rows.values()))[0] if k != "seed"]
    lines = ["| metric | " + " | ".join(f"{arm} (n={len(r)})" for arm, r in rows.items()) + " |",
             "|---|" + "---|" * len(rows)]
    for m in metrics:
        cells = []
        for r in rows.values():
            vals = [x[m] for x in r if math.isfinite(x[m])]
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            cells.append(f"{statistics.mean(vals):.3f} ± {sd:.3f} ({', '.join(f'{v:.3f}' for v in vals)})"
                         if vals else "–")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--task-a", default="lookup")
    ap.add_argument("--task-b", default="arith")
    ap.add_argument("--steps-a", type=int, default=200)
    ap.add_argument("--steps-b", type=int, default=200)
    ap.add_argument("--warmup-steps", type=int, default=600)
    ap.add_argument("--rate", type=float, default=0.05, help="routing.balance-rate of the bias arms")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--probe", type=int, default=16, help="probe prompts, as routing.probe-prompts (default 16)")
    ap.add_argument("--probe-large", type=int, default=240, help="a larger probe, to separate sampling noise")
    ap.add_argument("--cache", default="runs/base-cache")
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    args = ap.parse_args()
    rows: dict[str, list[dict[str, float]]] = {arm: [] for arm in args.arms}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for arm in args.arms:
                t0 = time.perf_counter()
                rows[arm].append(run_arm(arm, seed, args, Path(tmp)))
                print(f"{arm} s{seed}: {json.dumps(rows[arm][-1])} ({time.perf_counter() - t0:.0f} s)", flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
