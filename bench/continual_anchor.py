"""The DistMoE continual experiment (retention across tasks): a two-task schedule (task A, eval, router statistics
of A, task B, eval) run federated, per arm, seed and task order, on the same coordinator and party code; prints the
Markdown tables for docs/results.md (mean ± sample std over seeds, and every seed's value).

    python bench/continual_anchor.py --seeds 0 1 2                       # anchor vs no-anchor, lookup -> arith
    python bench/continual_anchor.py --arms no-anchor distillation replay --order lookup-arith arith-lookup
    python bench/continual_anchor.py --collect runs/anchor-*             # tabulate existing run dirs
    python bench/continual_anchor.py --collect bench/results/continual13/*   # the kept rows in the repository

``--exec inproc`` (the default): each run is ``distmoe simulate``'s run directory (same data, node files,
overrides) driven by the coordinator in this process over ``distmoe.inprocess.LocalTransport``: the exact
coordinator and party code path (wire guards, ledgers, secure aggregation, DP), the parties served one after
another in this process, without Ray or Flower. ``--exec simulate``: each run is a real ``distmoe simulate``
(Flower Simulation Engine), minutes slower per run. Finished runs (``run.json`` status ``completed``) are reused,
an unfinished run directory is started again; before each run the driver waits while ``--quiet-file`` exists.
The bench's own files of a run (``bench.json``, ``row.json``, ``coordinator.log``) go beside the run
directory, never in it (``bench/bench_files.py``), so that ``distmoe audit`` passes on it.

Arms: ``anchor`` / ``no-anchor`` / ``anchor-token`` (the three configs), the retention mechanisms of
``docs/algorithms.md`` (Retention), each on one of them with its switch (``RETENTION_ARMS``), ``combined``
(anchor + protection + distillation) and ``replay``: no anchor, and each party replays ITS OWN task-A training
examples during task B (its task-B file is rewritten to hold them too, ``mix_replay``): an upper reference for
scale only, since it replays data, which the mechanisms do not. With this two-task schedule the per-task anchor
equals the latest anchor (one earlier task); it differs from three tasks on. The protection threshold 0.2 is
above the uniform 1/8 of the tiny default's 8 experts; ``expansion`` adds 2 experts per MoE layer for task B (8 ->
10, copies of the two with the most mass in task A's anchor) and freezes the 8 earlier ones and their router rows.
``balance-bias`` is no-anchor with ``routing.balance = "bias"`` (auxiliary-loss-free balancing, no aux loss): its
load CV and accuracies against no-anchor's are item 3's federated measurement; ``balance-first`` counts each
token's first choice only (``routing.balance-count = "first"``), ``balance-first-fast`` at u = 0.2.
``default-aux-pooled`` / ``default-aux-layer`` are the default run (``anchor``'s config is the default) with the aux
loss pooled over layers (transformers' form) or per layer (``routing.aux-loss-scope``);
``default-aux-layer-0.1-bias-first`` adds the first-choice bias to the per-layer loss at 0.1. ``default-public-*``
balance on public prompts (``routing.public-balance-coef``, ``routing.balance-source = "public"``);
``default-public-bias-settle`` also settles the bias on every aggregated model (``routing.balance-settle-steps``) at a
constant u, ``default-public-bias-settle-linear`` at a linearly decaying one, and ``default-public-bias-settle-only``
moves the bias by the settle alone (all on the one-style balance set they ran with); ``default-balanced`` is the
settle's defaults on the default balance set of every style, beside the per-layer aux loss (what
``configs/continual-balanced.toml`` was until 2026-12-04); ``default-balanced-bias-only`` (=
``configs/continual-balanced.toml`` now) the same without the aux loss, and ``default-no-aux`` its control: the
default run with neither aux loss nor bias.
``bench/probe_size.py`` re-measures a kept run's load CV on larger probes, ``bench/balance_set.py`` on other sets.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_files import bench_dir, bench_file, run_prepared, write_bench_file  # noqa: E402  (beside this file)
from continual_rows import keep_row, paired, probe_rows, row_of, table  # noqa: E402, F401  (a run's row, the tables)

from distmoe.config import DataConfig, load_override_file, parse_kv_pairs, parse_run_config  # noqa: E402
from distmoe.data.formats import DataError, read_jsonl  # noqa: E402
from distmoe.data.party import load_party, split_examples, split_key  # noqa: E402

ARMS = {"anchor": "configs/continual.toml", "no-anchor": "configs/continual-no-anchor.toml",
        "anchor-token": "configs/continual-token.toml"}
PROTECT = "retention.protect-mass=0.2 retention.protect-lr-scale=0.0"
DISTILL = "retention.distill-weight=1.0 retention.distill-temperature=2.0"
# arm -> (base arm, run-config overrides)
# the public balance arms measured before the default public balance set spanned every style of the public families
# (2026-12-04) keep the one-style set they ran with, so that their rows reproduce
ONE_STYLE = "routing.public-balance-styles=1 "
RETENTION_ARMS = {
    "per-task-anchor": ("anchor", "retention.task-anchors='mean'"),
    "protection": ("no-anchor", PROTECT),
    "distillation": ("no-anchor", DISTILL),
    "combined": ("anchor", f"{PROTECT} {DISTILL}"),
    "router-warmup": ("no-anchor", "train.router-warmup-steps=20 train.expert-schedule='cosine' "
                      "train.router-lr-scale=0.1"),
    "retention-all": ("anchor", "retention.task-anchors='mean' retention.protect-mass=0.2 "
                      "retention.protect-lr-scale=0.0 retention.distill-weight=1.0 train.router-warmup-steps=20 "
                      "train.expert-schedule='cosine' train.router-lr-scale=0.1"),
    "expansion": ("no-anchor", "retention.expand-experts=2"),  # task B gets 2 new experts per layer, old frozen
    "replay": ("no-anchor", ""),  # + mix_replay on every party's task-B file
    # the auxiliary-loss-free routing bias instead of the aux loss, federated (biases FedAvg'd)
    "balance-bias": ("no-anchor", "routing.balance='bias'"),
    # the same bias balancing each token's first choice (the top-1 load the probe's load CV measures)
    "balance-first": ("no-anchor", "routing.balance='bias' routing.balance-count='first'"),
    # the same at 4x the rate: u * steps = 12 logits over a task's 60 steps, enough to overturn a peaked router
    "balance-first-fast": ("no-anchor", "routing.balance='bias' routing.balance-count='first' "
                           "routing.balance-rate=0.2"),
    # the default run (configs/continual.toml is the default config) with the aux loss pooled over layers as
    # transformers computes it (distmoe's default before 2026-12-03) or per layer (the default since)
    "default-aux-pooled": ("anchor", "routing.aux-loss-scope='pooled'"),
    "default-aux-layer": ("anchor", "routing.aux-loss-scope='layer'"),
    # and the best centralised balancing (bench/retain.py): per-layer aux at 0.1 plus the first-choice bias
    "default-aux-layer-0.1-bias-first": ("anchor", "routing.aux-loss-scope='layer' routing.aux-loss-coef=0.1 "
                                         "routing.balance='aux+bias' routing.balance-count='first'"),
    # the same from the warm-up base (model.warmup-steps: 300 steps on the public mix of every family, balanced
    # the same way), so that the families no party trains start balanced
    "default-warm-aux-layer-0.1-bias-first": ("anchor", "routing.aux-loss-scope='layer' routing.aux-loss-coef=0.1 "
                                              "routing.balance='aux+bias' routing.balance-count='first' "
                                              "model.warmup-steps=300"),
    # public balance (train/public_balance.py): the router-only first-choice balance loss on public prompts
    "default-public-0.3": ("anchor", ONE_STYLE + "routing.public-balance-coef=0.3"),
    "default-public-1": ("anchor", ONE_STYLE + "routing.public-balance-coef=1.0"),
    "default-public-3": ("anchor", ONE_STYLE + "routing.public-balance-coef=3.0"),
    "default-public-10": ("anchor", ONE_STYLE + "routing.public-balance-coef=10.0"),
    # a first-choice routing bias that counts the public balance batch (routing.balance-source = "public"),
    # alone (the public batch only routed) and with the public balance gradient
    "default-public-bias": ("anchor", ONE_STYLE + "routing.balance='aux+bias' routing.balance-count='first' "
                                      "routing.balance-source='public'"),
    "default-public-10-bias": ("anchor", ONE_STYLE + "routing.public-balance-coef=10.0 routing.balance='aux+bias' "
                                         "routing.balance-count='first' routing.balance-source='public'"),
    # the public-sourced bias moving 4x faster (routing.balance-rate 0.2), and from the balanced warm base
    "default-public-bias-0.2": ("anchor", ONE_STYLE + "routing.balance='aux+bias' routing.balance-count='first' "
                                          "routing.balance-source='public' routing.balance-rate=0.2"),
    "default-warm-public-bias": ("anchor", ONE_STYLE + "routing.balance='aux+bias' routing.balance-count='first' "
                                          "routing.balance-source='public' model.warmup-steps=300"),
    # the public-counted bias settled on each aggregated model (routing.balance-settle-steps: 100 bias-only updates
    # at u = 0.01 on public batches at every party, weights still; the median is the new global bias), from the
    # default base and from the warm base
    "default-public-bias-settle": ("anchor", ONE_STYLE + "routing.balance='aux+bias' routing.balance-count='first' "
                                             "routing.balance-source='public' routing.balance-settle-steps=100 "
                                             "routing.balance-settle-rate=0.01 "
                                             "routing.balance-settle-schedule='constant'"),
    # the same settle with u decaying linearly from 0.02 (routing.balance-settle-schedule = "linear", the
    # defaults): about the same bound sum(u_i) = 1.01 as the constant 0.01's 1.0
    "default-public-bias-settle-linear": ("anchor", ONE_STYLE
                                                    + "routing.balance='aux+bias' routing.balance-count='first' "
                                                    "routing.balance-source='public' routing.balance-settle-steps=100 "
                                                    "routing.balance-settle-rate=0.02 "
                                                    "routing.balance-settle-schedule='linear'"),
    # the linear settle at half the rate (sum(u_i) = 0.5): less balance, less routing moved per round
    "default-public-bias-settle-linear-0.01": ("anchor", ONE_STYLE
                                                         + "routing.balance='aux+bias' routing.balance-count='first' "
                                                         "routing.balance-source='public' "
                                                         "routing.balance-settle-steps=100 "
                                                         "routing.balance-settle-rate=0.01 "
                                                         "routing.balance-settle-schedule='linear'"),
    # the bias held still during local training (routing.balance-rate = 0): the experts train under the settled
    # bias, and only the settle on each aggregated model moves it
    "default-public-bias-settle-only": ("anchor", ONE_STYLE
                                                  + "routing.balance='aux+bias' routing.balance-count='first' "
                                                  "routing.balance-source='public' routing.balance-rate=0.0 "
                                                  "routing.balance-settle-steps=100 routing.balance-settle-rate=0.02 "
                                                  "routing.balance-settle-schedule='linear'"),
    "default-warm-public-bias-settle": ("anchor", ONE_STYLE
                                                  + "routing.balance='aux+bias' routing.balance-count='first' "
                                                  "routing.balance-source='public' routing.balance-settle-steps=100 "
                                                  "routing.balance-settle-rate=0.01 "
                                                  "routing.balance-settle-schedule='constant' model.warmup-steps=300"),
    # the settle's defaults (linear from 0.02) and the default public balance set, which spans every style of the
    # public families (routing.public-balance-styles = 12), beside the aux loss (configs/continual-balanced.toml
    # until 2026-12-04)
    "default-balanced": ("anchor", "routing.balance='aux+bias' routing.balance-count='first' "
                                   "routing.balance-source='public' routing.balance-settle-steps=100"),
    # configs/continual-balanced.toml: default-balanced without the aux loss (routing.balance = "bias",
    # auxiliary-loss-free balancing, Wang et al. 2024)
    "default-balanced-bias-only": ("anchor", "routing.balance='bias' routing.balance-count='first' "
                                             "routing.balance-source='public' routing.balance-settle-steps=100"),
    # the control for it: the default run without the aux loss and without a bias (no balancing at all)
    "default-no-aux": ("anchor", "routing.aux-loss-coef=0.0"),
}
ORDERS = {"lookup-arith": ("lookup", "arith"), "arith-lookup": ("arith", "lookup")}
ROOT = Path(__file__).resolve().parent.parent


def mix_replay(party_dir: Path, old: str, new: str, data: DataConfig) -> dict[str, int]:
    """Rewrite ``party_dir/<new>.jsonl`` to hold its own examples plus this party's TRAINING examples of ``old``
    (local replay: the party's own data, nothing leaves it), such that no held-out example of either task is
    trained on and the evaluated held-out set of ``new`` is unchanged.

    The split (``distmoe.data.party``) holds out an example iff its own keyed hash is below
    ``eval_fraction * 2^64``, so adding ``old`` examples never moves one of the file's own examples; an ``old``
    example that would itself be held out is dropped (it would be evaluated, not trained on). Returns the counts:
    ``replayed`` (old examples added), ``dropped`` (old training examples left out), ``new_train`` (new examples
    trained on, before: ``new_train_before``).
    Raises ``DataError`` if the evaluated held-out set of ``new`` would change."""
    path = party_dir / f"{new}.jsonl"
    party = load_party(party_dir, data)
    own = read_jsonl(path)
    eval_before = [split_key(e, data.seed) for e in party.heldout(new)]
    old_train = party.train(old)
    extra = list(old_train)
    while True:
        train, held = split_examples(own + extra, data.eval_fraction, data.seed)
        held_keys = {split_key(e, data.seed) for e in held}
        keep = [e for e in extra if split_key(e, data.seed) not in held_keys]
        if len(keep) == len(extra):
            break
        extra = keep
    evaluated = held[: data.max_eval_examples] if data.max_eval_examples > 0 else held
    if [split_key(e, data.seed) for e in evaluated] != eval_before:
        raise DataError(f"{path}: replay of {old!r} would change the evaluated held-out set of {new!r}")
    path.write_text("".join(e.to_json() + "\n" for e in own + extra), encoding="utf-8")
    return {"replayed": len(extra), "dropped": len(old_train) - len(extra), "new_train_before": len(party.train(new)),
            "new_train": len(train) - len(extra)}


def overrides_of(arm: str, seed: int, order: str, extra: str, rounds: tuple[int, int] | None = None) -> dict:
    """The run's overrides: the arm's config file, the order's schedule (``rounds``: sft rounds of task A and
    task B; None = ``schedule.sft-rounds`` each), the arm's switches, then ``extra``."""
    base, own = RETENTION_ARMS.get(arm, (arm, ""))
    # every arm was measured with distillation off unless it turns it on (the library default until 2026-12-06)
    out = {"retention.distill-weight": 0.0, **load_override_file(ROOT / ARMS[base])}
    a, b = ORDERS[order]
    ra, rb = (f"*{rounds[0]}", f"*{rounds[1]}") if rounds else ("", "")
    out["schedule.phases"] = f"sft:{a}{ra}, eval, stats:{a}, sft:{b}{rb}, eval"
    for text in (f"run.seed={seed}", own, extra):
        if text.strip():
            out.update(parse_kv_pairs(text))
    return out


