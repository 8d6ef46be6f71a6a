"""Benchmark: the time of each round and message stage of one schedule, deployed vs simulated vs Flower's own floor.

Arms (``bench/deploy_arms.py``), interleaved in one invocation on one deployment (a SuperLink with TLS and SuperNode
authentication, three data owners' SuperNodes with their own keys, loopback, as ``docs/deploy.md`` runs them):

- ``distmoe``: distmoe deployed, the owners' launchers (code pin, warm worker, Flower's waits cut);
- ``floor-cut``: a plain Flower 1.42 app (``bench/flower_floor/``) that pushes, stage by stage, the messages distmoe's
  arm pushed (same records, array byte lengths and config sizes) and whose ClientApp replies at once with distmoe's
  reply's records, with the same cuts of Flower's waits: Flower's transport and nothing else, the floor;
- ``simulated``: ``distmoe simulate`` (Flower's Simulation Engine) over the same data and run config;
- ``floor-stock``: the same floor on Flower as it ships (its 3 s and 1 s polls, 1-8 s back-offs, a fresh
  ``flwr-clientapp`` per message).

``--repeat N`` runs the arms N times in that order (the floors replay the messages of the repetition's own distmoe
run); with ``--abba`` every second repetition runs them in the reverse order (a floor still right after distmoe), so
that with ``--repeat 2`` (or 4, ...) distmoe and simulated see, on average, the same load on a machine whose load
drifts: each repetition is one pair, and the report gives each pair's distmoe / simulated ratio (rounds >= 1) and
their mean with a 95 % t-interval. The machine's 1-minute load average is read before and after each arm and every
2 s during it (its mean is the arm's load); compare only ratios of one invocation.

Times: distmoe's from the coordinator's ledger (``<run>/ledger/coordinator.jsonl``): a round from its first
instruction to the next round's first (the last: to ``run_end`` in ``metrics.jsonl``); a stage from its first
instruction to the last reply before the next instruction. The floor's from its ServerApp (each stage from its push
to its last reply), grouped into distmoe's rounds stage by stage.

    python bench/deploy_round.py [--schedule bench|walkthrough] [--sft-rounds N] [--arms ...] [--repeat N]
                                 [--abba] [--cold] [--trace] [--keep DIR]
    python bench/deploy_round.py --table DIR      # the tables again, from the runs kept in DIR

``--schedule walkthrough``: the run config of ``docs/deploy.md`` §1.5 (``configs/continual.toml``: the default model
and local work, 40 steps of 16 sequences per SFT round; 3 owners, privacy.epsilon 4, min-parties 3), with
``--sft-rounds`` rounds per SFT phase. ``--cold``: distmoe's owners start a fresh ClientApp process per message.
Goal: deployed <= 1.5x simulated per round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "bench" / "deploy_trace"))

import deploy_arms as da  # noqa: E402
import test_deployment as td  # noqa: E402  (on sys.path through deploy_arms)

from distmoe.config import flatten  # noqa: E402


def ledger_entries(run_dir: Path) -> list[dict]:
    path = run_dir / "ledger" / "coordinator.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_end(run_dir: Path) -> float:
    for line in (run_dir / "metrics.jsonl").read_text().splitlines()[::-1]:
        e = json.loads(line) if line.strip() else {}
        if e.get("event") == "run_end":
            return float(e["time"])
    raise SystemExit(f"{run_dir}: no run_end in metrics.jsonl (the run did not finish)")


def stages_of(run_dir: Path) -> list[dict]:
    """[{round, phase, type, start, end}] per message stage, in run order, from the coordinator ledger."""
    groups: list[dict] = []  # one per message stage: consecutive instructions, then their replies
    for e in (e for e in ledger_entries(run_dir) if e.get("phase") not in ("run-start", "run-end") and "time" in e):
        out = e.get("direction") == "out"
        if out and (not groups or groups[-1]["replied"]):
            groups.append({"round": e["round"], "phase": e["phase"], "type": e["payload_type"],
                           "start": e["time"], "end": e["time"], "replied": False})
        elif groups:
            groups[-1]["end"] = e["time"]
            groups[-1]["replied"] |= not out
    return groups


def rounds_from(stages: list[dict], end: float) -> list[dict]:
    """[{round, phase, seconds, stages: {type: seconds}}]: a round from its first stage to the next round's first."""
    rounds: list[dict] = []
    for g in stages:
        key = (g["round"], g["phase"])
        if not rounds or (rounds[-1]["round"], rounds[-1]["phase"]) != key:
            rounds.append({"round": g["round"], "phase": g["phase"], "start": g["start"], "stages": {}})
        stage = rounds[-1]["stages"]
        stage[g["type"]] = stage.get(g["type"], 0.0) + g["end"] - g["start"]
    for r, nxt in zip(rounds, [r["start"] for r in rounds[1:]] + [end], strict=True):
        r["seconds"] = nxt - r["start"]
    return rounds


