"""distmoe against the plain Flower app a user would otherwise run, per SFT round, on the Simulation Engine.

    python bench/peer_flower.py [--rounds 4] [--reps 3] [--arms peer plaintext default] [--rotate] [--peer-fused]
                                [--out DIR]

The peer is ``bench/peer_flower/`` (``peer_app.py``): Flower's built-in ``FedAvg`` (Message API), the same tiny
Qwen3-MoE with bit-identical initial weights, the same party data files and token ids, ``train.local-steps`` (40)
AdamW steps of ``train.batch-size`` (16) per round, 3 parties. Each arm runs on Flower's Simulation Engine with its
own SuperLink (started as ``distmoe simulate`` starts its own: ``distmoe.simulate.start_superlink``), one CPU per
party, one torch thread, one arm at a time, the arms interleaved in every repetition (peer, plaintext, default,
peer, ...; with ``--rotate`` each repetition starts one arm later, so that over a multiple of the arm count of
repetitions each arm runs first, second and third equally often), so that the load of this shared machine hits
them alike. Arms:

- ``peer``: ``flwr run bench/peer_flower local --stream`` with ``num-server-rounds = R``;
- ``plaintext``: ``distmoe simulate --data D`` with ``schedule.phases = 'sft:lookup'``, ``schedule.sft-rounds = R``,
  ``privacy.mode = 'plaintext'``;
- ``default``: the same with distmoe's defaults (secure aggregation, the routing probe, checkpoints);
- ``NAME=k=v,k=v``: a distmoe arm with extra run-config overrides (e.g. the earlier cadences:
  ``every-round=checkpoint.every=1,routing.probe-every=1``).

Per-round time: for the peer, from the timestamps of Flower's ``[ROUND k/N]`` log lines (the ServerApp adds a
timestamped handler to Flower's logger, ``round-log``) and ``Strategy execution finished``; for distmoe, from the
coordinator ledger's timestamps: round ``k`` starts at its first entry and ends where round ``k + 1`` starts (the
last round at the ``run-end`` entry). Round 1 carries the one-off start (actors, keys) and distmoe's last round
always writes a checkpoint: the figure compared is the mean of rounds 2..R-1 (``steady``, what a long run's rounds
cost); the mean of all rounds is printed beside it. For distmoe each round is also split from the ledger into
``update`` (instructions out to the released sum; it includes the routing probe of the round before, carried on
the round's instruction) and ``after`` (checkpoint; the probe's own stage only after the last round). Ratios are
taken within one repetition (the arms ran back to back), then summarised as median and range over repetitions, and
as their mean with a t-interval at 95 % Bonferroni-corrected over the arms compared (97.5 % for two), set against
each arm's goal (default <= 1.05x, plaintext <= 1.02x: shown met only when the whole interval is under it). The
load average is printed with every arm (ratios only mean something in the same run).

Also checked once: the peer's initial weights equal distmoe's round-0 checkpoint tensor by tensor (``bit-identical``).

Must not: be imported by the library (bench only); leave a process running (every Flower/Ray process of an arm
carries the arm's token and is stopped by PID).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from distmoe.simulate import TOKEN_ENV, processes_with_token, start_superlink, stop_processes  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
import e1_stats  # noqa: E402

PEER_APP = REPO / "bench" / "peer_flower"
PY = sys.executable
ROUND = re.compile(r"^(\d+\.\d+) \[ROUND (\d+)/(\d+)\]")
FINISHED = re.compile(r"^(\d+\.\d+) Strategy execution finished")


def _env(root: Path, token: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLWR_", "RAY_"))}
    for d in ("home", "tmp", "flwr"):
        (root / d).mkdir(parents=True, exist_ok=True)
    ray = Path(f"/tmp/pfray-{token}")
    ray.mkdir(parents=True, exist_ok=True)
    env.update({
        TOKEN_ENV: token, "FLWR_HOME": str(root / "flwr"), "HOME": str(root / "home"), "TMPDIR": str(root / "tmp"),
        "RAY_TMPDIR": str(ray), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0",
        "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false", "MPLCONFIGDIR": str(root / "home"),
        "PATH": str(Path(PY).parent) + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    })
    return env


def run_peer(root: Path, data: Path, rounds: int, timeout: float, fused: bool = False) -> list[float]:
    """One peer run; its per-round seconds from Flower's round log lines. ``fused``: the peer's AdamW is torch's
    fused kernel, as distmoe's parties' is (``--peer-fused``), so that the ratio holds no optimizer difference."""
    root.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(8)
    env = _env(root, token)
    round_log = root / "rounds.log"
    cmd = [str(Path(PY).parent / "flwr"), "run", str(PEER_APP), "local", "--stream",
           "--federation-config", "num-supernodes=3 client-resources-num-cpus=1",
           "--run-config", f"num-server-rounds={rounds} data-root='{data}' round-log='{round_log}'"
           + (" fused=true" if fused else "")]
    try:
        start_superlink(env, root / "flwr", lambda: processes_with_token(token, ray_dir=env["RAY_TMPDIR"]))
        with (root / "flower.log").open("w") as log:
            proc = subprocess.Popen(cmd, env=env, cwd=str(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
            deadline = time.monotonic() + timeout
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if "Strategy execution finished" in line or time.monotonic() > deadline:
                    break
    finally:
        stop_processes(token, ray_dir=env["RAY_TMPDIR"])
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    return peer_rounds(round_log, rounds)


def peer_rounds(round_log: Path, rounds: int) -> list[float]:
    """Per-round seconds from the peer ServerApp's timestamped Flower log: ``[ROUND k/N]`` to the next round's (the
    last round to ``Strategy execution finished``)."""
    starts, end = {}, None
    for line in round_log.read_text().splitlines():
        if m := ROUND.match(line):
            starts[int(m.group(2))] = float(m.group(1))
        elif m := FINISHED.match(line):
            end = float(m.group(1))
    if len(starts) != rounds or end is None:
        raise SystemExit(f"{round_log}: the peer run did not finish its {rounds} rounds")
    bounds = [starts[k] for k in range(1, rounds + 1)] + [end]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def ledger_rounds(run_dir: Path, rounds: int) -> tuple[list[float], dict[str, list[float]]]:
    """Per-round seconds from the coordinator ledger: round k from its first entry to round k + 1's first entry
    (the last round to the ``run-end`` entry); and each round's parts: ``update`` (first instruction to the
    released sum; the probe of the round before rides on its instruction), ``after`` (the sum to the next round:
    checkpoint; the probe's own stage only after the last round)."""
    first: dict[int, float] = {}
    release: dict[int, float] = {}
    end = None
    for line in (run_dir / "ledger" / "coordinator.jsonl").read_text().splitlines():
        e = json.loads(line)
        rnd, t, kind = e.get("round"), e.get("time"), e.get("payload_type", "")
        if kind == "run-end":
            end = t
        elif isinstance(rnd, int) and rnd >= 1 and t is not None:
            first[rnd] = min(first.get(rnd, t), t)
            if kind.startswith("release:"):
                release[rnd] = t
    if len(first) < rounds or end is None:
        raise SystemExit(f"{run_dir}: the coordinator ledger has {sorted(first)} rounds, end {end}")
    bounds = [first[k] for k in range(1, rounds + 1)] + [end]
    parts = {"update": [release[k] - first[k] for k in range(1, rounds + 1)],
             "after": [bounds[k] - release[k] for k in range(1, rounds + 1)]}
    return [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)], parts