def wait_quiet(quiet: Path | None) -> None:
    while quiet is not None and quiet.exists():
        time.sleep(15)


def _completed(run_dir: Path) -> bool:
    """A completed run directory, or the kept table row of one (``row.json`` and ``bench.json``: what
    ``--keep-rows`` copies into ``bench/results/``)."""
    rec = run_dir / "run.json"
    if not rec.exists():
        return bench_file(run_dir, "row.json").exists() and bench_file(run_dir, "bench.json").exists()
    return json.loads(rec.read_text()).get("status") == "completed"


def _replay_data(arm: str, order: str, cfg, parties: list[Path], log) -> None:
    if arm != "replay":
        return
    a, b = ORDERS[order]
    for p in parties:
        log(f"replay {p.name}: {mix_replay(p, a, b, cfg.data)}")


def run_inproc(arm: str, seed: int, order: str, runs_dir: Path, run_id: str, extra: str, rounds) -> None:
    from distmoe.simulate import SimOptions, prepare

    opts = SimOptions(overrides=overrides_of(arm, seed, order, extra, rounds), run_id=run_id, runs_dir=runs_dir,
                      echo=False)
    run_dir, parties, overrides = prepare(opts)
    cfg = parse_run_config(overrides)
    _replay_data(arm, order, cfg, parties, print)
    run_prepared(cfg, run_dir, parties, run_id)