def faults(run_dir: Path) -> str | None:
    """What makes a run's times no measure of the work (a party's error reply, a round that released nothing: its
    parties did not do the round's work), or None."""
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    errors = [e for e in events if e.get("event") == "party_error"]
    skipped = sorted({e["round"] for e in events if e.get("event") == "round_skipped"})
    if not errors and not skipped:
        return None
    return (f"{run_dir.name}: {len(errors)} party error replies ({', '.join(sorted({e['code'] for e in errors}))}), "
            f"rounds that released nothing: {skipped or 'none'}; its times are not comparable")


def rounds_of(run_dir: Path) -> list[dict]:
    return rounds_from(stages_of(run_dir), run_end(run_dir))


def floor_rounds(dep_stages: list[dict], records: list[dict]) -> list[dict] | None:
    """The floor's stage records as distmoe's rounds (stage i of the floor replays distmoe's stage i)."""
    recs = [r for r in records if "stage" in r]
    ends = [r["time"] for r in records if r.get("event") == "end"]
    if len(recs) != len(dep_stages) or not ends:
        print(f"warning: the floor ran {len(recs)} stages, distmoe's ledger has {len(dep_stages)}", file=sys.stderr)
        return None
    return rounds_from([{**d, "start": r["start"], "end": r["end"]} for d, r in zip(dep_stages, recs, strict=True)],
                       ends[0])


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def table(sim: list[dict] | None, dep: list[dict], cut: list[dict] | None, stock: list[dict] | None) -> str:
    """Per round: seconds of each arm and the ratios; per stage: distmoe / floor-cut / floor-stock / simulated s.
    ``sim`` None: an invocation without the simulated arm (distmoe against the floors only)."""
    cols = ("simulated", "distmoe", "floor-cut", "floor-stock")
    lines = [f"{'round':>5}  {'phase':<7} " + " ".join(f"{c + ' s':>13}" for c in cols)
             + "  dep/sim  dep/floor  floor/sim   stages: distmoe/floor-cut/floor-stock/simulated s", "-" * 150]
    totals, ran = dict.fromkeys(cols, 0.0), set()  # ran: the arms with a time (an arm left out prints "-")
    for i, d in enumerate(dep if sim is None else dep[:len(sim)]):
        s = sim[i] if sim is not None else None
        c = cut[i] if cut and i < len(cut) else None
        k = stock[i] if stock and i < len(stock) else None
        secs = [s["seconds"] if s else None, d["seconds"], c["seconds"] if c else None, k["seconds"] if k else None]
        if d["round"] > 0:
            for col, v in zip(cols, secs, strict=True):
                totals[col] += v or 0.0
                ran.update([col] if v is not None else [])
        stages = ", ".join(f"{t} " + "/".join("-" if x is None else f"{x['stages'].get(t, 0):.1f}"
                                              for x in (d, c, k, s)) for t in (s or d)["stages"])
        lines.append(f"{d['round']:>5}  {d['phase']:<7} " + " ".join("{:>13}".format("-" if v is None else f"{v:.2f}")
                                                                   for v in secs)
                     + f"  {_ratio(secs[1], secs[0]):>7}  {_ratio(secs[1], secs[2]):>9}  {_ratio(secs[2], secs[0]):>9}"
                     + "   " + stages)
    t = {c: v if c in ran else None for c, v in totals.items()}  # an arm left out has no total (no 0.00x ratio)
    lines.append(f"{'>= 1':>5}  {'all':<7} "
                 + " ".join(f"{t[c]:>13.2f}" if t[c] is not None else f"{'-':>13}" for c in cols)
                 + f"  {_ratio(t['distmoe'], t['simulated']):>7}  {_ratio(t['distmoe'], t['floor-cut']):>9}"
                 + f"  {_ratio(t['floor-cut'], t['simulated']):>9}")
    ratios = [d["seconds"] / s["seconds"] for s, d in zip(sim or [], dep, strict=False)
              if s["round"] > 0 and s["seconds"]]
    if ratios:
        lines.append(f"median per round: distmoe / simulated {statistics.median(ratios):.2f}x")
    if cut and t["simulated"]:
        verdict = ("so Flower's transport alone already exceeds 1.5x the simulated round at this schedule: the goal "
                   "cannot be met by any change inside distmoe" if t["floor-cut"] > 1.5 * t["simulated"]
                   else "so the goal is within Flower's transport at this schedule")
        lines.append(f"floor (Flower's transport of these messages, with the cuts): {t['floor-cut']:.1f} s against "
                     f"1.5 x simulated = {1.5 * t['simulated']:.1f} s, {verdict}")
    return "\n".join(lines)