def run_distmoe(root: Path, data: Path, rounds: int, overrides: str, timeout: float
                ) -> tuple[list[float], dict[str, list[float]], Path]:
    root.mkdir(parents=True, exist_ok=True)
    run_id = "run"
    rc = f"schedule.phases='sft:lookup' schedule.sft-rounds={rounds} {overrides}".strip()
    cmd = [PY, "-m", "distmoe.cli", "simulate", "--data", str(data), "--runs-dir", str(root), "--run-id", run_id,
           "--no-report", "--timeout", str(timeout), "--run-config", rc]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with (root / "simulate.out").open("w") as out:
        res = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(root))
    if res.returncode != 0:
        raise SystemExit(f"distmoe simulate failed ({res.returncode}): see {root / 'simulate.out'}")
    per, parts = ledger_rounds(root / run_id, rounds)
    return per, parts, root / run_id


def bit_identical(run_dir: Path) -> str:
    """The peer's initial weights (``build_model`` of the defaults) against distmoe's round-0 checkpoint."""
    import torch
    from safetensors.torch import load_file

    from distmoe.config import parse_run_config
    from distmoe.model.build import build_model

    model, _ = build_model(parse_run_config({}).model)
    peer = model.state_dict()
    files = sorted((run_dir / "checkpoints").glob("round-0*/**/*.safetensors"))
    theirs: dict = {}
    for f in files:
        theirs.update(load_file(str(f)))
    common = [k for k in peer if k in theirs]
    same = sum(bool(torch.equal(peer[k], theirs[k])) for k in common)
    return f"{same}/{len(common)} tensors equal ({len(peer)} in the peer, {len(theirs)} in round-0's files)"


def arm_overrides(arm: str) -> str:
    if arm == "plaintext":
        return "privacy.mode='plaintext'"
    if arm == "default":
        return ""
    name, _, kv = arm.partition("=")
    if not kv:
        raise SystemExit(f"unknown arm {arm!r} (peer, plaintext, default or NAME=k=v,k=v)")
    return " ".join(kv.split(","))


GOALS = {"default": 1.05, "plaintext": 1.02}  # the steady round's goal against the peer, per arm


