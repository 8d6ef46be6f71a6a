"""Benchmark: how a run scales with the number of parties (3, 10, 20 by default), with secure aggregation on,
against the 3-party cell and the plaintext baseline measured in the same invocation.

    python bench/scale.py [--parties 3 10 20] [--sim-repeats 1] [--local-repeats 1] [--proto-repeats 3]
                          [--proto-parties 3 10 20 50 100] [--big-length] [--skip-sim] [--skip-local]
                          [--skip-proto] [--quick] [--verbose]

Three measurements, each printed as a Markdown table:

1. **Simulation** (``distmoe simulate``: Flower Simulation Engine on Ray, 1 CPU per virtual SuperNode, so two
   ClientApp actors on a 2-core machine serve the parties in turn). Tiny model (``TINY``: 0.23M parameters),
   schedule ``sft:lookup*3, stats:lookup, eval``, ``privacy.mode`` secagg and plaintext. Figures: wall time of
   the whole command, the time of each round as the coordinator logs it (``| x.x s`` at the end of each round
   line in ``flower.log``), and peak memory sampled once a second with psutil over every process that carries
   the run's token (``distmoe.simulate.processes_with_token``): the sum of RSS and of USS (unique set size:
   what the run really holds; RSS double-counts shared pages), the ServerApp process (``flwr-simulation``:
   the coordinator and the SecAgg server) and the largest ClientApp actor (``ClientAppActor``: the per-party
   figure, since an actor runs one party's message at a time; its baseline is torch + Ray).
2. **Real party code path in process** (``LocalTransport``, as ``bench/secagg.py``): the same config and
   schedule, the parties served one after another in this process through the codec, guards, signed ledgers
   and the party's privacy session. Figures: per round kind, the coordinator's time and the median time of one
   party's ``serve`` call per message type: ``query.setup`` (key advert), ``query.directory`` (directory in,
   first share keys out), the phase message (training + encoding + masking + next share keys; secagg minus
   plaintext is the protocol's share), ``query.consistency`` and ``query.unmask``; and the per-party SFT round
   cost (SFT round time / n, the parties served one after another) against the smallest party count's: flat
   when everything per party is O(1) or the protocol's O(n) part is small beside it.
3. **Protocol only** (``SecAggClient`` / ``SecAggServer`` driven stage by stage as in ``LocalFederation``), one
   round over a vector of the tiny model's SFT-update length (``--big-length``: also the default model's),
   complete graph vs the SecAgg+ Harary graph (``privacy.secagg-graph = "harary"``, degree from
   ``harary_degree``), without dropouts and with ceil(n/10) parties dropping before the masked input (the
   server rebuilds their pairwise masks). Per-party client figures are medians over the parties; server
   figures are totals and per party (total / n). Growth: the log-log slope of each per-party cost between the
   party counts from 10 up
   (least squares; 1 = linear per party, i.e. O(n^2) in total). Harary rows only where ``harary_degree(n) < n - 1``
   (from 26 parties with the defaults; below that the bound gives the complete graph).

Every cell gets fresh directories and a unique run id. Timings on a shared machine are noisy: compare the
ratios within one invocation, and raise the repeats (medians are reported). No timing is asserted.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import numpy as np
import psutil
import torch
from secagg import TimedCoordinator  # bench/secagg.py (this folder is on sys.path when run as a script)

from distmoe.config import parse_node_config, parse_run_config
from distmoe.data.synth import write_synthetic
from distmoe.inprocess import LocalTransport
from distmoe.model.build import build_model
from distmoe.model.trainable import apply_trainable, spec_of
from distmoe.privacy import secagg as sa
from distmoe.privacy.secagg.graph import graph_threshold, harary_degree, peer_graph
from distmoe.privacy.vectors import UpdateLayout
from distmoe.simulate import TOKEN_ENV, SimOptions, processes_with_token
from distmoe.simulate import run as simulate_run
from distmoe.wire import codec

TINY = {"model.hidden-size": 64, "model.moe-intermediate-size": 64, "model.layers": 2, "model.heads": 2,
        "model.kv-heads": 1, "model.head-dim": 32, "train.local-steps": 8, "data.synth-examples": 40}
SCHEDULE = "sft:lookup*3, stats:lookup, eval"
KINDS = ("sft", "stats", "eval")
MODES = ("plaintext", "secagg")
MB = 1e6
ROUND_RE = re.compile(r"distmoe \| round (\d+)/\d+ \| (\w+)[^\n]*\| ([0-9.]+) s\s*$")


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def _x(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and b > 0 and math.isfinite(a) else "n/a"


# ------------------------------------------------------------------------------------- 1. simulation
class MemSampler(threading.Thread):
    """Peak memory of every process of the one ``distmoe simulate`` run started from this process."""

    def __init__(self, interval: float = 1.0):
        super().__init__(daemon=True)
        self.interval = interval
        self.stop_evt = threading.Event()
        self.peak = {"sum_rss": 0, "sum_uss": 0, "server_rss": 0, "actor_rss": 0, "actors": 0}
        self.token: str | None = None

    def _find_token(self) -> str | None:
        for c in psutil.Process(os.getpid()).children(recursive=True):
            try:
                tok = c.environ().get(TOKEN_ENV)
            except (psutil.Error, OSError):
                continue
            if tok:
                return tok
        return None

    def run(self) -> None:
        while not self.stop_evt.is_set():
            if self.token is None:
                self.token = self._find_token()
            if self.token is not None:
                rss = uss = actors = 0
                for pid in processes_with_token(self.token):
                    try:
                        p = psutil.Process(pid)
                        mi = p.memory_full_info()
                        cmd = " ".join(p.cmdline()) or p.name()
                    except (psutil.Error, OSError):
                        continue
                    rss, uss = rss + mi.rss, uss + mi.uss
                    if "flwr-simulation" in cmd:
                        self.peak["server_rss"] = max(self.peak["server_rss"], mi.rss)
                    if "ClientAppActor" in cmd:
                        actors += 1
                        self.peak["actor_rss"] = max(self.peak["actor_rss"], mi.rss)
                self.peak["sum_rss"] = max(self.peak["sum_rss"], rss)
                self.peak["sum_uss"] = max(self.peak["sum_uss"], uss)
                self.peak["actors"] = max(self.peak["actors"], actors)
            self.stop_evt.wait(self.interval)


def sim_cell(n: int, mode: str, root: Path, args) -> dict:
    over = {**TINY, "schedule.phases": SCHEDULE, "privacy.mode": mode, "checkpoint.keep": 1}
    run_id = f"scale-sim-{mode}-{n}-{uuid.uuid4().hex[:6]}"
    mem = MemSampler()
    mem.start()
    t = time.perf_counter()
    try:
        code, run_dir = simulate_run(SimOptions(overrides=over, parties=n, runs_dir=root, run_id=run_id,
                                                timeout=args.sim_timeout, report=False, echo=args.verbose))
    finally:
        mem.stop_evt.set()
        mem.join()
    wall = time.perf_counter() - t
    log = (run_dir / "flower.log").read_text() if (run_dir / "flower.log").exists() else ""
    if code != 0:
        raise RuntimeError(f"{run_id}: simulate failed; log tail:\n{log[-3000:]}")
    rounds: dict[int, tuple[str, float]] = {}
    for line in log.splitlines():
        if m := ROUND_RE.search(line):
            rounds[int(m.group(1))] = (m.group(2), float(m.group(3)))
    by_kind: dict[str, list[float]] = defaultdict(list)
    for _r, (kind, s) in sorted(rounds.items()):
        by_kind[kind].append(s)
    out = {"wall_s": wall, "rounds_s": sum(s for _k, s in rounds.values()), **mem.peak,
           **{f"{k}_s": _med(v) for k, v in by_kind.items()}}
    out["other_s"] = wall - out["rounds_s"]  # start-up (Ray, SuperLink, model), secure setup, teardown
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------- 2. party code path in process
class StageTransport(LocalTransport):
    """``LocalTransport`` that times each party's ``serve`` call, per (round kind, message type)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.serve_s: dict[str, list[float]] = defaultdict(list)

    def _send(self, out, timeout, memo=None):
        got = {}
        for node, item in out.items():
            t = time.perf_counter()
            got.update(super()._send({node: item}, timeout, memo))
            self.serve_s[item[0]].append(time.perf_counter() - t)
        return got


