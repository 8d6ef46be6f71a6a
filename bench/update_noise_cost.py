"""What update noise costs in the deployment example: ``docs/deploy.md``'s run config (``configs/continual.toml`` with
``federation.min-available = 3``, ``privacy.epsilon = 4``, ``privacy.min-parties = 3``, three parties) with
``privacy.update-noise-multiplier`` off and on, per seed on the same data, in process (``bench/continual_anchor.py``'s
``--exec inproc`` path: the exact coordinator and party code over ``LocalTransport``, secure aggregation and DP on).

    python bench/update_noise_cost.py --seeds 0 1 2 --settings off zu10.5 --keep-rows bench/results/update-noise
    # the reduced scale measured on the loaded 2-core machine: 1 + 1 SFT rounds of 10 local steps, one thread
    python bench/update_noise_cost.py --rounds 1 1 --extra "train.local-steps=10 privacy.secagg-premask=false" \
        --settings off zu5 --keep-rows bench/results/update-noise-1x1

Settings: ``off`` (the example as documented), ``zu<z>`` (the same with ``privacy.update-noise-multiplier = z``;
10.5 is the smallest half-step the plan accepts at ``privacy.epsilon = 4``: at 10 the 10 update releases and 2
evaluations alone spend 4.002; with ``--rounds 1 1`` it is 5: at 4.5 the derived router-statistics z is 15.1,
at 4 the 2 update releases and 2 evaluations alone spend 4.352), ``zu<z>@<eps>`` (the same at
``privacy.epsilon = eps``, to see where utility breaks). Prints, per final metric, each setting's per-seed values
and the paired difference from ``off`` (mean, 95 % t-interval; ``bench/e1_stats.py``).

Must not: change any run's data or seed between settings (the seed is the run's ``run.seed``: same data, same
initial model, same split).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_files  # noqa: E402
import continual_anchor as CA  # noqa: E402
import e1_stats  # noqa: E402

from distmoe.report.report import summarise  # noqa: E402

EXAMPLE = "federation.min-available=3 privacy.epsilon=4.0 privacy.min-parties=3"  # docs/deploy.md §1.5
METRICS = ("accuracy A (lookup) after B", "accuracy B (arith)", "answer loss A after B", "answer loss B (arith)",
           "accuracy A (lookup) before B", "answer loss A before B")


def overrides(setting: str) -> str:
    """The run-config overrides of a setting (after ``configs/continual.toml``)."""
    if setting == "off":
        return EXAMPLE
    if not setting.startswith("zu"):
        raise SystemExit(f"update_noise_cost: setting {setting!r} is neither 'off' nor 'zu<z>[@<epsilon>]'")
    z, _, eps = setting[2:].partition("@")
    extra = f" privacy.epsilon={float(eps)}" if eps else ""
    return f"{EXAMPLE}{extra} privacy.update-noise-multiplier={float(z)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--settings", nargs="*", default=["off", "zu10.5"])
    ap.add_argument("--runs-dir", default="runs/update-noise")
    ap.add_argument("--rounds", type=int, nargs=2, metavar=("A", "B"), help="sft rounds of task A and B (default: "
                    "the config's 5 each)")
    ap.add_argument("--extra", default="", help="run-config overrides for every setting (after the setting's)")
    ap.add_argument("--keep-rows", default="", help="copy each run's row.json, bench.json to DIR/<setting>-s<seed>/")
    args = ap.parse_args()
    rows: dict[str, dict[int, dict]] = {}
    for setting in args.settings:
        for seed in args.seeds:
            kept = Path(args.keep_rows) / f"{setting}-s{seed}" if args.keep_rows else None
            if kept is not None and (kept / "row.json").exists():
                rows.setdefault(setting, {})[seed] = json.loads((kept / "row.json").read_text())
                continue
            d = CA.run_one("anchor", seed, "lookup-arith", Path(args.runs_dir) / setting,
                           f"{overrides(setting)} {args.extra}", "inproc", None,
                           tuple(args.rounds) if args.rounds else None)
            row = CA.row_of(d)
            loss_b = summarise(d).get("loss/arith")  # the final evaluation's held-out answer loss of task B
            row["answer loss B (arith)"] = float(loss_b) if loss_b is not None else math.nan
            bench_files.write_bench_file(d, "row.json", json.dumps(row) + "\n")
            shutil.rmtree(d / "checkpoints", ignore_errors=True)  # about 300 MB a run
            if kept is not None:
                kept.mkdir(parents=True, exist_ok=True)
                (kept / "row.json").write_text(json.dumps(row) + "\n")
                shutil.copyfile(bench_files.bench_file(d, "bench.json"), kept / "bench.json")
            rows.setdefault(setting, {})[seed] = row
    for m in METRICS:
        print(f"\n### {m}\n\n| setting | per seed ({', '.join(f's{s}' for s in args.seeds)}) | mean | "
              "− off, paired: mean [95 % t] |\n|---|---|---|---|")
        for setting, by in rows.items():
            vals = [by[s].get(m, math.nan) for s in args.seeds if s in by]
            mean = sum(vals) / len(vals) if vals else math.nan
            cell = "–"
            if setting != "off" and "off" in rows:
                d = [by[s][m] - rows["off"][s][m] for s in args.seeds if s in by and s in rows["off"]]
                if len(d) >= 2 and all(math.isfinite(x) for x in d):
                    p = e1_stats.paired(d)
                    cell = f"{p['mean']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}]"
            print(f"| {setting} | {', '.join(f'{v:.3f}' for v in vals)} | {mean:.3f} | {cell} |")


if __name__ == "__main__":
    main()
