"""Retention over a three-task chain, federated: does a rehearsal-free mechanism keep the earlier tasks of T1 -> T2
-> T3? The accuracy matrix, average accuracy and backward transfer of the product's federated run (3 parties, secure
aggregation, DP-noised router anchors at epsilon 8, driven in process by ``bench/continual_anchor.py``'s
``run_one``: the exact coordinator and party code over ``distmoe.inprocess.LocalTransport``), per arm and seed.

    python bench/retention_chain.py run --seeds 0 1 2 3 4     # rows: bench/results/e1-chain
    python bench/retention_chain.py table                     # the Markdown tables from the kept rows

Pre-registered on 2026-12-06, before any run of this bench (the design of ``bench/retention_fed.py``, the two-task
federated confirmation, extended to three tasks).

* Tasks: T1 = lookup, T2 = arith, T3 = strings (``distmoe/data/synth.py``), 3 parties, default data. Schedule
  ``sft:lookup*3, eval, stats:lookup, sft:arith*3, eval, stats:arith, sft:strings*3, eval`` (r = 3 rounds a task)
  with ``train.local-steps=20 train.batch-size=16 train.threads=1`` (the shortened federated schedule).
* Arms: ``none`` (``configs/continual-no-anchor.toml``: anchor coefficient 0, distillation off), ``anchors``
  (per-task anchors: ``configs/continual.toml``, batch anchor at coefficient 0.5, with ``retention.task-anchors=
  'mean'``: while T2 trains the KL to T1's anchor, while T3 trains the mean of the KLs to T1's and T2's anchors,
  each anchor from its own ``stats`` phase) and ``distillation`` (none + ``retention.distill-weight=1.0
  retention.distill-temperature=2.0``: LwF, the teacher is the model at the start of each task).
* Seeds 0..4 (N = 5), seed-major with the three arms interleaved (seed 0: none, anchors, distillation; seed 1: ...),
  one run at a time, so that a cut-off leaves whole seeds; a seed missing an arm is left out of the tables (the
  table says which). Fewer complete seeds are reported as such, never topped up by other rows.
  Amended after the timing run (seed 0's none arm, the first run of the sweep, same design; kept): it took 208 s
  (198 s run + 10 s evaluation) on 2 cores shared with another sweep (load average 6.5-7.4), so 15 runs need about
  53 min and would end after the session's cut-off of 18:20 UTC. Hence: seeds 0, 1, 2, ... in order, as many whole
  seeds as finish by 18:20 UTC (at least 3, at most 5); the run in flight at 18:20 is stopped and its seed left
  out. A time rule, fixed before any other run had finished; the design was not changed although the timing run
  showed T3 (strings) at 0.000 after its 3 rounds (its diagonal entry R[3][3]).
* Pairing: ``privacy.ring-bits=64`` (nearest rounding in the secure sums): the arms train T1 identically, so they
  start T2 from the same model (checked: ``table`` prints whether the trainable hash after T1 is identical across
  the arms of each seed). From T2 on the pairing is by seed only: ``distmoe simulate``'s data writer plants a fresh
  canary in the first file it writes (arith's, i.e. T2's), and the DP noise of the anchors is drawn from OS entropy.
  Both are independent between runs, so the paired t-intervals stay valid (wider). The anchors' DP noise is
  calibrated by the privacy plan over this schedule's two ``stats`` releases (and its evaluations) at epsilon 8.
* Endpoints, evaluated by this bench WITHOUT noise from the checkpoints kept before T2 and before T3 (the models
  after T1 and after T2) and from the final model (after T3), on the parties' pooled held-out items of each task:
  the accuracy matrix ``R[i][j]`` = exact-match accuracy on task j after training task i (i, j = 1..3); average
  accuracy ``ACC = mean_j R[3][j]``; backward transfer ``BWT = mean_{j<3} (R[3][j] - R[j][j])``; and ``NLL_old`` =
  the mean over T1 and T2 of the answer NLL after T3 (per task the mean over items of the mean cross-entropy per
  answer token, nats). Beside them, not tested: the whole NLL matrix and the run's released (noised) figures.
* Analysis (``bench/e1_stats.py``): per endpoint (ACC, BWT, NLL_old) and arm, the per-seed difference arm - none;
  paired mean, 95 % t-interval, exact Wilcoxon p, Holm over the 2 arm-vs-none tests of the endpoint; an effect is
  claimed only where the Holm-adjusted interval excludes 0. ACC says whether the arm ends better overall; BWT
  whether it forgets less (a BWT gain bought with a lower R[3][3] shows in ACC and in the matrix).

Must not: change the product's code or defaults, or tabulate rows of another design.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_files  # noqa: E402
import continual_anchor as ca  # noqa: E402  (the federated driver, beside this file)
import e1_stats  # noqa: E402
import run_checkpoints as rc  # noqa: E402

TASKS = ("lookup", "arith", "strings")
R = 3  # sft rounds a task
ARMS = {"none": "no-anchor", "anchors": "per-task-anchor", "distillation": "distillation"}  # -> continual_anchor arm
PHASES = (f"sft:{TASKS[0]}*{R}, eval, stats:{TASKS[0]}, sft:{TASKS[1]}*{R}, eval, stats:{TASKS[1]}, "
          f"sft:{TASKS[2]}*{R}, eval")
SETTINGS = ("train.local-steps=20 train.batch-size=16 train.threads=1 privacy.ring-bits='64' "
            f"schedule.phases='{PHASES}'")
ENDPOINTS = {"acc": "ACC (mean accuracy after T3)", "bwt": "BWT (backward transfer)",
             "nll_old": "NLL of T1, T2 after T3 (nats)"}
KEEP = Path(__file__).resolve().parent / "results" / "e1-chain"


def task_models(run_dir: Path, tasks: tuple[str, ...] = TASKS) -> list[tuple[dict, Path]]:
    """[(manifest, dir)] of the model after each task: the checkpoints kept before T2 and T3, and the last round."""
    mans = rc.kept(run_dir)
    out = []
    for t in tasks[1:]:
        kept = [r for r in sorted(mans) if mans[r][0].get("kept") == f"before task {t}"]
        if not kept:
            raise SystemExit(f"{run_dir}: no checkpoint kept 'before task {t}'")
        out.append(mans[kept[-1]])
    return [*out, mans[max(mans)]]


def checkpoint_eval(run_dir: Path, tasks: tuple[str, ...] = TASKS, data: list | None = None) -> dict:
    """Noise-free accuracy and NLL matrices ``acc_matrix[i][j]``, ``nll_matrix[i][j]`` (model after task i, task j;
    0-based) over the parties' pooled held-out items that fit ``model.max-seq-len``. ``data``: the parties'
    ``PartyData``, default ``rc.party_data`` of the run."""
    import torch

    torch.set_num_threads(1)
    cfg = rc.run_config(run_dir)
    data = rc.party_data(run_dir, cfg) if data is None else data
    models = task_models(run_dir, tasks)
    out: dict = {"hashes": [m["trainable_hash"] for m, _ in models], "acc_matrix": [], "nll_matrix": [], "n": []}
    for _man, d in models:
        model, tok = rc.model_at(cfg, d)
        model.eval()
        accs, nlls, ns = [], [], []
        for task in tasks:
            scores = rc.pooled_scores(model, tok, cfg, data, task)
            accs.append(statistics.fmean(float(ok) for ok, _ in scores))
            nlls.append(statistics.fmean(loss for _, loss in scores))
            ns.append(len(scores))
        out["acc_matrix"].append(accs)
        out["nll_matrix"].append(nlls)
        out["n"] = ns
    return out


def endpoints(acc: list[list[float]], nll: list[list[float]]) -> dict[str, float]:
    """ACC = mean_j R[T][j], BWT = mean_{j<T} (R[T][j] - R[j][j]) (Lopez-Paz & Ranzato 2017, GEM), NLL_old = mean_{j<T}
    nll[T][j]; ``acc``/``nll``: [T][T], row i = the model after task i."""
    t = len(acc)
    if t < 2 or any(len(row) != t for row in acc) or len(nll) != t or any(len(row) != t for row in nll):
        raise ValueError(f"endpoints: need square matrices of >= 2 tasks, got {acc} / {nll}")
    last = t - 1
    return {"acc": statistics.fmean(acc[last]),
            "bwt": statistics.fmean(acc[last][j] - acc[j][j] for j in range(last)),
            "nll_old": statistics.fmean(nll[last][j] for j in range(last))}


def row_of(arm: str, seed: int, ev: dict) -> dict:
    """A kept row: the arm, the seed, ``checkpoint_eval``'s matrices and hashes, and the endpoints."""
    return {"arm": arm, "seed": seed, **ev, **endpoints(ev["acc_matrix"], ev["nll_matrix"])}


