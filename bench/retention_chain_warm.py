"""Retention over a three-task chain in the continual-learning instrument's regime: the warm base, the backbone
frozen, three disjoint lookup tables T1 -> T2 -> T3, federated (3 parties, secure aggregation, DP-noised router
anchors at epsilon 8, in process). Do per-task anchors, or distillation, keep the earlier tasks better than no
mechanism? The chain of ``bench/retention_chain.py`` (which started from random initialisation) asked again from the
warm base of ``bench/retention_fed_warm.py`` (the two-task federated confirmation), reusing both benches' code.

    python bench/retention_chain_warm.py pilot --base B     # the smoke run (seed 100, 1 round a task; never tabulated)
    python bench/retention_chain_warm.py run --base B       # seeds 0, 1, ... until 04:30 UTC; rows: e1-chain-warm
    python bench/retention_chain_warm.py table              # the Markdown tables from the kept rows

``B`` = the warm base's checkpoint directory (``runs/e1/base-cache/base-<key>/round-0``, as for
``bench/retention_fed_warm.py``); every party and the coordinator load its ``model/`` as ``model.path``.

Pre-registered on 2026-12-07, before any run of this bench (the commit that adds this file says the time).

* Start: the warm base (base seed 0, 3,000 warm-up steps, gate passed; never copied into the repository) with
  ``model.trainable = "router+experts"``; the settings of ``bench/retention_fed_warm.py`` unchanged
  (``retention_fed_warm.SETTINGS``: ``train.local-steps=20 train.batch-size=16 train.threads=1
  privacy.ring-bits='64' checkpoint.every=1 checkpoint.keep=10 data.eval-fraction=0.5``, learning rates at their
  defaults). The row records the base's trainable hash.
* Data, written per run by ``retention_fed_warm.write_data`` with three tasks: T1, T2, T3 = ``lookup-t1``,
  ``lookup-t2``, ``lookup-t3``, the tables of ``distmoe.data.synth.disjoint_lookup(seed, 3, 88)`` (disjoint keys,
  distinct codes, 1,056 items a task), each shuffled by the seed and dealt round-robin to 3 parties; each party's
  fresh canary alone in its ``vault.jsonl`` and ``canaries.txt`` (the outbound guard and ``distmoe audit`` find it
  as before), so the task files are the same bytes in every run of a seed. About 528 held-out items a task pooled
  over the parties, evaluated here without a cap.
* Schedule (``phases``): ``sft:T1*8, eval, stats:T1, sft:T2*1, eval, stats:T2, sft:T3*1, eval``, the same in every
  arm. T1's 8 rounds are fed-warm's task A; T2's and T3's 1 round each is fed-warm's B length, the one its pilot
  chose (A kept about half after 1 round). Both stats rounds run in every arm (so the privacy plan, and the round
  numbering, are the same); only the per-task anchor arm reads them.
* Arms (``retention_chain.ARMS``, through ``continual_anchor.overrides_of``): ``none`` (``configs/continual-no-
  anchor.toml``), ``anchors`` (``configs/continual.toml``, batch anchor at coefficient 0.5, with
  ``retention.task-anchors='mean'``: while T2 trains the KL to T1's anchor, while T3 trains the mean of the KLs to
  T1's and T2's anchors, each from its own stats round) and ``distillation`` (none + ``retention.distill-weight=1.0
  retention.distill-temperature=2.0``: LwF, the teacher = the model at the start of each task).
* Straight chain per arm, no branching: one run per arm and seed trains T1 itself. Branching after T1 (one T1 run
  per seed, each arm started from its model) was NOT used: a resumed run may not change the ``retention.*`` keys,
  and a new run started from the exported post-T1 model would number its rounds, and plan its privacy, from 0, so
  its T2 and T3 would not be the straight chain's. With ring-bits 64 the arms train T1 identically: checked, not
  assumed (``table`` prints whether the trainable hash after T1 is identical across the arms of each seed).
* Seeds 0, 1, 2, ... seed-major with the arms interleaved (none, anchors, distillation), one run at a time, from
  about 03:20 UTC, in the background at low priority; the runner stops at the cut-off, 04:30 UTC on 2026-12-07:
  it starts no run after it and stops the run in flight at it (that run keeps no row). A seed missing an arm is
  left out of the tables (the table says which); fewer seeds are reported as such, never topped up. Each row
  records its wall time (run + noise-free evaluation) and the 1-minute load average at its start and end.
  Record, not a change of design: the pilot passed at 02:46 UTC, so the runner started then (seed 0's none arm at
  02:46:24 UTC), earlier than the 03:20 planned; the cut-off stays 04:30 UTC.
* The pilot, declared as such and never tabulated: the anchors arm at seed 100 with 1 round a task (``pilot``), to
  check the pipeline end to end (both stats rounds, the three kept models, the evaluation); its record goes to
  ``pilot.json`` beside the rows, which ``table`` never reads.
* Endpoints, noise-free from the checkpoints (``retention_chain.checkpoint_eval``: the models kept before T2 and
  before T3, and the last) on the pooled held-out items of each task: the accuracy matrix ``R[i][j]``; ``ACC =
  mean_j R[3][j]``; ``BWT = mean_{j<3} (R[3][j] - R[j][j])``; ``NLL_old`` = the mean of T1's and T2's answer NLL
  after T3 (nats per answer token). Secondary, outside the tests' families: T1's accuracy after T2 (``R[2][1]``, the
  two-task quantity, set beside fed-warm's +0.076 of distillation descriptively, with its paired interval), T1's
  and T2's NLL after T3 each, the NLL matrix and the run's released (noised) figures.
* Analysis (``bench/e1_stats.py`` through ``retention_chain.tables``): per endpoint (ACC, BWT, NLL_old) and arm, the
  per-seed difference arm - none; paired mean, 95 % t-interval, exact Wilcoxon p, Holm over the 2 arm-vs-none
  tests of the endpoint; an effect is claimed only where the Holm-adjusted interval excludes 0. (Corrected at
  03:27 UTC, after seed 1, wording only: the parenthesis "so at least 3 complete seeds are needed for any claim"
  that stood here was wrong; with 2 seeds two nearly equal differences can give a claim. The rule is unchanged.)
  "Per-task anchors keep earlier tasks" (likewise "distillation keeps
  them") holds only if the arm's BWT gain over none is claimed with a positive sign; it is reported together with
  ACC (a BWT gain with a claimed ACC loss is reported as bought with the new task) and NLL_old (a claim on NLL_old
  alone is reported as such, not as keeping the tasks).

Must not: change the product's code or defaults, copy the base into the repository, run after the cut-off, or
tabulate rows of another design (the pilot's included).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_files  # noqa: E402  (the bench's own files of a run, beside its run directory)
import continual_anchor as ca  # noqa: E402  (the federated driver, beside this file)
import e1_stats  # noqa: E402
import retention_chain as rch  # noqa: E402  (the chain's evaluation, endpoints and tables)
import retention_fed_warm as fw  # noqa: E402  (the warm regime's settings and data)
import run_checkpoints as rc  # noqa: E402

TASKS = ("lookup-t1", "lookup-t2", "lookup-t3")
ARMS = rch.ARMS  # none / anchors / distillation -> continual_anchor's arm
ROUNDS = (8, 1, 1)  # T1 = fed-warm's A; T2, T3 = fed-warm's pilot-chosen B length
PILOT_SEED, PILOT_ROUNDS = 100, (1, 1, 1)
UNTIL = "2026-12-07T04:30"  # UTC: the runner's cut-off
KEEP = Path(__file__).resolve().parent / "results" / "e1-chain-warm"


def phases(rounds: tuple[int, int, int]) -> str:
    """The chain's schedule: each task's sft rounds, an eval after each task, a stats round before T2 and T3."""
    if len(rounds) != len(TASKS) or min(rounds) < 1:
        raise ValueError(f"phases: need {len(TASKS)} round counts >= 1, got {rounds}")
    (t1, t2, t3), (r1, r2, r3) = TASKS, rounds
    return f"sft:{t1}*{r1}, eval, stats:{t1}, sft:{t2}*{r2}, eval, stats:{t2}, sft:{t3}*{r3}, eval"


def seconds_left(until: str, now: dt.datetime | None = None) -> float:
    """Seconds from ``now`` (default: the clock) to ``until`` (ISO date-time, UTC); negative once past."""
    end = dt.datetime.fromisoformat(until).replace(tzinfo=dt.UTC)
    return (end - (now or dt.datetime.now(dt.UTC))).total_seconds()


def run_one(name: str, seed: int, runs_dir: Path, base: Path, rounds: tuple[int, int, int]) -> tuple[Path, list[Path]]:
    """One federated run in process (``retention_fed_warm.run_one``'s path with the chain's tasks and schedule); a
    leftover run directory of the same name is removed first. Returns (run directory, party directories)."""
    from distmoe.config import parse_run_config
    from distmoe.simulate import SimOptions, prepare

    run_id = f"{name}-s{seed}"
    run_dir, data = runs_dir / run_id, runs_dir / f"{run_id}-data"
    for p in (run_dir, data, bench_files.bench_dir(run_dir)):
        shutil.rmtree(p, ignore_errors=True)
    fw.write_data(data, seed, TASKS)
    over = ca.overrides_of(ARMS[name], seed, "lookup-arith",
                           f"{fw.SETTINGS} model.path='{(base / 'model').resolve()}'", rounds[:2])
    over["schedule.phases"] = phases(rounds)
    run_dir, parties, over = prepare(SimOptions(overrides=over, data=data, run_id=run_id, runs_dir=runs_dir,
                                                echo=False))
    bench_files.run_prepared(parse_run_config(over), run_dir, parties, run_id)
    return run_dir, parties


def evaluate(run_dir: Path, parties: list[Path]) -> dict:
    """``retention_chain.checkpoint_eval`` on every held-out item of the parties (the evaluation cap lifted)."""
    from distmoe.data.party import load_party

    data_cfg = dataclasses.replace(rc.run_config(run_dir).data, max_eval_examples=10**9)
    return rch.checkpoint_eval(run_dir, TASKS, [load_party(p, data_cfg) for p in parties])


def one(name: str, seed: int, runs_dir: Path, base: Path, rounds: tuple[int, int, int], prune: bool = True) -> dict:
    """Run, evaluate and describe one run; the row also goes to the run's bench directory."""
    load0, t = os.getloadavg()[0], time.perf_counter()
    d, parties = run_one(name, seed, runs_dir, base, rounds)
    ev = evaluate(d, parties)
    row = {**rch.row_of(name, seed, ev), "a_after_t2": ev["acc_matrix"][1][0],
           "wall_s": round(time.perf_counter() - t, 1), "load": [round(load0, 2), round(os.getloadavg()[0], 2)],
           "rounds": list(rounds), "base": json.loads((base / "manifest.json").read_text())["trainable_hash"],
           "released": rch.released(d)}
    bench_files.write_bench_file(d, "row.json", json.dumps(row) + "\n")
    if prune:
        shutil.rmtree(d / "checkpoints", ignore_errors=True)  # the run's kept models: about 0.5 GB
    return row


