"""Benchmark: the time of each round and message stage of one schedule, deployed vs simulated, same machine.

Deployed: real Flower 1.42 processes on loopback, as ``docs/deploy.md`` runs them: a SuperLink with TLS and
SuperNode authentication, three data owners' SuperNodes with their own keys and the code pin (each through
``distmoe deploy ... --exec``; the helpers of ``tests/integration/test_deployment.py``), ``flwr run`` of this
checkout. Simulated: ``distmoe simulate`` (Flower's Simulation Engine) over the same party data and the same
run-config overrides. The two runs go one after the other, so both see the same machine; compare only the
ratios of one invocation (on a shared machine the absolute times move with the load, printed with them).

The times come from the coordinator's own ledger (``<run>/ledger/coordinator.jsonl``): a round is from its
first instruction to the next round's first (the last: to ``run_end`` in ``metrics.jsonl``); a message
stage is from its first instruction to the last reply before the next instruction.

    python bench/deploy_round.py [--sft-rounds 3] [--cold] [--trace] [--keep DIR]
    python bench/deploy_round.py --table DIR      # the table again, from the runs kept in DIR

``--cold``: the owners' launcher starts a fresh ClientApp process per message (``distmoe deploy pin --cold``)
instead of the SuperNode's warm worker. Goal: deployed <= 1.5x simulated per round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.path.insert(0, str(REPO / "bench" / "deploy_trace"))

import test_deployment as td  # noqa: E402  (the deployment test's process helpers)

from distmoe.config import to_toml  # noqa: E402
from distmoe.deploy import pin as cp  # noqa: E402


def ledger_entries(run_dir: Path) -> list[dict]:
    path = run_dir / "ledger" / "coordinator.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_end(run_dir: Path) -> float:
    for line in (run_dir / "metrics.jsonl").read_text().splitlines()[::-1]:
        e = json.loads(line) if line.strip() else {}
        if e.get("event") == "run_end":
            return float(e["time"])
    raise SystemExit(f"{run_dir}: no run_end in metrics.jsonl (the run did not finish)")


def rounds_of(run_dir: Path) -> list[dict]:
    """[{round, phase, seconds, stages: {instruction type: seconds}}] in run order, from the coordinator ledger."""
    entries = [e for e in ledger_entries(run_dir) if e.get("phase") != "run-start" and "time" in e]
    groups: list[dict] = []  # one per message stage: consecutive instructions, then their replies
    for e in entries:
        out = e.get("direction") == "out"
        if out and (not groups or groups[-1]["replied"]):
            groups.append({"round": e["round"], "phase": e["phase"], "type": e["payload_type"],
                           "start": e["time"], "end": e["time"], "replied": False})
        elif groups:
            groups[-1]["end"] = e["time"]
            groups[-1]["replied"] |= not out
    rounds: list[dict] = []
    for g in groups:
        key = (g["round"], g["phase"])
        if not rounds or (rounds[-1]["round"], rounds[-1]["phase"]) != key:
            rounds.append({"round": g["round"], "phase": g["phase"], "start": g["start"], "stages": {}})
        stage = rounds[-1]["stages"]
        stage[g["type"]] = stage.get(g["type"], 0.0) + g["end"] - g["start"]
    ends = [r["start"] for r in rounds[1:]] + [run_end(run_dir)]
    for r, end in zip(rounds, ends, strict=True):
        r["seconds"] = end - r["start"]
    return rounds


def overrides(sft_rounds: int, run_dir: Path) -> dict:
    return {**td.OVERRIDES, "schedule.sft-rounds": sft_rounds, "run.dir": str(run_dir)}


def deployed(root: Path, sft_rounds: int, cold: bool) -> tuple[Path, list[Path], float]:
    dep = td.Deployment(root)
    try:
        _, parties, _, cli_home, _, _ = td._registered_federation(dep, root)
        if cold:  # Flower's way: one fresh ClientApp process per message (same pin checks)
            launcher = root / "pin" / "bin" / cp.LAUNCHER
            launcher.write_text(cp.launcher_script((root / "pin" / cp.PIN_FILE).resolve(), sys.executable, warm=False))
        run_dir = root / "deployed"
        cfg = root / "deployed.toml"
        cfg.write_text(to_toml(overrides(sft_rounds, run_dir)))
        t0 = time.monotonic()
        cli = dep.start("flwr-run", [str(td.BIN / "flwr"), "run", str(REPO), td.CONN, "--stream",
                                     "--run-config", str(cfg)], cli_home)
        while time.monotonic() - t0 < td.RUN_DEADLINE:
            status = td._record(run_dir).get("status")
            if status in ("completed", "failed") or (cli.poll() is not None and cli.returncode != 0):
                break
            time.sleep(0.5)
        wall = time.monotonic() - t0
        if td._record(run_dir).get("status") != "completed":
            raise SystemExit(f"deployed run did not complete: {td._record(run_dir)}" + dep.diag())
        return run_dir, parties, wall
    finally:
        left = dep.stop()
        if left:
            print(f"warning: processes left running: {left}", file=sys.stderr)


def simulated(root: Path, data: Path, sft_rounds: int) -> tuple[Path, float]:
    run_dir = root / "sim-runs" / "sim"  # distmoe simulate's run directory (--runs-dir, --run-id)
    cfg = root / "simulated.toml"
    cfg.write_text(to_toml({k: v for k, v in overrides(sft_rounds, run_dir).items() if k != "run.dir"}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLWR_", "RAY_"))}
    env.update({"FLWR_HOME": str(root / "flwr-sim"), "HOME": str(root / "home"), "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    t0 = time.monotonic()
    res = subprocess.run([*td.DISTMOE, "simulate", "--data", str(data), "--config", str(cfg), "--no-report",
                          "--runs-dir", str(root / "sim-runs"), "--run-id", "sim"], env=env, cwd=str(root),
                         capture_output=True, text=True, timeout=td.RUN_DEADLINE)
    if res.returncode != 0:
        raise SystemExit(f"simulate exited {res.returncode}:\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
    return run_dir, time.monotonic() - t0


def table(sim: list[dict], dep: list[dict]) -> tuple[str, list[float]]:
    head = f"{'round':>5}  {'phase':<7} {'simulated s':>11} {'deployed s':>10} {'ratio':>6}"
    lines = [head + "   stages deployed/simulated s", "-" * 100]
    ratios = []
    for s, d in zip(sim, dep, strict=False):
        ratio = d["seconds"] / s["seconds"] if s["seconds"] > 0 else float("inf")
        if s["round"] > 0:
            ratios.append(ratio)
        stages = ", ".join(f"{k} {d['stages'].get(k, 0):.1f}/{v:.1f}" for k, v in s["stages"].items())
        lines.append(f"{s['round']:>5}  {s['phase']:<7} {s['seconds']:>11.2f} {d['seconds']:>10.2f} {ratio:>5.2f}x   "
                     + stages)
    return "\n".join(lines), ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-rounds", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="a fresh ClientApp process per message (no warm worker)")
    ap.add_argument("--trace", action="store_true",
                    help="time each step of every deployed message (bench/deploy_trace/; DIR/trace.jsonl)")
    ap.add_argument("--keep", metavar="DIR", help="run in DIR and keep it (default: a temporary directory)")
    ap.add_argument("--table", metavar="DIR", help="only print the table of the runs kept in DIR (--keep)")
    args = ap.parse_args()
    if args.table:
        root = Path(args.table)
        print(table(rounds_of(root / "sim-runs" / "sim"), rounds_of(root / "deployed"))[0])
        return
    root = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="deploy-round-"))
    root.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    trace = root / "trace.jsonl"
    if args.trace:  # every process the deployment starts inherits these (bench/deploy_trace/sitecustomize.py)
        os.environ["DISTMOE_DEPLOY_TRACE"] = str(trace)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "bench" / "deploy_trace"), str(REPO),
                                                    os.environ.get("PYTHONPATH", "")])
    try:
        dep_dir, parties, dep_wall = deployed(root, args.sft_rounds, args.cold)
        for k in ("DISTMOE_DEPLOY_TRACE",):  # the simulated run untraced
            os.environ.pop(k, None)
        sim_dir, sim_wall = simulated(root, parties[0].parent, args.sft_rounds)
        load1 = os.getloadavg()
        sim, dep = rounds_of(sim_dir), rounds_of(dep_dir)
        if [(r["round"], r["phase"]) for r in sim] != [(r["round"], r["phase"]) for r in dep]:
            print("warning: the two runs' rounds differ", file=sys.stderr)
        text, ratios = table(sim, dep)
        print(f"deploy_round: {'cold ClientApp per message' if args.cold else 'warm worker'}, "
              f"{len(parties)} parties, schedule {td.OVERRIDES['schedule.phases']!r} with {args.sft_rounds} sft "
              f"rounds; load average {load0[0]:.1f} before, {load1[0]:.1f} after ({os.cpu_count()} CPUs)")
        print(text)
        sim_rounds = sum(r["seconds"] for r in sim if r["round"] > 0)
        dep_rounds = sum(r["seconds"] for r in dep if r["round"] > 0)
        print(f"rounds >= 1: simulated {sim_rounds:.1f} s, deployed {dep_rounds:.1f} s, "
              f"ratio {dep_rounds / sim_rounds:.2f}x (median per round {statistics.median(ratios):.2f}x); "
              f"whole command: simulated {sim_wall:.0f} s, deployed {dep_wall:.0f} s")
        if args.trace:
            import breakdown  # bench/deploy_trace/breakdown.py

            print("\nwhere a deployed message's time goes (bench/deploy_trace/breakdown.py " f"{trace}):")
            print(breakdown.table(breakdown.paths(breakdown.load(trace))))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
