"""The IcePop experiment: SFT, then local GRPO with rollouts from an inference engine whose numerics differ from
the trainer's, with no correction vs TIS vs IcePop vs the ICEPOP seed's inference simulator vs routing replay;
the same seed, data and SFT model in every arm. Prints a Markdown table per engine (mean ± sample std over seeds,
then each seed's value). Every run is a real ``distmoe simulate``:

1. per seed, one SFT run (``sft:lookup*<sft-rounds>`` from ``configs/rl.toml``); its last checkpoint's HF model
   directory (``checkpoints/<LATEST>/model``) is the starting model of every RL run of that seed;
2. per engine, arm and seed, one RL run from that model: ``eval, rl:lookup*<rl-rounds>, eval``.

    python bench/rl_correction.py --seeds 0 1 2 --engines prune-1 bf16 --runs-dir runs/rl-table

Arms (run-config overrides on top of configs/rl.toml):
  none       rl.correction = none
  tis        rl.correction = tis            (truncated IS, min(k, icepop-high))
  icepop     rl.correction = icepop         (mask outside [icepop-low, icepop-high])
  simulator  rl.correction = icepop, rl.simulator = true   (IcePop is the fallback when the simulator degrades)
  replay     rl.correction = none, rl.routing-replay = true (routing replay alone)

Finished runs (``run.json`` status completed) are reused, so an interrupted table resumes.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARMS = {
    "none": "rl.correction='none'",
    "tis": "rl.correction='tis'",
    "icepop": "rl.correction='icepop'",
    "simulator": "rl.correction='icepop' rl.simulator=true",
    "replay": "rl.correction='none' rl.routing-replay=true",
}


def _completed(run_dir: Path) -> bool:
    rec = run_dir / "run.json"
    return rec.exists() and json.loads(rec.read_text()).get("status") == "completed"


def _simulate(run_id: str, overrides: str, args) -> Path:
    runs_dir = Path(args.runs_dir).resolve()
    run_dir = runs_dir / run_id
    if _completed(run_dir):
        return run_dir
    cmd = [sys.executable, "-m", "distmoe.cli", "simulate", "--config", str(ROOT / "configs" / "rl.toml"),
           "--parties", str(args.parties), "--run-config", overrides, "--run-id", run_id,
           "--runs-dir", str(runs_dir), "--no-report"]
    print("+", " ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True)
    print(f"  {run_id}: {time.time() - t0:.0f} s", flush=True)
    return run_dir


def sft_model(seed: int, args) -> Path:
    """The HF model directory of the seed's SFT run (its last checkpoint)."""
    run_dir = _simulate(f"rl-sft-s{seed}", f"run.seed={seed} schedule.phases='sft:lookup*{args.sft_rounds}'", args)
    latest = (run_dir / "checkpoints" / "LATEST").read_text().strip()
    return run_dir / "checkpoints" / latest / "model"


def rl_run(arm: str, seed: int, engine: str, model_dir: Path, args) -> Path:
    # model.trainable = all, as in the SFT run (with model.path set the default would be lora adapters)
    ov = (f"run.seed={seed} model.path='{model_dir}' model.trainable='all' "
          f"schedule.phases='eval, rl:lookup*{args.rl_rounds}, eval' "
          f"rl.engine='{engine}' rl.steps={args.rl_steps} rl.lr={args.rl_lr} {ARMS[arm]}")
    return _simulate(f"rl-{engine}-{arm}-s{seed}", ov, args)


def row_of(run_dir: Path) -> dict[str, float]:
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    rl = [e for e in events if e.get("event") == "rl" and e.get("party") == "all"]
    evals = [e for e in events if e.get("event") == "eval" and e.get("party") == "all"]
    f = lambda e, k: float(e[k]) if e.get(k) is not None else math.nan  # noqa: E731
    task = rl[0]["task"]
    finite = all(math.isfinite(f(e, k)) for e in rl for k in ("reward", "logp_diff_mean", "k3"))
    skipped = sum(f(e, "skipped_steps") for e in rl)
    return {"reward (engine), first RL round": f(rl[0], "reward"),
            "reward (engine), last RL round": f(rl[-1], "reward"),
            "reward (engine), last step": f(rl[-1], "reward_last"),
            "held-out accuracy before RL": f(evals[0], f"acc/{task}"),
            "held-out accuracy after RL": f(evals[-1], f"acc/{task}"),
            "mean |Δlogp| first RL round": f(rl[0], "logp_diff_mean"),
            "mean |Δlogp| last RL round": f(rl[-1], "logp_diff_mean"),
            "max |Δlogp| (all rounds)": max(f(e, "logp_diff_max") for e in rl),
            "K3 first RL round": f(rl[0], "k3"),
            "K3 last RL round": f(rl[-1], "k3"),
            "masked share last RL round": f(rl[-1], "masked_frac_low") + f(rl[-1], "masked_frac_high"),
            "route disagreement last RL round": statistics.mean(
                f(rl[-1], k) for k in rl[-1] if k.startswith("route_disagree_l")),
            "skipped steps (all rounds)": skipped,
            "stable (no skipped step, finite metrics)": float(finite and skipped == 0),
            "RL wall time per round, s": statistics.mean(f(e, "time_s") for e in rl)}


def _fmt(v: float) -> str:
    return f"{v:.3f}"


def _fmt_sci(v: float) -> str:
    return f"{v:.3f}" if v == 0 or abs(v) >= 0.01 else f"{v:.1e}"


def table(engine: str, rows: dict[str, list[dict[str, float]]], seeds: list[int]) -> str:
    arms = list(rows)
    out = [f"engine `{engine}`, seeds {seeds}", "",
           "| metric | " + " | ".join(f"{a} (n={len(rows[a])})" for a in arms) + " |",
           "|---|" + "---|" * len(arms)]
    for m in rows[arms[0]][0]:
        cells = []
        for a in arms:
            vals = [r[m] for r in rows[a] if math.isfinite(r[m])]
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            fmt = _fmt_sci if m.startswith("K3") or "Δlogp" in m else _fmt
            cells.append(f"{fmt(statistics.mean(vals))} ± {fmt(sd)} ({', '.join(fmt(v) for v in vals)})"
                         if vals else "–")
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--engines", nargs="*", default=["prune-1", "bf16"])
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--parties", type=int, default=2)
    ap.add_argument("--sft-rounds", type=int, default=4)
    ap.add_argument("--rl-rounds", type=int, default=4)
    ap.add_argument("--rl-steps", type=int, default=6, help="GRPO steps per party per RL round")
    ap.add_argument("--rl-lr", type=float, default=3e-4)
    ap.add_argument("--runs-dir", default="runs/rl-table")
    args = ap.parse_args()
    t0 = time.time()
    models = {s: sft_model(s, args) for s in args.seeds}
    tables = []
    for engine in args.engines:
        rows = {arm: [row_of(rl_run(arm, s, engine, models[s], args)) for s in args.seeds] for arm in args.arms}
        tables.append(table(engine, rows, args.seeds))
        print(tables[-1], flush=True)
    print(f"\nsettings: {args.parties} parties, {args.sft_rounds} SFT rounds, {args.rl_rounds} RL rounds x "
          f"{args.rl_steps} steps, rl.lr {args.rl_lr}; total wall {time.time() - t0:.0f} s")
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
