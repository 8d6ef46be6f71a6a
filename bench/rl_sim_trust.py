"""Benchmark: how often the inference simulator (``distmoe.rl.simulator``) is trusted in short GRPO runs, with
one-batch calibration (``rl.simulator-buffer-tokens 0``, no last-layer refit, no shift triggers: the behaviour
before the buffer) against the defaults (bounded buffer, refit, held-out / routing-shift triggers).

    python bench/rl_sim_trust.py [--steps 8] [--seeds 0 1 2] [--engine prune-1]

Setup: the small MoE of ``tests/rl/conftest.py`` (2 layers, 8 experts, 150 SFT steps on synthetic lookup data),
120 prompts (6 held out by default), 8 prompts x 4 samples x 8 tokens per step, full fits every 4 steps. Prints
per seed the trusted steps, the triggered full fits and the mean held-out / batch R^2 of delta_hat, then the mean
and std of the trusted steps per arm. Short runs only: a smoke figure, not the long-run study.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

from distmoe.config import RLConfig, parse_run_config
from distmoe.data.formats import parse_line
from distmoe.data.synth import generate
from distmoe.data.template import encode_example
from distmoe.model.build import build_model, describe
from distmoe.rl.grpo import run_grpo
from distmoe.train.sft import train_sft

SMALL = {"model.hidden-size": 128, "model.moe-intermediate-size": 128, "model.layers": 2, "model.heads": 2,
         "model.kv-heads": 1, "model.head-dim": 64, "train.local-steps": 150, "train.batch-size": 16,
         "train.lr": 3e-3, "train.lr-experts": 3e-3, "train.lr-router": 3e-3, "train.warmup-steps": 5,
         "routing.anchor-kl-coef": 0.0}
ARMS = {"one-batch calibration (buffer 0, no refit, no triggers)": {
            "simulator_buffer_tokens": 0, "simulator_incremental": False, "simulator_route_shift": 1.0,
            "simulator_error_shift": 1e9},
        "defaults (buffer, refit, triggers)": {}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--engine", default="prune-1")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = parse_run_config(SMALL)
    model, tok = build_model(cfg.model)
    ms = describe(model)
    examples = [parse_line(o, "synth") for o in generate("lookup", 0, 240, 0)]
    encoded = [encode_example(tok, ex, cfg.model.max_seq_len) for ex in examples]
    train_sft(model, encoded, tok.pad_token_id, cfg.train, cfg.routing, ms.num_experts, ms.top_k, None, 0)
    base = {"prompts_per_step": 8, "group_size": 4, "max_new_tokens": 8, "lr": 1e-3, "reward": "task",
            "steps": args.steps, "engine": args.engine, "simulator": True, "simulator_recalibrate_every": 4}
    for name, kw in ARMS.items():
        trusted = []
        for seed in args.seeds:
            res = run_grpo(copy.deepcopy(model), tok, examples[:120], "lookup", RLConfig(**base, **kw), seed=seed)
            s = res.summary()
            trusted.append(res.sim_trusted)
            rc = RLConfig(**base, **kw)
            n_route = sum(m["sim_route_shift"] > rc.simulator_route_shift for m in res.steps)  # NaN compares False
            n_err = sum(m["sim_err_shift"] > rc.simulator_error_shift for m in res.steps)
            print(f"{name}: seed {seed}: trusted {res.sim_trusted}/{len(res.steps)}, triggered full fits "
                  f"{res.sim_recal_triggered} (route shift over threshold {n_route}, error shift {n_err}; mean "
                  f"route shift {s['sim_route_shift']:.3f}, error shift {s['sim_err_shift']:.3g}), held-out R2 "
                  f"{s.get('sim_heldout_r2', float('nan')):.3g}, batch R2 {s['sim_r2']:.3g}", flush=True)
        sd = statistics.stdev(trusted) if len(trusted) > 1 else float("nan")
        print(f"{name}: trusted steps {statistics.mean(trusted):.2f} +- {sd:.2f} (per seed {trusted})", flush=True)


if __name__ == "__main__":
    main()