def local_cell(n: int, mode: str, data_dirs: list[Path], root: Path, args) -> dict:
    over = {**TINY, "schedule.phases": SCHEDULE, "privacy.mode": mode, "checkpoint.keep": 1,
            "federation.wait-timeout": 1.0, "train.threads": 1}
    cfg = parse_run_config(over)
    run_id = f"scale-local-{mode}-{n}-{uuid.uuid4().hex[:6]}"
    base = root / run_id
    nodes = {100 + i: parse_node_config({"data-path": str(d), "work-dir": str(base / f"work-{i}")}, cfg.sim)
             for i, d in enumerate(data_dirs)}
    tr = StageTransport(cfg, nodes, run_id)
    coord = TimedCoordinator(cfg, base / "run", tr, run_id=run_id, log=print if args.verbose else (lambda _s: None))
    t = time.perf_counter()
    rec = coord.run()
    total = time.perf_counter() - t
    if rec.get("status") != "completed":
        raise RuntimeError(f"{run_id}: run did not complete: {rec.get('error')}")
    kinds = [p.kind for p in cfg.schedule.phases for _ in range(p.rounds)]
    out = {"total_s": total, "start_wire_s": coord.start_wire_s}
    for kind in KINDS:
        out[f"{kind}_s"] = _med([coord.round_s[r] for r, k in enumerate(kinds, 1) if k == kind])
    for mtype, xs in tr.serve_s.items():
        out[f"serve:{mtype}"] = _med(xs)
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------------- 3. protocol only
def protocol_cell(n: int, length: int, graph: str, drops: int, seed: int) -> dict:
    """One setup and one round, stage by stage; returns per-party client medians and server totals (s)."""
    run_id = os.urandom(16)
    peers = peer_graph(graph, run_id, n)
    t_thr = graph_threshold(graph, n, 2)
    params = sa.SecAggParams(run_id, t_thr, 64, length)
    ids = list(range(1, n + 1))
    server = sa.SecAggServer(params, peers=peers)
    clients = {i: sa.SecAggClient(params, i, peers=peers) for i in ids}
    rng = np.random.default_rng(seed)
    xs = {i: rng.integers(0, np.iinfo(np.uint64).max, length, dtype=np.uint64, endpoint=True) for i in ids}
    dropped = set(random.Random(seed).sample(ids, drops))
    c: dict[str, list[float]] = defaultdict(list)
    s: dict[str, float] = {}

    def cl(key, fn, *a, **kw):  # one client's stage call
        t0 = time.perf_counter()
        r = fn(*a, **kw)
        c[key].append(time.perf_counter() - t0)
        return r

    def sv(key, fn, *a, **kw):  # a server stage call (all parties at once)
        t0 = time.perf_counter()
        r = fn(*a, **kw)
        s[key] = s.get(key, 0.0) + time.perf_counter() - t0
        return r

    def setup_b(cl_, d):  # directory in, share keys of round 1 out (exchange B of the setup)
        cl_.receive_directory(d)
        return cl_.share_keys(1)

    adverts = [cl("advertise", x.advertise) for x in clients.values()]
    directory = sv("register", server.register, adverts)
    keys = [cl("share keys", setup_b, clients[i], directory) for i in server.roster]
    sv("add share keys", server.add_share_keys, keys)
    starts = sv("begin round", server.begin_round, 1, length)
    masked = [cl("masked input", clients[i].masked_input, starts[i], xs[i], share_next=False)
              for i in server.roster if i not in dropped]
    checks = sv("receive masked", server.receive_masked, 1, masked)
    signed = [cl("consistency", clients[i].consistency, q) for i, q in checks.items()]
    request = sv("receive consistency", server.receive_consistency, 1, signed)
    responses = [cl("unmask", clients[i].unmask, request) for i, _, _ in request.signatures]
    res = sv("finish", server.finish, 1, responses)
    expect = np.zeros(length, np.uint64)
    for i in ids:
        if i not in dropped:
            expect += xs[i]
    if not np.array_equal(res.total, expect):
        raise RuntimeError(f"secure sum differs from the plain sum (n={n}, graph={graph}, drops={drops})")
    holders = len(peers(1, tuple(ids))) + 1
    out = {f"c:{k}": statistics.median(v) for k, v in c.items()}
    out.update({f"s:{k}": v for k, v in s.items()})
    out["server_total"] = sum(s.values())
    out["holders"], out["t"] = holders, t_thr
    return out


