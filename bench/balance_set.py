"""Which public balance set the routing bias should settle on (the load-balance target of the default run).

The settle (``routing.balance-settle-steps``) fits the routing bias to the public balance set; the run's load CV is
read on the public probe, a draw of another generator index. The synthetic generators are non-IID by index (string
operations, arithmetic ranges, lookup key windows: ``distmoe.data.synth``), so a set of one index covers one slice
of the families. This script holds a finished run's final weights still, restarts from its final routing bias and
settles it again on several sets (``train.public_balance.settle_bias`` at the run's settle schedule), then reads
the top-1 load CV (``routing.metrics.load_cv``) on:

- the set itself (its first 256 prompts): how well the bias fits what it was settled on;
- 256 prompts of the probe's generator index (``default_probe_prompts(seed + 2000, 256)``, never balanced on): the
  run's metric with the 16-prompt sampling noise mostly gone;
- 256 prompts spanning 12 other generator indices (``balance_set_prompts(seed + 5000, 12, 30, OTHER_INDEX)``, indices
  no set here uses): every variant of the families, held out.

Sets: ``styles`` generator indices from ``BALANCE_GENERATOR_INDEX`` on, ``per`` prompts per family and index
(``routing.probe.balance_set_prompts``; styles 1 / per 32 is the set before 2026-12-04, 12 / 32 the default now).

    python bench/balance_set.py runs/diag/default-public-bias-settle-linear-s0 \
        --out bench/results/default-balance/balance-set.jsonl

Needs a run directory whose checkpoints were kept (``bench/continual_anchor.py`` without ``--prune``) and whose
model has a routing bias. Prints one JSON line per set.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

SETS = ((1, 32), (1, 85), (1, 256), (12, 8), (12, 16), (12, 32))  # (styles, prompts per family and style)
OTHER_INDEX = 2_000_000  # the held-out all-style probe's first generator index (no balance set, probe or party)


def measure(run_dir: Path) -> list[dict]:
    import run_checkpoints as rc
    import torch

    from distmoe.model.balance import BalanceTracker, biases, has_bias, settle_rates
    from distmoe.routing import probe as pr
    from distmoe.routing.metrics import load_cv
    from distmoe.train.public_balance import PublicBalance, settle_bias

    cfg = rc.run_config(run_dir)
    ckpts = {r: d for r, (_man, d) in rc.kept(run_dir).items()}
    if not ckpts or not (ckpts[max(ckpts)] / "model").is_dir():
        sys.exit(f"{run_dir}: no kept final checkpoint (run without --prune)")
    final = ckpts[max(ckpts)]
    model, tok = rc.model_at(cfg, final)
    if not has_bias(model):
        sys.exit(f"{run_dir}: the model has no routing bias (routing.balance \"bias\" or \"aux+bias\")")
    start = [b.detach().clone() for b in biases(model)]
    r = cfg.routing
    rates = settle_rates(r.balance_settle_steps or 100, r.balance_settle_rate, r.balance_settle_schedule)

    def cv(prompts) -> float:
        _, top1 = pr.probe_routing(model, tok, tuple(prompts), cfg.model.max_seq_len, cfg.eval.batch_size)  # [L, N]
        e = len(start[0])
        return float(load_cv(torch.from_numpy(np.stack([np.bincount(t, minlength=e) for t in top1]))))

    probe_style = pr.default_probe_prompts(cfg.run.seed + 2000, 256)
    all_styles = pr.balance_set_prompts(cfg.run.seed + 5000, 12, 30, OTHER_INDEX)[:256]
    base = {"run": run_dir.name, "round": max(ckpts), "settle": f"{len(rates)} x {r.balance_settle_schedule} from "
            f"{r.balance_settle_rate}", "cv probe style (final bias)": round(cv(probe_style), 4),
            "cv all styles (final bias)": round(cv(all_styles), 4)}
    out = []
    for styles, per in SETS:
        prompts = pr.balance_set_prompts(cfg.run.seed, styles, per)
        with torch.no_grad():
            for b, s in zip(biases(model), start, strict=True):
                b.copy_(s)
        public = PublicBalance(model, tok, prompts, 0.0, r.public_balance_batch, cfg.model.max_seq_len)
        with BalanceTracker(model, r.balance_settle_rate, r.balance_count) as tracker:
            settle_bias(model, public, tracker, rates)
        out.append({**base, "styles": styles, "prompts": len(prompts), "cv on the set": round(cv(prompts[:256]), 4),
                    "cv probe style": round(cv(probe_style), 4), "cv all styles": round(cv(all_styles), 4)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories with kept checkpoints")
    ap.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    args = ap.parse_args()
    for run in args.runs:
        for res in measure(run):
            print(json.dumps(res), flush=True)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                with args.out.open("a") as f:
                    f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