def keep_one(name: str, seed: int, runs_dir: Path, keep: Path, base: Path) -> None:
    """``one`` at the design's rounds, its row kept as ``keep/<arm>-s<seed>/row.json``."""
    row = one(name, seed, runs_dir, base, ROUNDS)
    dest = keep / f"{name}-s{seed}"
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "row.json").write_text(json.dumps(row) + "\n")
    diag = [round(row["acc_matrix"][i][i], 3) for i in range(len(TASKS))]
    print(f"{name} s{seed}: ACC {row['acc']:.3f} BWT {row['bwt']:+.3f} NLL_old {row['nll_old']:.2f} diag {diag} "
          f"T1 after T2 {row['a_after_t2']:.3f}, {row['wall_s']:.0f} s, load {row['load']}", flush=True)


def run(seeds: list[int], runs_dir: Path, keep: Path, base: Path, until: str) -> None:
    """Every arm of every seed, seed-major, each run in a child process of its own process group (the same session,
    so the same low priority) that is stopped at ``until``; nothing starts after it."""
    for seed in seeds:
        for name in ARMS:
            if (keep / f"{name}-s{seed}" / "row.json").exists():
                print(f"kept already: {name}-s{seed}", flush=True)
                continue
            left = seconds_left(until)
            if left <= 0:
                print(f"cut-off {until} UTC reached: {name}-s{seed} and later runs not started", flush=True)
                return
            cmd = [sys.executable, str(Path(__file__).resolve()), "one", "--arm", name, "--seed", str(seed),
                   "--base", str(base), "--runs-dir", str(runs_dir), "--keep", str(keep)]
            child = subprocess.Popen(cmd, process_group=0)
            try:
                child.wait(timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGTERM)
                try:
                    child.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()
                shutil.rmtree(runs_dir / f"{name}-s{seed}" / "checkpoints", ignore_errors=True)
                print(f"cut-off {until} UTC: {name}-s{seed} stopped in flight (no row)", flush=True)
                return
            if child.returncode != 0:
                raise SystemExit(f"{name}-s{seed}: the run failed (exit {child.returncode}); see {runs_dir}")