def arm_order(arms: list[str], rep: int, abba: bool) -> list[str]:
    """The arms of repetition ``rep`` (1-based) in run order: ``da.ARMS``'s, reversed in even repetitions under
    ``abba`` with each floor kept right after distmoe (a floor replays that repetition's distmoe messages)."""
    order = [a for a in da.ARMS if a in arms]
    if not abba or rep % 2:
        return order
    rev = [a for a in reversed(order) if not a.startswith("floor")]
    floors = [a for a in order if a.startswith("floor")]
    at = rev.index("distmoe") + 1 if "distmoe" in rev else len(rev)
    return rev[:at] + floors + rev[at:]


def pair_ratios(root: Path, res: dict) -> list[dict]:
    """Per repetition with both arms and no ``faults``: {rep, distmoe, simulated, ratio, order, loads}, seconds of
    rounds >= 1."""
    out = []
    for rep in res["reps"]:
        got = {a["arm"]: a for a in rep["arms"]}
        if "distmoe" not in got or "simulated" not in got:
            continue
        if any(faults(kept_dir(root, got[arm]["dir"])) for arm in ("distmoe", "simulated")):
            continue  # report() says why
        secs = {arm: sum(r["seconds"] for r in rounds_of(kept_dir(root, got[arm]["dir"])) if r["round"] > 0)
                for arm in ("distmoe", "simulated")}
        out.append({"rep": rep["rep"], **secs, "ratio": secs["distmoe"] / secs["simulated"],
                    "order": [a["arm"] for a in rep["arms"]],
                    "loads": {arm: got[arm].get("load_mean", statistics.fmean(got[arm]["load"]))
                              for arm in ("distmoe", "simulated")}})
    return out


def mean_interval(xs: list[float], level: float = 0.95) -> tuple[float, float | None, float | None]:
    """Mean of ``xs`` and its two-sided Student-t interval at ``level`` (None, None for fewer than 2 values)."""
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return mean, None, None
    from scipy import stats as sps

    half = sps.t.ppf(0.5 + level / 2, len(xs) - 1) * statistics.stdev(xs) / len(xs) ** 0.5
    return mean, mean - half, mean + half


