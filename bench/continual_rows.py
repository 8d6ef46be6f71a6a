"""The rows and tables of the continual experiment (``bench/continual_anchor.py``): a finished run's table row
(``row_of``: retention of task A, accuracies, routing figures, wall time; on the public routing probe under secure
aggregation, ``probe_rows``), a row kept beside the repository (``keep_row``), each arm's per-seed difference from
``no-anchor`` (``paired``) and the markdown table of the arms (``table``).

Must not: start or change runs (it reads a run directory's records and kept checkpoints only).
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_files import bench_file  # noqa: E402  (beside this file)

from distmoe.report.report import summarise  # noqa: E402


def probe_rows(run_dir: Path, b: str) -> dict[str, float]:
    """Routing metrics on the public routing probe (what the federation releases under secure aggregation, where
    the held-out routing metrics stay at the parties): the last probe's routing KL to the anchor and expert-load
    CV, and the top-1 consistency of the final model with the model kept before task ``b`` (checkpoint manifest
    ``kept = "before task <b>"``) on the probe prompts: the share of (layer, prompt token) pairs whose top-1
    expert is the same."""
    import numpy as np
    import run_checkpoints as rc

    from distmoe.coordinator.phases.probe import prompts_for
    from distmoe.routing.probe import probe_routing

    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    probes = [e for e in events if e.get("event") == "probe"]
    last = probes[-1] if probes else {}
    out = {"routing KL after B": float(last.get("routing_kl", math.nan)), "top-1 consistency": math.nan,
           "load CV": float(last.get("load_cv", math.nan))}
    ckpts = rc.kept(run_dir)
    before = [d for _r, (man, d) in sorted(ckpts.items()) if man.get("kept") == f"before task {b}"]
    if not before or not (ckpts[max(ckpts)][1] / "model").is_dir():
        return out
    cfg = rc.run_config(run_dir)
    prompts = prompts_for(cfg)
    tops = []
    for d in (before[-1], ckpts[max(ckpts)][1]):
        model, tok = rc.model_at(cfg, d)
        tops.append(probe_routing(model, tok, prompts, cfg.model.max_seq_len, cfg.eval.batch_size)[1])  # [L, N]
    out["top-1 consistency"] = float(np.mean(tops[0] == tops[1]))
    return out


def row_of(run_dir: Path) -> dict[str, float]:
    if bench_file(run_dir, "row.json").exists():  # kept when --prune removed the checkpoints
        return json.loads(bench_file(run_dir, "row.json").read_text())
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
    bench = json.loads(bench_file(run_dir, "bench.json").read_text()) if bench_file(run_dir, "bench.json").exists() \
        else {}
    names = (("routing KL after B", "routing_kl"), ("top-1 consistency", "top1_consistency"), ("load CV", "load_cv"))
    routing = {k: num(k2) for k, k2 in names}
    if all(math.isnan(v) for v in routing.values()):  # secure aggregation: the public probe's figures
        routing = probe_rows(run_dir, b)
    return {f"retention of A ({a})": num(f"retention/{a}"), f"accuracy A ({a}) before B": num0(f"acc/{a}"),
            f"accuracy A ({a}) after B": num(f"acc/{a}"), f"accuracy B ({b})": num(f"acc/{b}"),
            **routing, "answer loss A before B": num0(f"loss/{a}"),
            "answer loss A after B": num(f"loss/{a}"), "wall time (s)": float(bench.get("wall_s", math.nan)),
            "seed": float(cfg["run.seed"]), "anchor-kl-coef": float(cfg["routing.anchor-kl-coef"])}


def paired(rows: dict[str, list[dict[str, float]]], base: str = "no-anchor") -> dict[str, list[dict[str, float]]]:
    """Each arm's per-seed difference from ``base`` (same seed, hence the same data and, for the arms that leave
    task A's training alone, the same model before B) in retention of A and accuracy of B: rows ``Δ ... vs none``."""
    if base not in rows:
        return rows
    ref = {r["seed"]: r for r in rows[base]}
    out = {}
    for arm, rs in rows.items():
        new = []
        for r in rs:
            keys = [k for k in r if k.startswith(("retention of A", "accuracy B"))]
            b = ref.get(r["seed"]) if arm != base else None
            new.append({**r, **{f"Δ {k} vs none (paired)": r[k] - b[k] if b else math.nan for k in keys}})
        out[arm] = new
    return out


def table(rows: dict[str, list[dict[str, float]]]) -> str:
    rows = paired(rows)
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
            if m.startswith("wall"):
                cells.append(f"{statistics.mean(vals):.0f}")
                continue
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            cells.append(f"{statistics.mean(vals):.3f} ± {sd:.3f} ({', '.join(f'{v:.3f}' for v in vals)})")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def keep_row(run_dir: Path, row: dict[str, float], dest: Path) -> Path:
    """Copy a finished run's table row and its bench.json to ``dest/<run name>/`` (a few hundred bytes)."""
    out = dest / run_dir.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "row.json").write_text(json.dumps(row) + "\n")
    shutil.copyfile(bench_file(run_dir, "bench.json"), out / "bench.json")
    return out