def run_simulate(arm: str, seed: int, order: str, runs_dir: Path, run_id: str, extra: str, rounds) -> None:
    over = overrides_of(arm, seed, order, extra, rounds)
    cmd = [sys.executable, "-m", "distmoe.cli", "simulate", "--run-config",
           " ".join(f"{k}={json.dumps(v)}" for k, v in over.items()), "--run-id", run_id, "--runs-dir", str(runs_dir)]
    if arm == "replay":  # the parties' data, written as simulate would, then mixed; passed with --data
        from distmoe.data.synth import synth_tasks, write_synthetic

        cfg = parse_run_config(over)
        data = runs_dir / f"{run_id}-data"
        old = os.umask(0o077)  # party data is private to its owner (simulate refuses it otherwise)
        try:
            parties = write_synthetic(data, 3, cfg.data.synth_examples, cfg.run.seed, canaries=1, overwrite=True,
                                      tasks=synth_tasks(cfg.schedule.tasks))
        finally:
            os.umask(old)
        _replay_data(arm, order, cfg, parties, print)
        cmd += ["--data", str(data)]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def run_one(arm: str, seed: int, order: str, runs_dir: Path, extra: str, exec_: str, quiet: Path | None,
            rounds: tuple[int, int] | None = None) -> Path:
    run_id = f"{arm}-s{seed}" if order == "lookup-arith" else f"{arm}-{order}-s{seed}"
    run_dir = runs_dir / run_id
    if _completed(run_dir):
        print(f"reusing {run_dir}", flush=True)
        return run_dir
    wait_quiet(quiet)
    if run_dir.exists():  # an unfinished run: start it again
        shutil.rmtree(run_dir)
    shutil.rmtree(bench_dir(run_dir), ignore_errors=True)  # nothing of an earlier try stands for this run
    t = time.perf_counter()
    (run_inproc if exec_ == "inproc" else run_simulate)(arm, seed, order, runs_dir, run_id, extra, rounds)
    wall = time.perf_counter() - t
    write_bench_file(run_dir, "bench.json", json.dumps({"arm": arm, "order": order, "seed": seed, "exec": exec_,
                                                         "wall_s": round(wall, 1)}) + "\n")
    print(f"{run_id}: {wall:.0f} s", flush=True)
    return run_dir