def _interval_text(ratios: list[float], comparisons: int, goal: float | None) -> str:
    """The mean of the per-repetition ratios with its two-sided t-interval at 95 % Bonferroni-corrected over the
    ``comparisons`` arms compared with the peer (``e1_stats.paired``), and whether the interval lies under ``goal``."""
    if len(ratios) < 2:
        return ""
    level = 1 - e1_stats.ALPHA / max(1, comparisons)
    st = e1_stats.paired(ratios, level=level)
    text = f"; mean {st['mean']:.3f}, {100 * level:.1f} % t-interval [{st['lo']:.3f}, {st['hi']:.3f}]"
    if goal is not None:
        text += f": goal <= {goal:.2f}x {'shown met' if st['hi'] <= goal else 'not shown met'}"
    return text


def _steady(xs: list[float]) -> float:
    """Rounds 2..R-1: neither the first (actors start, keys) nor the last (its checkpoint is always written)."""
    return statistics.mean(xs[1:-1]) if len(xs) > 2 else xs[-1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4, help="rounds per run (>= 3: rounds 2..R-1 are compared)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--arms", nargs="+", default=["peer", "plaintext", "default"])
    ap.add_argument("--out", type=Path, default=Path("runs") / "peer-flower")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--rotate", action="store_true",
                    help="rotate the arms' order by one in each repetition (with --reps a multiple of the arm count, "
                         "each arm runs in each position equally often: a drifting machine weighs on all alike)")
    ap.add_argument("--peer-fused", action="store_true",
                    help="the peer's AdamW is torch's fused kernel, like distmoe's parties' (default: torch's default)")
    args = ap.parse_args()
    if "peer" not in args.arms:
        raise SystemExit("--arms must include peer (the ratios are against it)")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data"
    if not data.is_dir():
        subprocess.run([PY, "-m", "distmoe.cli", "data", "synth", "--out", str(data), "--parties", "3"], check=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    rows = []
    checked = None
    for rep in range(args.reps):
        times = {}
        shift = rep % len(args.arms) if args.rotate else 0
        for arm in args.arms[shift:] + args.arms[:shift]:
            load = os.getloadavg()[0]
            root = out / f"rep{rep}" / arm.partition("=")[0]
            if root.exists():
                shutil.rmtree(root)
            t0 = time.monotonic()
            parts: dict[str, list[float]] = {}
            if arm == "peer":
                per = run_peer(root, data, args.rounds, args.timeout, args.peer_fused)
            else:
                per, parts, run_dir = run_distmoe(root, data, args.rounds, arm_overrides(arm), args.timeout)
                if checked is None:
                    checked = bit_identical(run_dir)
                    print(f"bit-identical initial weights: {checked}", flush=True)
            name = arm.partition("=")[0]
            times[name] = per
            row = {"rep": rep, "arm": name, "rounds_s": per, "steady_s": _steady(per), "load1": load,
                   "wall_s": time.monotonic() - t0, "parts_s": parts}
            rows.append(row)
            print(f"rep {rep} {name:12s} per round {' '.join(f'{x:.2f}' for x in per)} s | steady "
                  f"{_steady(per):.2f} s | load {load:.1f}"
                  + "".join(f" | {k} {' '.join(f'{x:.2f}' for x in v)}" for k, v in parts.items()), flush=True)
        for name, per in times.items():
            if name != "peer":
                rows.append({"rep": rep, "arm": name, "ratio_steady": _steady(per) / _steady(times["peer"]),
                             "ratio_all": statistics.mean(per) / statistics.mean(times["peer"])})
        (out / "results.json").write_text(json.dumps({"rows": rows, "bit_identical": checked,
                                                      "rounds": args.rounds}, indent=1))
    print(f"\nratios to the plain Flower FedAvg peer, per round (rounds 2..{args.rounds - 1}; all rounds in brackets), "
          f"{args.reps} repetitions, median [min, max]:")
    for arm in args.arms:
        name = arm.partition("=")[0]
        if name == "peer":
            continue
        rs = [r["ratio_steady"] for r in rows if r["arm"] == name and "ratio_steady" in r]
        ra = [r["ratio_all"] for r in rows if r["arm"] == name and "ratio_all" in r]
        print(f"  {name:12s} {statistics.median(rs):.3f} [{min(rs):.3f}, {max(rs):.3f}]  "
              f"(all rounds {statistics.median(ra):.3f})" + _interval_text(rs, len(args.arms) - 1, GOALS.get(name)))
    peer = [r["steady_s"] for r in rows if r["arm"] == "peer"]
    print(f"  peer per round: median {statistics.median(peer):.2f} s; load average 1 min over the arms: "
          f"{min(r['load1'] for r in rows if 'load1' in r):.1f}-{max(r['load1'] for r in rows if 'load1' in r):.1f} "
          f"on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