def pairs_text(pairs: list[dict]) -> str:
    lines = ["\npairs (rounds >= 1; each arm's mean load average over its run):"]
    for p in pairs:
        lines.append(f"  repetition {p['rep']} ({' -> '.join(p['order'])}): distmoe {p['distmoe']:.1f} s "
                     f"(load {p['loads']['distmoe']:.1f}), simulated {p['simulated']:.1f} s "
                     f"(load {p['loads']['simulated']:.1f}): {p['ratio']:.2f}x")
    mean, lo, hi = mean_interval([p["ratio"] for p in pairs])
    span = f", 95 % t-interval [{lo:.2f}, {hi:.2f}]" if lo is not None else ""
    loads = [statistics.fmean(p["loads"][a] for p in pairs) for a in ("distmoe", "simulated")]
    lines.append(f"  mean distmoe / simulated over {len(pairs)} pairs: {mean:.2f}x{span}; mean load "
                 f"distmoe {loads[0]:.1f}, simulated {loads[1]:.1f}")
    return "\n".join(lines)


class LoadSampler:
    """The 1-minute load average every ``every`` seconds in a thread, while in the ``with`` block."""

    def __init__(self, every: float = 2.0):
        self.every, self.samples, self._stop = every, [os.getloadavg()[0]], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])


def schedule_overrides(name: str, sft_rounds: int) -> dict:
    if name == "bench":
        return {**td.OVERRIDES, "schedule.sft-rounds": sft_rounds}
    walk = flatten(tomllib.loads((REPO / "configs" / "continual.toml").read_text()))
    return {**walk, "federation.min-available": td.N_PARTIES, "privacy.epsilon": 4.0,
            "privacy.min-parties": td.N_PARTIES, "schedule.sft-rounds": sft_rounds}


def kept_dir(root: Path, run_dir: str) -> Path:
    """An arm's run directory as ``bench.json`` names it, else its copy under ``root`` (``bench/results/``
    keeps only each run's ``ledger/coordinator.jsonl`` and ``metrics.jsonl``, at ``<root>/<run name>/``)."""
    path = Path(run_dir)
    return path if path.is_dir() else root / path.name


def report(root: Path) -> None:
    res = json.loads((root / "bench.json").read_text())
    print(f"deploy_round: schedule {res['schedule']!r} ({res['phases']!r}, {res['sft_rounds']} sft rounds), "
          f"{'cold ClientApp per message' if res['cold'] else 'warm worker'}, {td.N_PARTIES} parties, "
          f"{os.cpu_count()} CPUs")
    for rep in res["reps"]:
        print(f"\nrepetition {rep['rep']}: " + "; ".join(
            f"{a['arm']} {a['wall']:.0f} s (load {a['load'][0]:.1f} -> {a['load'][1]:.1f})" for a in rep["arms"]))
        got = {a["arm"]: a for a in rep["arms"]}
        if "distmoe" not in got or not {"simulated", "floor-cut", "floor-stock"} & set(got):
            continue
        dep_dir = kept_dir(root, got["distmoe"]["dir"])
        for arm in ("distmoe", "simulated") if "simulated" in got else ("distmoe",):
            fault = faults(kept_dir(root, got[arm]["dir"]))
            if fault:
                print(f"warning: {fault} (left out of the pairs)")
        dep_stages = stages_of(dep_dir)
        floors = {arm: floor_rounds(dep_stages, got[arm]["records"]) if arm in got else None
                  for arm in ("floor-cut", "floor-stock")}
        sim = rounds_of(kept_dir(root, got["simulated"]["dir"])) if "simulated" in got else None
        print(table(sim, rounds_of(dep_dir), floors["floor-cut"], floors["floor-stock"]))
    pairs = pair_ratios(root, res)
    if pairs and (len(pairs) > 1 or res.get("abba")):
        print(pairs_text(pairs))


