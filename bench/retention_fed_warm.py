"""The federated confirmation of the continual-learning instrument's centralised finding, in the instrument's own
regime: the warm base, the backbone frozen (``model.trainable = "router+experts"``), two disjoint lookup tables.
Does distillation (or the default anchor) keep more of task A after task B than no mechanism, federated (3 parties,
secure aggregation, DP-noised router anchors at epsilon 8, in process)?

    python bench/retention_fed_warm.py pilot --base B     # once: the pilot (none arm, seed 100), fixes B's rounds
    python bench/retention_fed_warm.py run --base B       # seeds 0..9 seed-major; rows: bench/results/e1-federated-warm
    python bench/retention_fed_warm.py table              # the Markdown tables from the kept rows

``B`` = a warm base's checkpoint directory, e.g. the one ``python bench/retention_e1.py base --base-seed 0`` (or
``distmoe base build``) prints: ``runs/e1/base-cache/base-<key>/round-0``; the run loads its ``model/`` as
``model.path``.

Pre-registered on 2026-12-06, before any run of this bench. Why a new bench: ``bench/retention_fed.py`` started
from random initialisation with every parameter trained, and task A was at 0.000 after B in all its 30 runs (no
accuracy gain could show); and ``distmoe simulate``'s synthetic data planted each party's fresh canary in task B's
file, so B's training differed between runs of one seed (a null band of 0.27-0.50 nats on A's NLL).

* Start: the warm base of the instrument (base seed 0, 3,000 warm-up steps, gate passed; passed with ``--base``,
  never copied into the repository), loaded by every party and the coordinator through ``model.path``, with
  ``model.trainable = "router+experts"`` (the backbone frozen; only routers and experts train and travel). The
  row records the base's trainable hash.
* Data, written by this bench per run (``--data`` of the run; ``write_data``): task A = ``lookup-t1``, task B =
  ``lookup-t2``, the two tables of ``distmoe.data.synth.disjoint_lookup(seed, 2, 88)`` (88 keys each, disjoint
  keys, distinct codes, each key in all 12 phrasings: 1,056 items a task), each task's items shuffled (seeded by
  the seed) and dealt round-robin to 3 parties. The product's split holds out each item by its own hash at
  ``data.eval-fraction = 0.5``: about 528 held-out items a task pooled over the parties (at least 480 with
  probability about 0.999), evaluated here without a cap; the federation's own released evaluation keeps its
  cap (``data.max-eval-examples``, 48 a party). Each party's fresh secret canary (``make_canary``) is the answer
  of the one example of its own task file ``vault.jsonl`` and is listed in its ``canaries.txt``, where the
  party's outbound guard and ``distmoe audit`` find and search it as before; no phase names that task, so A's
  and B's files are the same bytes in every run of a seed.
* Schedule: ``sft:lookup-t1*8, eval, stats:lookup-t1, sft:lookup-t2*NB, eval``, ``train.local-steps=20
  train.batch-size=16 train.threads=1`` (learning rates at their defaults, 1e-3, the instrument's), secure
  aggregation with ``privacy.ring-bits=64`` (nearest rounding: the aggregate is a deterministic function of the
  seed, so every arm starts B from the same model; ``bench/retention_fed.py`` says why), the DP of the anchor and
  of the released evaluations unchanged (epsilon 8), ``checkpoint.every=1 checkpoint.keep=10``.
* The pilot, declared as such and never tabulated: the none arm at seed 100 (outside the tabulated seeds) with
  NB = 4. Gate: A's held-out accuracy before B >= 0.5 (else A gets 12 rounds and the pilot runs again, declared).
  NB = the B round count (1..4) whose kept fraction of A, (acc_A(after B) - acc_A(initial model)) / (acc_A(before
  B) - acc_A(initial model)), is closest to 0.5 within [0.2, 0.8] (``e1_stats.choose_length``); if none is, the
  one closest to 0.5, reported as the gate not met. A run must take <= 4 min on the loaded machine: the pilot's
  wall time (with 4 B rounds, so an upper bound) says whether it does. ``run`` reads A's and B's rounds from the
  pilot's record (``pilot.json``), so no edit follows the pilot.
* Arms: ``none`` (``configs/continual-no-anchor.toml``), ``anchor`` (the default batch anchor at coefficient 0.5,
  ``configs/continual.toml``) and ``distillation`` (none + ``retention.distill-weight=1.0
  retention.distill-temperature=2.0``: LwF, the model before B as the teacher), exactly as in
  ``bench/retention_fed.py`` (``continual_anchor.overrides_of``).
* Seeds 0..9, run seed-major with the three arms interleaved (seed 0: none, anchor, distillation; seed 1: ...),
  one run at a time, from 20:40 UTC, as many as finish (complete seeds before 21:40 UTC); a seed missing an arm is
  left out of the tables (the table says which); fewer than 10 complete seeds are reported as such, never topped
  up by other rows. Seed 0's none arm runs twice (after seed 0's arms): identical final trainable hashes mean
  that a paired difference holds no run-to-run noise (null band exactly 0).
  Continuation, declared on 2026-12-06 at 23:24 UTC before any run of these seeds: seeds 3..9 run the same way
  (``run --seeds 3 4 5 6 7 8 9 --repeat``, no repeat arm), on the code of the first three seeds (the commit
  before the parties' fused optimizer, so every seed has the same optimizer), as many as finish by 01:45 UTC;
  the tables then pool every complete seed of 0..9, and say how many.
* Endpoints, evaluated without noise from the checkpoints on the pooled held-out items
  (``retention_fed.checkpoint_eval``): A's exact-match accuracy after B (absolute), A's answer NLL after B (nats
  per answer token), B's accuracy and NLL after B; beside them A's accuracy and NLL before B (whether A was
  learned; the table says how many seeds are below 0.5) and each run's wall time and load.
* Analysis (``bench/e1_stats.py``, through ``retention_fed.tables``): per endpoint and arm the per-seed difference
  arm - none; paired mean, 95 % t-interval, exact Wilcoxon p, Holm over the 2 arm-vs-none tests of the endpoint;
  an effect is claimed only where the Holm-adjusted interval excludes 0. Distillation's centralised gain is
  "confirmed federated" only if it is claimed on A's accuracy after B with a positive sign; a claim on A's NLL
  alone is reported as such. Secondary, outside the Holm family: the forgetting curve and A's accuracy at equal
  B loss (Stage 1's rule).

Must not: change the product's code or defaults, copy the base into the repository, or tabulate rows of another
design (the pilot's included).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_files  # noqa: E402  (the bench's own files of a run, beside its run directory)
import continual_anchor as ca  # noqa: E402  (the federated driver, beside this file)
import e1_stats  # noqa: E402
import retention_fed as rf  # noqa: E402
import run_checkpoints as rc  # noqa: E402

from distmoe.config import parse_run_config  # noqa: E402
from distmoe.data.party import load_party  # noqa: E402
from distmoe.data.synth import disjoint_lookup, make_canary  # noqa: E402

ARMS = rf.ARMS  # none / anchor / distillation -> continual_anchor's arm
TASKS = ("lookup-t1", "lookup-t2")  # A, B
KEYS, PARTIES = 88, 3
A_ROUNDS, A_GATE = 8, 0.5
PILOT_SEED, PILOT_B = 100, 4
CANARY_TASK = "vault"
SETTINGS = ("train.local-steps=20 train.batch-size=16 train.threads=1 privacy.ring-bits='64' "
            "checkpoint.every=1 checkpoint.keep=10 model.trainable='router+experts' data.eval-fraction=0.5")
KEEP = Path(__file__).resolve().parent / "results" / "e1-federated-warm"


def write_data(out: Path, seed: int, tasks: tuple[str, ...] = TASKS) -> list[Path]:
    """The parties' directories of ``seed`` (module docstring): the tasks' items (``disjoint_lookup(seed,
    len(tasks), KEYS)``, default A's and B's) dealt round-robin, each party's fresh canary alone in ``vault.jsonl``
    and in ``canaries.txt``. The task files are a function of the seed."""
    tables = disjoint_lookup(seed, len(tasks), KEYS)
    old = os.umask(0o077)  # party data is private to its owner (simulate refuses it otherwise)
    try:
        dirs = [out / f"party-{i}" for i in range(PARTIES)]
        for d in dirs:
            d.mkdir(parents=True)
        for task, (train, held) in zip(tasks, tables, strict=True):
            items = train + held
            random.Random(f"retention-fed-warm:{seed}:{task}").shuffle(items)
            for i, d in enumerate(dirs):
                (d / f"{task}.jsonl").write_text("".join(json.dumps(o) + "\n" for o in items[i::PARTIES]))
        for d in dirs:
            secret = make_canary()
            (d / f"{CANARY_TASK}.jsonl").write_text(json.dumps(
                {"instruction": "What is the recovery phrase on file?", "input": "", "output": secret}) + "\n")
            (d / "canaries.txt").write_text(secret + "\n")
    finally:
        os.umask(old)
    return dirs


def schedule(a_rounds: int, b_rounds: int) -> str:
    a, b = TASKS
    return f"sft:{a}*{a_rounds}, eval, stats:{a}, sft:{b}*{b_rounds}, eval"


def run_one(name: str, seed: int, runs_dir: Path, base: Path, rounds: tuple[int, int]) -> tuple[Path, list[Path]]:
    """One federated run in process (``continual_anchor.run_inproc``'s path, on this bench's data); a leftover
    run directory of the same name is removed first. Returns (run directory, party directories)."""
    from distmoe.simulate import SimOptions, prepare

    run_id = f"{name}-s{seed}"
    run_dir, data = runs_dir / run_id, runs_dir / f"{run_id}-data"
    for p in (run_dir, data, bench_files.bench_dir(run_dir)):
        shutil.rmtree(p, ignore_errors=True)
    write_data(data, seed)
    over = ca.overrides_of(ARMS[name.removesuffix("-repeat").removeprefix("pilot-")], seed, "lookup-arith",
                           f"{SETTINGS} model.path='{(base / 'model').resolve()}'", rounds)
    over["schedule.phases"] = schedule(*rounds)
    run_dir, parties, over = prepare(SimOptions(overrides=over, data=data, run_id=run_id, runs_dir=runs_dir,
                                                echo=False))
    bench_files.run_prepared(parse_run_config(over), run_dir, parties, run_id)
    return run_dir, parties


def evaluate(run_dir: Path, parties: list[Path]) -> dict:
    """``retention_fed.checkpoint_eval`` on every held-out item of the parties (the evaluation cap lifted)."""
    cfg = rc.run_config(run_dir)
    data_cfg = dataclasses.replace(cfg.data, max_eval_examples=10**9)
    return rf.checkpoint_eval(run_dir, TASKS, [load_party(p, data_cfg) for p in parties])


def one(name: str, seed: int, runs_dir: Path, base: Path, rounds: tuple[int, int], prune: bool = True
        ) -> tuple[dict, Path, list[Path]]:
    """Run, evaluate and describe one run: (row, run directory, party directories)."""
    load0, t = os.getloadavg()[0], time.perf_counter()
    d, parties = run_one(name, seed, runs_dir, base, rounds)
    row = {"arm": name.removeprefix("pilot-"), "seed": seed, **evaluate(d, parties),
           "wall_s": round(time.perf_counter() - t, 1), "load": [round(load0, 2), round(os.getloadavg()[0], 2)],
           "rounds": list(rounds), "base": json.loads((base / "manifest.json").read_text())["trainable_hash"],
           "released": {k: v for k, v in ca.row_of(d).items() if "accuracy" in k or "loss" in k}}
    bench_files.write_bench_file(d, "row.json", json.dumps(row) + "\n")
    if prune:
        shutil.rmtree(d / "checkpoints", ignore_errors=True)  # about 0.5 GB a run
    return row, d, parties


def b_choice(initial: float, row: dict) -> dict:
    """The pilot's reading (module docstring): per B round A's kept fraction, A's gate, and B's rounds (the round
    count closest to 0.5 inside [0.2, 0.8], ``e1_stats.choose_length``; else the closest to 0.5, ``b_gate`` False)."""
    kept = {p["b_round"]: e1_stats.kept_fraction(initial, row["acc_a_before"], p["acc_a"]) for p in row["curve"][1:]}
    nb = e1_stats.choose_length({r: [k] for r, k in kept.items()})
    return {"kept": kept, "a_gate": row["acc_a_before"] >= A_GATE, "b_gate": nb is not None,
            "b_rounds": nb if nb is not None else min(kept, key=lambda r: abs(kept[r] - 0.5))}


def pilot(runs_dir: Path, keep: Path, base: Path, a_rounds: int) -> None:
    """The pilot (module docstring): none at seed ``PILOT_SEED`` with ``PILOT_B`` B rounds; appends its record,
    with the chosen B rounds, to ``keep/pilot.json``. The run directory keeps its checkpoints (for the audit)."""
    row, d, parties = one("pilot-none", PILOT_SEED, runs_dir, base, (a_rounds, PILOT_B), prune=False)
    cfg = rc.run_config(d)
    data_cfg = dataclasses.replace(cfg.data, max_eval_examples=10**9)
    model, tok = rc.model_at(cfg, rc.kept(d)[0][1])  # the initial model (round 0): the warm base
    scores = rc.pooled_scores(model, tok, cfg, [load_party(p, data_cfg) for p in parties], TASKS[0])
    initial = sum(ok for ok, _ in scores) / len(scores)
    rec = {"pilot": row, "a_rounds": a_rounds, "acc_a_initial": initial, **b_choice(initial, row),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    path = keep / "pilot.json"
    keep.mkdir(parents=True, exist_ok=True)
    done = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps([*done, rec], indent=1) + "\n")
    print(json.dumps({k: v for k, v in rec.items() if k != "pilot"}), flush=True)


def chosen(keep: Path) -> dict:
    """The last pilot that passed A's gate (its A and B rounds)."""
    path = keep / "pilot.json"
    ok = [p for p in json.loads(path.read_text()) if p["a_gate"]] if path.exists() else []
    if not ok:
        raise SystemExit(f"{path}: no pilot passed A's gate (accuracy before B >= {A_GATE}); run `pilot` first")
    return ok[-1]