def run(seeds: list[int], runs_dir: Path, keep: Path) -> None:
    for seed in seeds:
        for name, arm in ARMS.items():
            dest = keep / f"{name}-s{seed}"
            if (dest / "row.json").exists():
                print(f"kept already: {dest}", flush=True)
                continue
            t = time.perf_counter()
            d = ca.run_one(arm, seed, "lookup-arith", runs_dir, SETTINGS, "inproc", None, (R, R))
            run_s = json.loads(bench_files.bench_file(d, "bench.json").read_text())["wall_s"]
            ev = checkpoint_eval(d)
            row = {**row_of(name, seed, ev), "run_s": run_s, "wall_s": round(time.perf_counter() - t, 1),
                   "released": released(d)}
            dest.mkdir(parents=True, exist_ok=True)
            (dest / "row.json").write_text(json.dumps(row) + "\n")
            shutil.rmtree(d / "checkpoints", ignore_errors=True)  # about 300 MB a run
            diag = [round(ev["acc_matrix"][i][i], 3) for i in range(len(TASKS))]
            print(f"{name} s{seed}: ACC {row['acc']:.3f} BWT {row['bwt']:+.3f} NLL_old {row['nll_old']:.2f}, "
                  f"diag {diag}, {row['wall_s']:.0f} s", flush=True)