def run_arm(arm: str, out: dict, fed, tag: str, overrides: dict, deadline: float, root: Path, plan: Path,
            shapes: Path, t0: float) -> None:
    if arm == "distmoe":
        out["dir"], out["wall"] = da.distmoe_arm(fed, tag, overrides, deadline)
        plan.write_text(json.dumps(da.plan_from_shapes(shapes, t0, time.time())))
    elif arm == "simulated":
        sim = {k: v for k, v in overrides.items() if k != "run.dir"}
        out["dir"], out["wall"] = da.simulated(root, fed.parties[0].parent, tag, sim, deadline)
    else:
        out["records"], out["wall"] = da.floor_arm(fed, tag, plan, arm == "floor-cut", deadline)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", choices=("bench", "walkthrough"), default="bench")
    ap.add_argument("--sft-rounds", type=int, default=3)
    ap.add_argument("--arms", nargs="+", choices=da.ARMS, default=list(da.ARMS))
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--abba", action="store_true", help="reverse the arms' order in every second repetition")
    ap.add_argument("--deadline", type=float, default=None, help="seconds per run (600; walkthrough 2400)")
    ap.add_argument("--cold", action="store_true", help="distmoe: a fresh ClientApp process per message")
    ap.add_argument("--trace", action="store_true",
                    help="time each step of every deployed message (bench/deploy_trace/; DIR/trace.jsonl)")
    ap.add_argument("--keep", metavar="DIR", help="run in DIR and keep it (default: a temporary directory)")
    ap.add_argument("--table", metavar="DIR", help="only print the tables of the runs kept in DIR (--keep)")
    args = ap.parse_args()
    if args.table:
        report(Path(args.table))
        return
    if any(a.startswith("floor") for a in args.arms) and "distmoe" not in args.arms:
        raise SystemExit("the floor replays the messages of distmoe's arm: --arms must include distmoe")
    deadline = args.deadline or (2400.0 if args.schedule == "walkthrough" else 600.0)
    root = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="deploy-round-"))
    root.mkdir(parents=True, exist_ok=True)
    overrides = schedule_overrides(args.schedule, args.sft_rounds)
    shapes = root / "shapes.jsonl"
    # every process the deployment starts inherits these (bench/deploy_trace/sitecustomize.py); the SuperLink's
    # ServerApps record the messages they push (the floor's plan), with --trace every step of every message
    os.environ["DISTMOE_DEPLOY_SHAPES"] = str(shapes)
    if args.trace:
        os.environ["DISTMOE_DEPLOY_TRACE"] = str(root / "trace.jsonl")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "bench" / "deploy_trace"), str(REPO),
                                                os.environ.get("PYTHONPATH", "")])
    res = {"schedule": args.schedule, "phases": overrides["schedule.phases"], "sft_rounds": args.sft_rounds,
           "cold": args.cold, "abba": args.abba, "reps": []}
    fed = da.Federation(root, 64 if args.schedule == "walkthrough" else 24, args.cold)
    try:
        for rep in range(1, args.repeat + 1):
            arms: list[dict] = []
            res["reps"].append({"rep": rep, "arms": arms})
            plan = root / f"plan-{rep}.json"
            for arm in arm_order(args.arms, rep, args.abba):
                tag, t0 = f"{arm}-{rep}", time.time()
                out: dict = {"arm": arm}
                with LoadSampler() as load:
                    run_arm(arm, out, fed, tag, overrides, deadline, root, plan, shapes, t0)
                out["load"], out["t"] = [load.samples[0], load.samples[-1]], [t0, time.time()]
                out["load_mean"] = statistics.fmean(load.samples)
                out["dir"] = str(out.get("dir", ""))
                arms.append(out)
                (root / "bench.json").write_text(json.dumps(res, indent=1))
                print(f"{tag}: {out['wall']:.0f} s, load {out['load'][0]:.1f} -> {out['load'][1]:.1f} "
                      f"(mean {out['load_mean']:.1f})", flush=True)
    finally:
        fed.stop()
    report(root)
    if args.trace:
        import breakdown  # bench/deploy_trace/breakdown.py

        spans = [a["t"] for rep in res["reps"] for a in rep["arms"] if a["arm"] == "distmoe"]
        events = [e for e in breakdown.load(root / "trace.jsonl") if any(t0 <= e["t"] <= t1 for t0, t1 in spans)]
        print("\nwhere a deployed message of distmoe's arm spends its time (bench/deploy_trace/breakdown.py):")
        print(breakdown.table(breakdown.paths(events)))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
