"""The DistMoE experiment: the continual two-task schedule with the router anchor on and off,
same seeds and same data per pair, several seeds per arm; prints the Markdown table for
docs/results.md (mean ± sample std over seeds, and every seed's value).

    python bench/continual_anchor.py --seeds 0 1 2            # runs 2 x 3 simulations
    python bench/continual_anchor.py --collect runs/anchor-*  # tabulate existing run dirs
    python bench/continual_anchor.py --arms no-anchor protection distillation --seeds 0 1 2

Arms: ``anchor`` / ``no-anchor`` (the two configs), and the retention mechanisms of ``docs/algorithms.md``
(Retention), each on one of them with its switch (``RETENTION_ARMS``). With this two-task schedule the
per-task anchor equals the latest anchor (one earlier task); it differs from three tasks on. The
protection threshold 0.2 is above the uniform 1/8 of the tiny default's 8 experts.

Each run is a real `distmoe simulate` (Flower Simulation Engine).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

from distmoe.report.report import summarise

ARMS = {"anchor": "configs/continual.toml", "no-anchor": "configs/continual-no-anchor.toml"}
# arm -> (base arm, run-config overrides)
RETENTION_ARMS = {
    "per-task-anchor": ("anchor", "retention.task-anchors='mean'"),
    "protection": ("no-anchor", "retention.protect-mass=0.2 retention.protect-lr-scale=0.0"),
    "distillation": ("no-anchor", "retention.distill-weight=1.0 retention.distill-temperature=2.0"),
    "router-warmup": ("no-anchor", "train.router-warmup-steps=20 train.expert-schedule='cosine' "
                      "train.router-lr-scale=0.1"),
    "retention-all": ("anchor", "retention.task-anchors='mean' retention.protect-mass=0.2 "
                      "retention.protect-lr-scale=0.0 retention.distill-weight=1.0 train.router-warmup-steps=20 "
                      "train.expert-schedule='cosine' train.router-lr-scale=0.1"),
}
ROOT = Path(__file__).resolve().parent.parent


def run_one(arm: str, seed: int, runs_dir: Path, extra: str) -> Path:
    run_id = f"{arm}-s{seed}"
    if (runs_dir / run_id / "run.json").exists():
        rec = json.loads((runs_dir / run_id / "run.json").read_text())
        if rec.get("status") == "completed":
            print(f"reusing {runs_dir / run_id}", flush=True)
            return runs_dir / run_id
    base, own = RETENTION_ARMS.get(arm, (arm, ""))
    cmd = [sys.executable, "-m", "distmoe.cli", "simulate", "--config", str(ROOT / ARMS[base]),
           "--run-config", f"run.seed={seed} {own} {extra}".strip(), "--run-id", run_id, "--runs-dir", str(runs_dir)]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return runs_dir / run_id


def row_of(run_dir: Path) -> dict[str, float]:
    s = summarise(run_dir)
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    evals = [e for e in events if e.get("event") == "eval" and e.get("party") == "all"]
    rec = json.loads((run_dir / "run.json").read_text())
    cfg = rec["config"]
    phases = [p.strip() for p in cfg["schedule.phases"].split(",")]
    tasks = [p.split(":")[1].split("*")[0] for p in phases if p.startswith("sft:")]
    a, b = tasks[0], tasks[-1]
    num = lambda k: float(s[k]) if s.get(k) is not None else math.nan  # noqa: E731
    before = evals[0] if len(evals) > 1 else {}
    num0 = lambda k: float(before[k]) if before.get(k) is not None else math.nan  # noqa: E731
    return {f"accuracy A ({a}) before B": num0(f"acc/{a}"), "answer loss A before B": num0(f"loss/{a}"),
            "answer loss A after B": num(f"loss/{a}"), "routing KL after B": num("routing_kl"),
            "top-1 consistency": num("top1_consistency"),
            f"retention of A ({a})": num(f"retention/{a}"), f"accuracy A ({a}) after B": num(f"acc/{a}"),
            f"accuracy B ({b})": num(f"acc/{b}"), "load CV": num("load_cv"),
            "seed": float(cfg["run.seed"]), "anchor-kl-coef": float(cfg["routing.anchor-kl-coef"])}


def table(rows: dict[str, list[dict[str, float]]]) -> str:
    metrics = [k for k in next(iter(rows.values()))[0] if k not in ("seed", "anchor-kl-coef")]
    head = "| metric | " + " | ".join(f"{arm} (n={len(r)})" for arm, r in rows.items()) + " |"
    lines = [head, "|---|" + "---|" * len(rows)]
    for m in metrics:
        cells = []
        for r in rows.values():
            vals = [x[m] for x in r if math.isfinite(x[m])]
            if not vals:
                cells.append("–")
                continue
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            cells.append(f"{statistics.mean(vals):.3f} ± {sd:.3f} ({', '.join(f'{v:.3f}' for v in vals)})")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--runs-dir", default="runs")
    ap.add_argument("--run-config", default="", help="extra overrides for every run")
    ap.add_argument("--collect", nargs="*", help="existing run directories to tabulate instead of running")
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=[*ARMS, *RETENTION_ARMS])
    args = ap.parse_args()
    rows: dict[str, list[dict[str, float]]] = {arm: [] for arm in args.arms}
    if args.collect:
        for d in map(Path, args.collect):
            r = row_of(d)
            arm = d.name.rsplit("-s", 1)[0]  # run_one names runs <arm>-s<seed>
            arm = arm if arm in RETENTION_ARMS else "anchor" if r["anchor-kl-coef"] > 0 else "no-anchor"
            rows.setdefault(arm, []).append(r)
    else:
        for seed in args.seeds:
            for arm in args.arms:
                rows[arm].append(row_of(run_one(arm, seed, Path(args.runs_dir), args.run_config)))
    print(table({a: r for a, r in rows.items() if r}))


if __name__ == "__main__":
    main()