def released(run_dir: Path) -> list[dict[str, float]]:
    """The run's own (Skellam-noised) pooled eval releases, in order: ``acc/<task>`` and ``loss/<task>``."""
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return [{k: v for k, v in e.items() if k.startswith(("acc/", "loss/"))}
            for e in events if e.get("event") == "eval" and e.get("party") == "all"]


load_rows = e1_stats.load_rows


def complete_seeds(rows: list[dict]) -> tuple[list[int], list[int]]:
    """(seeds with a row of every arm, seeds cut off before every arm ran)."""
    return e1_stats.complete_seeds(rows, ARMS)


def compare(by: dict, seeds: list[int], key: str) -> dict[str, dict[str, float]]:
    """Per arm other than none: ``e1_stats.compare_arms`` of (arm - none) over ``seeds`` at endpoint ``key``."""
    diffs = {a: [by[(s, a)][key] - by[(s, "none")][key] for s in seeds] for a in ARMS if a != "none"}
    return e1_stats.compare_arms(diffs)


def _cell(vals: list[float]) -> str:
    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return f"{statistics.fmean(vals):.3f} ± {sd:.3f}"


def matrix(by: dict, seeds: list[int], arm: str, key: str = "acc_matrix", tasks: tuple[str, ...] = TASKS
           ) -> list[str]:
    """The mean matrix of ``arm`` over ``seeds`` as Markdown rows (row = after task i, column = task j)."""
    lines = ["| after \\ on | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    for i, t in enumerate(tasks):
        cells = [f"{statistics.fmean(by[(s, arm)][key][i][j] for s in seeds):.3f}" for j in range(len(tasks))]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return lines


def tables(rows: list[dict], tasks: tuple[str, ...] = TASKS) -> str:
    seeds, cut = complete_seeds(rows)
    if len(seeds) < 2:
        return f"fewer than 2 complete seeds ({seeds}); cut off: {cut}"
    by = {(int(r["seed"]), r["arm"]): r for r in rows}
    bad = [f"s{s}" for s in seeds if len({by[(s, a)]["hashes"][0] for a in ARMS}) > 1]
    lines = [f"Complete seeds: {seeds} (n = {len(seeds)})" + (f"; cut off before every arm ran: {cut}" if cut else ""),
             "Pairing through T1 (model after T1: the same trainable hash in every arm of a seed): "
             + ("exact on every seed." if not bad else "NOT exact on " + ", ".join(bad)),
             f"Held-out items per task ({', '.join(tasks)}): {by[(seeds[0], 'none')]['n']}.", ""]
    for a in ARMS:
        lines += [f"Accuracy matrix R[i][j], {a}, mean over seeds (noise-free):", "",
                  *matrix(by, seeds, a, tasks=tasks), ""]
    for a in ARMS:  # descriptive, outside the tests
        lines += [f"Answer NLL matrix (nats), {a}, mean over seeds:", "",
                  *matrix(by, seeds, a, "nll_matrix", tasks), ""]
    lines += ["Per arm, mean ± sd over seeds:", "", "| arm | " + " | ".join(ENDPOINTS.values()) + " |",
              "|---|" + "---|" * len(ENDPOINTS)]
    for a in ARMS:
        lines.append(f"| {a} | " + " | ".join(_cell([by[(s, a)][k] for s in seeds]) for k in ENDPOINTS) + " |")
    lines += ["", "Arm − none, paired over seeds: mean [95 % t] (Holm over the 2 arm-vs-none tests of the endpoint, "
              "t-test p → Holm, Wilcoxon p → Holm):", "",
              "| endpoint | " + " | ".join(a for a in ARMS if a != "none") + " |", "|---|---|---|"]
    for key, label in ENDPOINTS.items():
        res = compare(by, seeds, key)
        lines.append(f"| {label} | " + " | ".join(e1_stats.fmt_test(res[a]) for a in res) + " |")
    lines += ["", "Per seed, diagonal R[j][j] → last row R[3][j] (none / anchors / distillation):", ""]
    for s in seeds:
        cells = []
        for a in ARMS:
            m = by[(s, a)]["acc_matrix"]
            cells.append(" ".join(f"{m[j][j]:.2f}→{m[-1][j]:.2f}" for j in range(len(tasks))))
        lines.append(f"- s{s}: " + " / ".join(cells))
    walls = [by[(s, a)]["wall_s"] for s in seeds for a in ARMS]
    lines += ["", f"Wall time a run (run + noise-free evaluation): {min(walls):.0f}-{max(walls):.0f} s."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the arms seed by seed, keep one row per run")
    r.add_argument("--seeds", type=int, nargs="+", default=list(range(5)))
    r.add_argument("--runs-dir", type=Path, default=Path("runs/e1-chain"))
    r.add_argument("--keep", type=Path, default=KEEP)
    t = sub.add_parser("table", help="the Markdown tables from the kept rows")
    t.add_argument("--keep", type=Path, default=KEEP)
    args = ap.parse_args(argv)
    if args.cmd == "run":
        run(args.seeds, args.runs_dir, args.keep)
    else:
        print(tables(load_rows(args.keep)))


if __name__ == "__main__":
    main()