def sft_length(over: dict, n: int) -> int:
    cfg = parse_run_config(over)
    model = apply_trainable(build_model(cfg.model)[0], cfg.model)
    shapes = spec_of(model, cfg.model.trainable).shapes
    return UpdateLayout.build(shapes, n, cfg.privacy.update_clip).length


def _slope(ns: list[int], ys: list[float]) -> float:
    """Least-squares slope of log(cost) on log(n) over the party counts from 10 up (all if fewer than two):
    1 = linear per party."""
    pts = [(n, y) for n, y in zip(ns, ys, strict=True) if n >= 10 and y > 0]
    if len(pts) < 2:
        pts = [(n, y) for n, y in zip(ns, ys, strict=True) if y > 0]
    if len(pts) < 2:
        return float("nan")
    lx, ly = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return float(np.polyfit(lx, ly, 1)[0])


# ------------------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parties", type=int, nargs="+", default=[3, 10, 20])
    ap.add_argument("--sim-repeats", type=int, default=1)
    ap.add_argument("--local-repeats", type=int, default=1)
    ap.add_argument("--proto-repeats", type=int, default=3)
    ap.add_argument("--proto-parties", type=int, nargs="+", default=[3, 10, 20, 50, 100])
    ap.add_argument("--big-length", action="store_true", help="protocol cells also at the default model's length")
    ap.add_argument("--sim-timeout", type=float, default=900.0)
    ap.add_argument("--skip-sim", action="store_true")
    ap.add_argument("--skip-local", action="store_true")
    ap.add_argument("--skip-proto", action="store_true")
    ap.add_argument("--quick", action="store_true", help="3 and 10 parties, protocol up to 20, one repeat")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--dir", default="")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.parties, args.proto_parties = [3, 10], [3, 10, 20]
        args.sim_repeats = args.local_repeats = args.proto_repeats = 1
    parties = sorted(set(args.parties))
    torch.set_num_threads(1)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="distmoe-bench-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    sim: dict[tuple[int, str], list[dict]] = defaultdict(list)
    loc: dict[tuple[int, str], list[dict]] = defaultdict(list)
    proto: dict[tuple[int, str, int, int], list[dict]] = defaultdict(list)
    try:
        if not args.skip_sim:
            for rep in range(args.sim_repeats):
                for n in parties:
                    for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                        r = sim_cell(n, mode, root, args)
                        sim[(n, mode)].append(r)
                        print(f"  sim   {n:3d} parties {mode:9s} rep {rep + 1}: {r['wall_s']:.0f} s, "
                              f"peak USS {r['sum_uss'] / MB:.0f} MB", flush=True)
        if not args.skip_local:
            for n in parties:
                data = write_synthetic(root / f"data-{n}-{uuid.uuid4().hex[:6]}", parties=n,
                                       examples_per_task=TINY["data.synth-examples"], seed=0)
                for rep in range(args.local_repeats):
                    for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                        r = local_cell(n, mode, data, root, args)
                        loc[(n, mode)].append(r)
                        print(f"  local {n:3d} parties {mode:9s} rep {rep + 1}: {r['total_s']:.1f} s", flush=True)
        lengths = {}
        if not args.skip_proto:
            lengths["tiny"] = sft_length({**TINY}, 3)
            if args.big_length:
                lengths["default"] = sft_length({}, 3)
            pp = sorted(set(args.proto_parties))
            for name, length in lengths.items():
                for n in (pp if name == "tiny" else [p for p in pp if p <= 20]):
                    for graph in ("complete", "harary"):
                        if graph == "harary" and harary_degree(n) >= n - 1:
                            continue  # the bound gives the complete graph at this n: nothing to compare
                        for drops in (0, math.ceil(n / 10)):
                            for rep in range(args.proto_repeats):
                                proto[(n, graph, drops, length)].append(protocol_cell(n, length, graph, drops, rep))
                    print(f"  proto {n:3d} parties, length {length}: done", flush=True)
    finally:
        if not args.dir and not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    print(f"\nbench/scale.py: total {time.perf_counter() - t_all:.0f} s; tiny model "
          f"({', '.join(f'{k}={v}' for k, v in TINY.items())}), schedule '{SCHEDULE}'")
    if sim:
        base = parties[0]
        print(f"\n### Simulation (distmoe simulate, Ray, 1 CPU per party; medians of {args.sim_repeats} run(s))\n")
        print("| parties | mode | wall s | vs 3 | sft round s | stats s | eval s | start-up + setup s | peak USS all "
              "| peak RSS all | server RSS | largest actor RSS |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for n in parties:
            for mode in MODES:
                rs = sim[(n, mode)]

                def m(key, rs=rs):
                    return _med([r.get(key) for r in rs])
                b = _med([r["wall_s"] for r in sim[(base, mode)]])
                print(f"| {n} | {mode} | {m('wall_s'):.0f} | {_x(m('wall_s'), b)} | {m('sft_s'):.1f} | "
                      f"{m('stats_s'):.1f} | {m('eval_s'):.1f} | {m('other_s'):.0f} | {m('sum_uss') / MB:.0f} MB | "
                      f"{m('sum_rss') / MB:.0f} MB | {m('server_rss') / MB:.0f} MB | {m('actor_rss') / MB:.0f} MB |")

        def sm(n, mode, key):
            return _med([r.get(key) for r in sim[(n, mode)]])
        print("\nsecagg / plaintext per cell: " + "; ".join(
            f"{n} parties: wall {_x(sm(n, 'secagg', 'wall_s'), sm(n, 'plaintext', 'wall_s'))}, "
            f"sft round {_x(sm(n, 'secagg', 'sft_s'), sm(n, 'plaintext', 'sft_s'))}, "
            f"peak USS {_x(sm(n, 'secagg', 'sum_uss'), sm(n, 'plaintext', 'sum_uss'))}" for n in parties))
    if loc:
        print(f"\n### Party code path in process (LocalTransport; medians of {args.local_repeats} run(s))\n")
        print("| parties | mode | sft round s | sft s / party | vs 3 | stats s | eval s | wire start s | "
              "per party: query.setup ms | query.directory ms | train.sft ms | train.stats ms | evaluate ms | "
              "query.consistency ms | query.unmask ms |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for n in parties:
            for mode in MODES:
                rs = loc[(n, mode)]

                def m(key, rs=rs):
                    return _med([r.get(key) for r in rs])

                def ms(mt, m=m):
                    v = m(f"serve:{mt}")
                    return "-" if not math.isfinite(v) else f"{v * 1e3:.0f}"
                base = _med([r.get("sft_s") for r in loc[(parties[0], mode)]]) / parties[0]
                print(f"| {n} | {mode} | {m('sft_s'):.2f} | {m('sft_s') / n:.3f} | {_x(m('sft_s') / n, base)} | "
                      f"{m('stats_s'):.2f} | {m('eval_s'):.2f} | "
                      f"{m('start_wire_s'):.2f} | {ms(codec.MSG_SETUP)} | {ms(codec.MSG_DIRECTORY)} | "
                      f"{ms(codec.MSG_SFT)} | {ms(codec.MSG_STATS)} | {ms(codec.MSG_EVAL)} | "
                      f"{ms(codec.MSG_CONSISTENCY)} | {ms(codec.MSG_UNMASK)} |")
    if proto:
        c_stages = ("advertise", "share keys", "masked input", "consistency", "unmask")
        s_stages = ("register", "add share keys", "begin round", "receive masked", "receive consistency", "finish")
        for length in lengths.values():
            print(f"\n### Protocol only, one round over a {length}-element vector in Z_2^64 "
                  f"(medians of {args.proto_repeats}; ms)\n")
            print("| parties | graph | holders k+1 | t | drops | " + " | ".join(f"client {s}" for s in c_stages) +
                  " | server total | server per party | " + " | ".join(f"server {s}" for s in s_stages) + " |")
            print("|" + "---|" * (5 + len(c_stages) + 2 + len(s_stages)))
            rows = sorted(k for k in proto if k[3] == length)
            for (n, graph, drops, _l) in rows:
                rs = proto[(n, graph, drops, length)]

                def m(key, rs=rs):
                    return _med([r.get(key) for r in rs])
                print(f"| {n} | {graph} | {int(m('holders'))} | {int(m('t'))} | {drops} | " +
                      " | ".join(f"{m('c:' + s) * 1e3:.2f}" for s in c_stages) +
                      f" | {m('server_total') * 1e3:.1f} | {m('server_total') / n * 1e3:.2f} | " +
                      " | ".join(f"{m('s:' + s) * 1e3:.1f}" for s in s_stages) + " |")
            for graph in ("complete", "harary"):
                for drops_zero in (True, False):
                    keys = sorted((n, d) for (n, g, d, ln) in proto if ln == length and g == graph
                                  and (d == 0) == drops_zero)
                    if len(keys) < 2:
                        continue
                    ns = [n for n, _d in keys]

                    def per(stage, keys=keys, graph=graph, length=length):
                        return [_med([r.get(stage) for r in proto[(n, graph, d, length)]]) for n, d in keys]
                    base_n = ns[0]
                    parts = []
                    for st in c_stages:
                        ys = per("c:" + st)
                        parts.append(f"client {st} x{ys[-1] / ys[0]:.1f} (slope {_slope(ns, ys):.2f})")
                    ys = [v / n for v, n in zip(per("server_total"), ns, strict=True)]
                    parts.append(f"server per party x{ys[-1] / ys[0]:.1f} (slope {_slope(ns, ys):.2f})")
                    print(f"\ngrowth, {graph}, {'no drops' if drops_zero else 'n/10 drops'}, {base_n} -> {ns[-1]} "
                          f"parties (x{ns[-1] / base_n:.1f}): " + "; ".join(parts))


if __name__ == "__main__":
    main()