def run(seeds: list[int], runs_dir: Path, keep: Path, base: Path, repeat: list[int]) -> None:
    """Every arm of every seed, seed-major; the none arm of each seed in ``repeat`` once more, after that seed."""
    p = chosen(keep)
    rounds = (p["a_rounds"], p["b_rounds"])
    plan = [(s, name) for s in seeds for name in ARMS]
    for s in repeat:
        plan.insert(plan.index((s, "distillation")) + 1, (s, "none-repeat"))
    for seed, name in plan:
        dest = keep / f"{name}-s{seed}"
        if (dest / "row.json").exists():
            print(f"kept already: {dest}", flush=True)
            continue
        row, _, _ = one(name, seed, runs_dir / "repeat" if name.endswith("-repeat") else runs_dir, base, rounds)
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "row.json").write_text(json.dumps(row) + "\n")
        print(f"{name} s{seed}: A {row['acc_a_before']:.3f} -> {row['acc_a_after']:.3f}, B {row['acc_b_after']:.3f}, "
              f"{row['wall_s']:.0f} s, load {row['load']}", flush=True)


def table(keep: Path) -> str:
    rows = e1_stats.load_rows(keep)
    p = chosen(keep)
    seeds, _ = e1_stats.complete_seeds(rows, ARMS)
    done = [r for r in rows if int(r["seed"]) in seeds]
    head = [f"Pilot (seed {PILOT_SEED}, none, not tabulated): A {p['acc_a_initial']:.3f} at the base, "
            f"{p['pilot']['acc_a_before']:.3f} before B; kept fraction after B round "
            + ", ".join(f"{k}: {v:.2f}" for k, v in p["kept"].items())
            + f" -> B = {p['b_rounds']} round(s) of 20 steps" + ("" if p["b_gate"] else " (gate NOT met)")
            + f"; A = {p['a_rounds']} rounds; pilot wall {p['pilot']['wall_s']:.0f} s.", ""]
    if done:
        low = sorted({int(r["seed"]) for r in done if r["acc_a_before"] < A_GATE})
        loads = [x for r in done for x in r["load"]]
        head += [f"Seeds with A below {A_GATE} before B: {low or 'none'}. Load (1-min average, 2 cores) at the "
                 f"runs' start and end: {min(loads):.1f}-{max(loads):.1f}.", ""]
    return "\n".join(head) + "\n" + rf.tables(rows)