def pilot(runs_dir: Path, keep: Path, base: Path) -> None:
    """The smoke run (module docstring): anchors at seed ``PILOT_SEED``, 1 round a task; its record is appended to
    ``keep/pilot.json``. The run directory keeps its checkpoints (for ``distmoe audit``)."""
    row = one("anchors", PILOT_SEED, runs_dir / "pilot", base, PILOT_ROUNDS, prune=False)
    path = keep / "pilot.json"
    keep.mkdir(parents=True, exist_ok=True)
    done = json.loads(path.read_text()) if path.exists() else []
    rec = {**row, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    path.write_text(json.dumps([*done, rec], indent=1) + "\n")
    print(json.dumps({k: rec[k] for k in ("acc_matrix", "acc", "bwt", "nll_old", "hashes", "wall_s", "load")}),
          flush=True)


def secondary(rows: list[dict]) -> str:
    """The descriptive figures outside the tests: T1 after T2 (paired with none), T1's and T2's NLL after T3, and
    the runs' wall times and loads."""
    seeds, _ = e1_stats.complete_seeds(rows, ARMS)
    if len(seeds) < 2:
        return ""
    by = {(int(r["seed"]), r["arm"]): r for r in rows}
    res = e1_stats.compare_arms({a: [by[(s, a)]["a_after_t2"] - by[(s, "none")]["a_after_t2"] for s in seeds]
                                 for a in ARMS if a != "none"})
    lines = ["Secondary, descriptive (outside the tests): T1's accuracy after T2 (R[2][1], the two-task quantity) "
             "and the old tasks' answer NLL after T3, mean ± sd over seeds:", "",
             "| arm | T1 after T2 | arm − none, T1 after T2 | T1 NLL after T3 | T2 NLL after T3 |",
             "|---|---|---|---|---|"]
    for a in ARMS:
        cells = [rch._cell([by[(s, a)][k] if isinstance(k, str) else by[(s, a)]["nll_matrix"][2][k] for s in seeds])
                 for k in ("a_after_t2", 0, 1)]
        diff = "" if a == "none" else f"{res[a]['mean']:+.3f} [{res[a]['lo']:+.3f}, {res[a]['hi']:+.3f}]"
        lines.append(f"| {a} | {cells[0]} | {diff} | {cells[1]} | {cells[2]} |")
    loads = [x for s in seeds for a in ARMS for x in by[(s, a)]["load"]]
    lines += ["", f"Load (1-min average, 2 shared cores) at the runs' start and end: {min(loads):.1f}-"
              f"{max(loads):.1f}."]
    return "\n".join(lines)


def table(keep: Path) -> str:
    rows = e1_stats.load_rows(keep)
    return (f"Schedule: {phases(ROUNDS)}; arms {', '.join(ARMS)}; cut-off {UNTIL} UTC.\n\n"
            + rch.tables(rows, TASKS) + "\n\n" + secondary(rows))


def main(argv: list[str] | None = None) -> None:
    ap, cmds = fw.parser(__doc__.split("\n\n")[0],
                         (("pilot", "the smoke run: anchors at seed 100, 1 round a task (never tabulated)"),
                          ("run", "run the arms seed by seed until the cut-off, keep one row per run"),
                          ("one", "one arm and seed (what `run` starts in a child process)")),
                         Path("runs/e1-chain-warm"), KEEP)
    cmds["run"].add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    cmds["run"].add_argument("--until", default=UNTIL, help="the cut-off, ISO date-time in UTC")
    cmds["one"].add_argument("--arm", required=True, choices=list(ARMS))
    cmds["one"].add_argument("--seed", type=int, required=True)
    args = ap.parse_args(argv)
    if args.cmd == "table":
        print(table(args.keep))
        return
    fw.check_base(args.base)
    if args.cmd == "pilot":
        pilot(args.runs_dir, args.keep, args.base)
    elif args.cmd == "one":
        keep_one(args.arm, args.seed, args.runs_dir, args.keep, args.base)
    else:
        seconds_left(args.until)  # a malformed cut-off fails here, before any run
        run(args.seeds, args.runs_dir, args.keep, args.base, args.until)

if __name__ == "__main__":
    main()