def _arm_of(run_dir: Path, r: dict[str, float]) -> tuple[str, str]:
    """(arm, order) of a run directory: from its bench.json, else from its name (``<arm>-s<seed>``) and config."""
    if bench_file(run_dir, "bench.json").exists():
        b = json.loads(bench_file(run_dir, "bench.json").read_text())
        return b["arm"], b["order"]
    arm = run_dir.name.rsplit("-s", 1)[0]
    arm = arm if arm in RETENTION_ARMS else "anchor" if r["anchor-kl-coef"] > 0 else "no-anchor"
    return arm, "lookup-arith"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--runs-dir", default="runs")
    ap.add_argument("--run-config", default="", help="extra overrides for every run (after the arm's)")
    ap.add_argument("--collect", nargs="*", help="existing run directories to tabulate instead of running")
    ap.add_argument("--arms", nargs="*", default=["anchor", "no-anchor"], choices=[*ARMS, *RETENTION_ARMS])
    ap.add_argument("--order", nargs="*", default=["lookup-arith"], choices=list(ORDERS),
                    help="task orders (task A -> task B)")
    ap.add_argument("--exec", dest="exec_", default="inproc", choices=("inproc", "simulate"),
                    help="inproc: the coordinator and parties in this process over LocalTransport (no Ray); "
                         "simulate: `distmoe simulate` on Flower's Simulation Engine")
    ap.add_argument("--quiet-file", default="", help="wait before each run while this file exists "
                    "('' = never)")
    ap.add_argument("--rounds", type=int, nargs=2, metavar=("A", "B"),
                    help="sft rounds of task A and of task B (default: schedule.sft-rounds each)")
    ap.add_argument("--prune", action="store_true", help="after each run, keep its table row (row.json) and remove "
                    "its checkpoints (about 300 MB a run)")
    ap.add_argument("--dry", action="store_true", help="print each run's overrides and exit")
    ap.add_argument("--keep-rows", default="", help="also copy each finished run's table row (row.json, bench.json) "
                    "into DIR/<run name>/, e.g. bench/results/continual13, so that --collect can rebuild the tables "
                    "from the repository")
    args = ap.parse_args()
    quiet = Path(args.quiet_file) if args.quiet_file else None
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    if args.collect:
        for d in map(Path, args.collect):
            if not _completed(d):
                continue
            r = row_of(d)
            rows.setdefault(_arm_of(d, r), []).append(r)
    else:
        rounds = tuple(args.rounds) if args.rounds else None
        for arm in args.arms:  # arm-major, in the given order: an interrupted sweep leaves whole arms
            for seed in args.seeds:
                for order in args.order:
                    if args.dry:
                        print(arm, order, seed, overrides_of(arm, seed, order, args.run_config, rounds))
                        continue
                    d = run_one(arm, seed, order, Path(args.runs_dir), args.run_config, args.exec_, quiet, rounds)
                    row = row_of(d)
                    if args.prune:
                        write_bench_file(d, "row.json", json.dumps(row) + "\n")
                        shutil.rmtree(d / "checkpoints", ignore_errors=True)
                    if args.keep_rows:
                        keep_row(d, row, Path(args.keep_rows))
                    rows.setdefault((arm, order), []).append(row)
    for order in ORDERS:
        sub = {arm: r for (arm, o), r in rows.items() if o == order}
        if sub:
            print(f"\n### {order.replace('-', ' -> ')}\n\n{table(sub)}")


if __name__ == "__main__":
    main()
