"""Paired intervals for kept per-run rows (``<dir>/<arm>[-<order>]-s<seed>/row.json``, as
``bench/continual_anchor.py --keep-rows`` writes them): per arm, the arm minus a reference arm at the same seed and
order, with the 95 % t-interval, the Wilcoxon p and the Holm correction over the arms (``bench/e1_stats.py``).

    python bench/paired_rows.py bench/results/continual13 --metric "accuracy A (lookup) after B"
    python bench/paired_rows.py bench/results/continual13 --order arith-lookup --metric "accuracy A (arith) after B"

Must not: run anything or write files; it reads rows and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e1_stats  # noqa: E402

_RUN = re.compile(r"^(?P<arm>.+?)(?:-(?P<order>arith-lookup))?-s(?P<seed>\d+)$")


def load(root: Path, order: str) -> dict[str, dict[int, dict]]:
    """arm -> seed -> row, for the runs of ``order`` (``lookup-arith`` runs carry no order in their name)."""
    out: dict[str, dict[int, dict]] = {}
    for d in sorted(root.iterdir()):
        m = _RUN.match(d.name)
        if not m or not (d / "row.json").is_file():
            continue
        if (m["order"] or "lookup-arith") != order:
            continue
        out.setdefault(m["arm"], {})[int(m["seed"])] = json.loads((d / "row.json").read_text())
    return out


def table(rows: dict[str, dict[int, dict]], metric: str, reference: str, arms: list[str]) -> str:
    if reference not in rows:
        raise SystemExit(f"paired_rows: no rows of the reference arm {reference!r} (have {sorted(rows)})")
    ref = rows[reference]
    diffs, means = {}, {}
    for arm in arms:
        seeds = sorted(set(rows.get(arm, {})) & set(ref))
        vals = [(rows[arm][s].get(metric), ref[s].get(metric)) for s in seeds]
        pairs = [(a, b) for a, b in vals if isinstance(a, (int, float)) and isinstance(b, (int, float))]
        if len(pairs) >= 2:
            diffs[arm] = [a - b for a, b in pairs]
            means[arm] = (sum(a for a, _ in pairs) / len(pairs), sum(b for _, b in pairs) / len(pairs), len(pairs))
    res = e1_stats.compare_arms(diffs)
    lines = [f"| arm | {metric}: arm / {reference} (n) | arm − {reference}, paired: mean [95 % t] (Holm) |",
             "|---|---|---|"]
    for arm in diffs:
        a, b, n = means[arm]
        lines.append(f"| {arm} | {a:.3f} / {b:.3f} ({n}) | {e1_stats.fmt_test(res[arm])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--metric", required=True)
    ap.add_argument("--order", default="lookup-arith", choices=("lookup-arith", "arith-lookup"))
    ap.add_argument("--reference", default="no-anchor")
    ap.add_argument("--arms", nargs="*", default=["anchor", "anchor-token", "protection", "distillation",
                                                     "expansion", "combined", "replay"])
    args = ap.parse_args(argv)
    print(table(load(args.root, args.order), args.metric, args.reference, args.arms))


if __name__ == "__main__":
    main()