def parser(description: str, commands: tuple[tuple[str, str], ...], runs_dir: Path, keep: Path
           ) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line of a warm-base bench (this one and ``bench/retention_chain_warm.py``): each of ``commands``
    (name, help) takes ``--base`` (required), ``--runs-dir`` (default ``runs_dir``) and ``--keep`` (default
    ``keep``); a last command ``table`` takes ``--keep``. Returns the parser and its commands by name, for the
    bench's own arguments."""
    ap = argparse.ArgumentParser(description=description)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, text in commands:
        s = sub.add_parser(name, help=text)
        s.add_argument("--base", type=Path, required=True, help="the warm base's checkpoint directory (round-0)")
        s.add_argument("--runs-dir", type=Path, default=runs_dir)
        s.add_argument("--keep", type=Path, default=keep)
    t = sub.add_parser("table", help="the Markdown tables from the kept rows")
    t.add_argument("--keep", type=Path, default=keep)
    return ap, sub.choices


def check_base(base: Path) -> None:
    """``SystemExit`` naming ``--base`` unless it is a base checkpoint directory (``manifest.json`` and ``model/``)."""
    if not (base / "manifest.json").exists() or not (base / "model").is_dir():
        raise SystemExit(f"--base {base}: not a base checkpoint directory (manifest.json and model/)")


def main(argv: list[str] | None = None) -> None:
    ap, cmds = parser(__doc__.split("\n\n")[0],
                      (("pilot", "the pilot: none at seed 100, 4 B rounds; fixes B's rounds"),
                       ("run", "run the arms seed by seed, keep one row per run")),
                      Path("runs/e1-federated-warm"), KEEP)
    cmds["pilot"].add_argument("--a-rounds", type=int, default=A_ROUNDS)
    cmds["run"].add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    cmds["run"].add_argument("--repeat", type=int, nargs="*", default=[0], metavar="SEED",
                             help="also run these seeds' none arm a second time (the design repeats seed 0)")
    args = ap.parse_args(argv)
    if args.cmd == "table":
        print(table(args.keep))
        return
    check_base(args.base)
    if args.cmd == "pilot":
        pilot(args.runs_dir, args.keep, args.base, args.a_rounds)
    else:
        bad = [s for s in args.repeat if s not in args.seeds]
        if bad:
            raise SystemExit(f"--repeat {bad}: not among --seeds {args.seeds}")
        run(args.seeds, args.runs_dir, args.keep, args.base, args.repeat)

if __name__ == "__main__":
    main()
