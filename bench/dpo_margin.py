"""Benchmark: does local DPO raise the chosen-vs-rejected margin on held-out pairs of the synthetic ``pref`` task?

    python bench/dpo_margin.py [--seeds 0,1,2,3,4] [--examples 120] [--steps 12] [--lr 5e-3] [--beta 0.1]
                               [--engine ""] [--low 0.5] [--high 5.0]

Setup (the figures of ``docs/algorithms.md``, Local DPO): the tiny test model of ``tests/rl/test_dpo.py``
(hidden 64, 2 layers, 4 experts, top-2), randomly initialised from each seed; one party's ``pref`` task
(``--examples`` pairs, 80 / 20 split); the reference = the model before training (trainer log-probs, or
``--engine``'s with the IcePop pair mask); ``--steps`` DPO steps of 8 pairs. Per seed it prints the mean held-out
``s(y_w) - s(y_l)`` before and after, its change, and the held-out preference accuracy (share of pairs with a
positive margin) before and after; then the mean and sample std of the change over the seeds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from distmoe.config import parse_run_config
from distmoe.data.party import load_party
from distmoe.data.synth import write_synthetic
from distmoe.data.template import encode_example
from distmoe.model.build import build_model, describe
from distmoe.model.trainable import apply_trainable
from distmoe.rl.dpo import preference_margins, reference_logps, train_dpo

TINY = {"model.hidden-size": 64, "model.moe-intermediate-size": 64, "model.layers": 2, "model.heads": 2,
        "model.kv-heads": 1, "model.head-dim": 32, "model.experts": 4, "model.top-k": 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--examples", type=int, default=120)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--engine", default="")
    ap.add_argument("--low", type=float, default=0.5)
    ap.add_argument("--high", type=float, default=5.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        d = write_synthetic(Path(tmp), parties=1, examples_per_task=args.examples, seed=0, tasks=("pref",))[0]
        data = load_party(d, parse_run_config(TINY).data)
        gains = []
        for seed in (int(s) for s in args.seeds.split(",")):
            cfg = parse_run_config({**TINY, "run.seed": seed, "train.lr": args.lr, "train.lr-experts": args.lr,
                                    "train.lr-router": args.lr, "train.warmup-steps": 0, "dpo.steps": args.steps,
                                    "dpo.pairs-per-step": 8, "dpo.beta": args.beta})
            model, tok = build_model(cfg.model)
            model = apply_trainable(model, cfg.model)
            n = cfg.model.max_seq_len

            def enc(exs, tok=tok, n=n):
                return [(encode_example(tok, e, n), encode_example(tok, e.rejected_example(), n)) for e in exs]

            pairs, held = enc(data.train("pref")), enc(data.heldout("pref"))
            ms, pad = describe(model), tok.pad_token_id
            m0 = preference_margins(model, held, pad, 16)
            ref = reference_logps(model, pairs, pad, 16, engine=args.engine, low=args.low, high=args.high)
            train_dpo(model, pairs, ref, pad, cfg.train, cfg.dpo, cfg.routing, ms.num_experts, ms.top_k, None, seed)
            m1 = preference_margins(model, held, pad, 16)
            gain = float(m1.mean() - m0.mean())
            gains.append(gain)
            print(f"seed {seed}: {len(pairs)} train / {len(held)} held-out pairs | margin {float(m0.mean()):+.3f} -> "
                  f"{float(m1.mean()):+.3f} ({gain:+.3f}) | accuracy {float((m0 > 0).float().mean()):.2f} -> "
                  f"{float((m1 > 0).float().mean()):.2f} | masked pairs {ref.stats['ref_masked_frac']:.3f}")
        sd = statistics.stdev(gains) if len(gains) > 1 else float("nan")
        print(f"held-out margin change over {len(gains)} seeds: {statistics.mean(gains):+.3f} ± {sd:.3f}")


if __name__ == "__main__":
    main()
