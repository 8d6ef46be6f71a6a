"""The IcePop experiment (preliminary): SFT then local GRPO with rollouts from a pruned inference
engine, with no correction vs TIS vs IcePop; same seed and data per arm. Prints a Markdown table
(mean ± sample std over seeds, then each seed's value). Each run is a real `distmoe simulate`.

    python bench/rl_correction.py --seeds 0 1 --engine prune-2 --runs-dir runs/rl

Not yet included: the seed's inference-simulator arm (not built).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("none", "tis", "icepop")


def run_one(arm: str, seed: int, engine: str, runs_dir: Path) -> Path:
    run_id = f"rl-{engine}-{arm}-s{seed}"
    rec = runs_dir / run_id / "run.json"
    if rec.exists() and json.loads(rec.read_text()).get("status") == "completed":
        return runs_dir / run_id
    cmd = [sys.executable, "-m", "distmoe.cli", "simulate", "--config", str(ROOT / "configs" / "rl.toml"),
           "--run-config", f"run.seed={seed} rl.correction='{arm}' rl.engine='{engine}'", "--run-id", run_id,
           "--runs-dir", str(runs_dir), "--no-report"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return runs_dir / run_id


def row_of(run_dir: Path) -> dict[str, float]:
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    rl = [e for e in events if e.get("event") == "rl" and e.get("party") == "all"]
    evals = [e for e in events if e.get("event") == "eval" and e.get("party") == "all"]
    f = lambda e, k: float(e[k]) if e.get(k) is not None else math.nan  # noqa: E731
    task = rl[0]["task"]
    return {"reward (engine), first RL round": f(rl[0], "reward_first"),
            "reward (engine), last RL round": f(rl[-1], "reward_last"),
            "held-out accuracy before RL": f(evals[0], f"acc/{task}"),
            "held-out accuracy after RL": f(evals[-1], f"acc/{task}"),
            "mean |Δlogp| first round": f(rl[0], "logp_diff_mean"),
            "mean |Δlogp| last round": f(rl[-1], "logp_diff_mean"),
            "K3 last round": f(rl[-1], "k3"),
            "masked share last round": f(rl[-1], "masked_frac_low") + f(rl[-1], "masked_frac_high"),
            "skipped steps (all rounds)": sum(f(e, "skipped_steps") for e in rl)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1])
    ap.add_argument("--engine", default="prune-2")
    ap.add_argument("--runs-dir", default="runs/rl")
    args = ap.parse_args()
    rows = {arm: [row_of(run_one(arm, s, args.engine, Path(args.runs_dir))) for s in args.seeds] for arm in ARMS}
    metrics = list(rows[ARMS[0]][0])
    print(f"engine {args.engine}, seeds {args.seeds}")
    print("| metric | " + " | ".join(f"{a} (n={len(rows[a])})" for a in ARMS) + " |")
    print("|---|" + "---|" * len(ARMS))
    for m in metrics:
        cells = []
        for a in ARMS:
            vals = [r[m] for r in rows[a] if math.isfinite(r[m])]
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            cells.append(f"{statistics.mean(vals):.3f} ± {sd:.3f} ({', '.join(f'{v:.3f}' for v in vals)})"
                         if vals else "–")
        print(f"| {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
