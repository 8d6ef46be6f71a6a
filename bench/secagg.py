"""Benchmark: the cost of secure aggregation (``privacy.mode = "secagg"``, the default) against the plaintext
baseline (``privacy.mode = "plaintext"``: plain arrays summed at the server), end to end through the coordinator,
measured in one run for each party count.

    python bench/secagg.py [--parties 3 5 10] [--quick] [--repeats 3] [--no-protocol] [--no-flower]
                           [--exec inproc procs] [--warmup 1] [--local-steps 2] [--batch-size 4]
                           [--work stress default] [--default-repeats 1]
                           [--examples 24] [--threads 1] [--no-premask] [--verbose]

Setup: the default model (no ``model.*`` overrides: 7.12M parameters, all trainable), synthetic party data
(``write_synthetic``, ``--examples`` per task per party), the schedule ``sft:lookup, stats:lookup, eval`` with one
SFT round and, by default, little local work (the stress case: ``--local-steps 2`` steps of batch 4, 4 eval
examples, 2 new tokens), so that local training does not dominate; ``--local-steps 40 --batch-size 16`` is the
default local work of ``train.*``. Each cell runs the parties two ways (``--exec``):

- ``inproc``: ``LocalTransport``, the parties in this process, one after another, on the exact party code path
  (codec records, outbound and server guards, signed ledgers);
- ``procs``: each party its own OS process (``PartyProcesses``: forkserver, one pipe each), all served
  concurrently as in deployment; every instruction and reply crosses the process boundary as Flower's protobuf
  bytes (``recorddict_to_proto``), the coordinator stays in this process. A process keeps its loaded base across
  messages (as the Simulation Engine's actors do), and ``--warmup`` unrecorded runs per cell absorb its cold start.
  On a machine with fewer cores than parties the processes share the cores: the parallel speed-up is bounded by
  ``os.cpu_count()`` (printed).

Every run gets fresh work directories and a unique run id; the two modes alternate per repeat.

Measured:

- wall time of each round kind (sft / stats / eval), timed around the coordinator's round methods, per mode, and
  the ratio secagg / plaintext; the share spent inside the parties' ``serve`` calls (training, encoding, masking)
  is timed in the transport (the rest is the coordinator: guards, codec, unmasking, aggregation, checkpoint);
  and the parties' CPU seconds in those calls (``time.process_time``, every thread of the party's process: the
  masks expanded in a second thread while it trains, ``privacy.secagg-premask``, are counted), whose secagg /
  plaintext ratio is what the wall ratio tends to where the parties saturate the cores (10 processes on 2);
- the one-off setup of secagg mode (key adverts, directory, first share keys: ``SecureRounds.setup``, before
  round 1), timed around the coordinator's wire start (which in plaintext mode only builds the allow-list);
- bytes per party per round from the ledgers: up = the ``bytes`` of every "out" entry of a party's ledger in that
  round (masked input + unmask response in secagg mode), down = the coordinator's "out" entries to parties in that
  round (instruction + unmask request), each averaged over the parties;
- (unless ``--no-flower``) the peer: Flower's own SecAgg+ (flwr 1.42 ``SecAggPlusWorkflow`` + ``secaggplus_mod``,
  ``bench/flower_secaggplus.py``) over a float32 vector of the SFT update's length with the same parties, one fit
  round against Flower's plaintext fit round, and its bytes per party (Flower's protobuf messages);
- (unless ``--no-protocol``) the pure protocol cost for a vector of the SFT update's length in Z_2^64 with
  ``SecAggClient`` / ``SecAggServer`` driven stage by stage as in ``distmoe.privacy.secagg.LocalFederation``:
  the setup, one client's ``masked_input`` (n PRG mask expansions), the server's ``receive_masked`` +
  ``finish`` (sum + n self-mask expansions), next to a plain float32 sum of n updates.

Prints the tables and ratios; no timing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from distmoe.audit.integrity import STRUCTURAL
from distmoe.config import parse_node_config, parse_run_config
from distmoe.coordinator import Coordinator
from distmoe.data.synth import write_synthetic
from distmoe.inprocess import LocalTransport
from distmoe.model.build import build_model
from distmoe.model.trainable import apply_trainable, spec_of
from distmoe.privacy import secagg as sa
from distmoe.privacy.vectors import UpdateLayout
from distmoe.rundir.metrics import read_metrics

SCHEDULE = "sft:lookup, stats:lookup, eval"
_DEFAULTS = parse_run_config({}).train
DEFAULT_WORK = (_DEFAULTS.local_steps, _DEFAULTS.batch_size)  # the default local work (40 x 16), from train.*
KINDS = ("sft", "stats", "eval")
MODES = ("plaintext", "secagg")
MB = 1e6


# ------------------------------------------------------------------------------------------ timed run
class TimedTransport(LocalTransport):
    """``LocalTransport`` that adds up the time spent inside the parties (``serve``) per round (0 = setup)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.party_s: dict[int, float] = defaultdict(float)
        self.party_cpu_s: dict[int, float] = defaultdict(float)  # the parties' CPU seconds, all their threads
        self._rnd = 0

    def exchange(self, instructions, expected, timeout, *, rnd=None, phase="", lengths=None, probe=None):
        self._rnd = int(rnd or 0)
        return super().exchange(instructions, expected, timeout, rnd=rnd, phase=phase, lengths=lengths, probe=probe)

    def _send(self, out, timeout, memo=None):
        t, c = time.perf_counter(), time.process_time()  # in process: nothing else runs during the parties' calls
        try:
            return super()._send(out, timeout, memo)
        finally:
            self.party_s[self._rnd] += time.perf_counter() - t
            self.party_cpu_s[self._rnd] += time.process_time() - c


class TimedCoordinator(Coordinator):
    """``Coordinator`` that records the wall time of the wire start (secure setup) and of every round."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.round_s: dict[int, float] = {}
        self.start_wire_s = 0.0

    def start_plane(self, nodes):
        t = time.perf_counter()
        super().start_plane(nodes)
        self.start_wire_s = time.perf_counter() - t

    def play_round(self, index, phase):
        t = time.perf_counter()
        out = super().play_round(index, phase)
        self.round_s[self.s.round] = time.perf_counter() - t
        return out


# ------------------------------------------------------------------------------ parties as processes
def _party_worker(conn, threads: int) -> None:
    """One party's OS process: receives (cfg, node config, node id, run id, message type, Flower protobuf
    bytes of the instruction), serves it on the party code path, sends the reply's protobuf bytes back (or
    an error code, as the ClientApp does). Runs until it receives ``None``."""
    from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=no-name-in-module

    from distmoe.party.service import PartyService
    from distmoe.wire.errors import ErrorCode, Refused, reason_text
    from distmoe.wire.party_guard import serve

    torch.set_num_threads(threads)
    while (job := conn.recv()) is not None:
        cfg, node_cfg, node, run_id, mtype, blob = job
        t, c = time.perf_counter(), time.process_time()
        try:
            content = recorddict_from_proto(ProtoRecordDict.FromString(blob))
            reply = serve(mtype, content, PartyService(cfg, node_cfg, node, run_id), run_id)
            status, body = "ok", recorddict_to_proto(reply).SerializeToString()
        except Refused as exc:
            status, body = "error", (str(exc), int(exc.code))
        except Exception:  # as the ClientApp does: an error reply without text
            status, body = "error", (reason_text(ErrorCode.INTERNAL), int(ErrorCode.INTERNAL))
        conn.send((status, body, time.perf_counter() - t, time.process_time() - c))


class PartyProcesses:
    """``n`` party processes (forkserver: started from a clean server process with torch, the party service and
    Flower's serde preloaded, never forked from a parent that ran torch), one pipe each. Process i serves the
    i-th node of every run it is given; all its state between messages is in the party's work directory, as in
    deployment (where a SuperNode starts a fresh ClientApp process per message, this process keeps the loaded
    base across messages, as the Simulation Engine's actors do)."""

    def __init__(self, n: int, threads: int):
        import multiprocessing as mp

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "distmoe.party.service", "distmoe.wire.party_guard", "flwr.common.serde"])
        self.conns, self.procs = [], []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_party_worker, args=(child, threads), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()


class ProcessTransport(TimedTransport):
    """The parties in their own OS processes (``PartyProcesses``), served concurrently: every instruction leaves
    the coordinator as Flower's protobuf bytes over a pipe and every reply comes back the same way (the codec,
    guards and ledgers are the same as in process). ``party_s`` = the wall time of each exchange from the
    first send to the last reply (the parties in parallel); ``serve_s`` = the sum of the parties' own serve
    times. No fault injection (``down``/``drop``/``late``/``tamper`` are not used here)."""

    def __init__(self, cfg, nodes, run_id, procs: PartyProcesses):
        super().__init__(cfg, nodes, run_id)
        self.procs = procs
        self.index = {node: i for i, node in enumerate(sorted(nodes))}
        self.serve_s: dict[int, float] = defaultdict(float)

    def _send(self, out, timeout, memo=None):
        from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
        from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=no-name-in-module

        from distmoe.wire import codec

        t = time.perf_counter()
        for node, (mtype, content) in out.items():
            blob = recorddict_to_proto(content).SerializeToString()
            self.procs.conns[self.index[node]].send((self.cfg, self.nodes[node], node, self.run_id, mtype, blob))
        got = {}
        for node in out:
            status, body, served, cpu = self.procs.conns[self.index[node]].recv()
            self.serve_s[self._rnd] += served
            self.party_cpu_s[self._rnd] += cpu
            got[node] = (recorddict_from_proto(ProtoRecordDict.FromString(body)) if status == "ok"
                         else codec.ErrorReply(*body))
        self.party_s[self._rnd] += time.perf_counter() - t
        return got


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _bytes_per_round(run_dir: Path, work_dirs: list[Path], n: int) -> tuple[dict[int, float], dict[int, float]]:
    """(up, down) bytes per party per round (0 = setup), averaged over the ``n`` parties. Setup entries go by
    phase: a party logs its first share keys under the round they are for (1), the coordinator under 0."""
    up: dict[int, float] = defaultdict(float)
    down: dict[int, float] = defaultdict(float)

    def rnd(e: dict) -> int:
        return 0 if e["phase"] == "setup" else int(e["round"] or 0)

    for e in _jsonl(run_dir / "ledger" / "coordinator.jsonl"):
        if e["direction"] == "out" and e.get("peer") != "all" and e["payload_type"] not in STRUCTURAL:
            down[rnd(e)] += e["bytes"] / n
    for wd in work_dirs:
        for path in (wd / "ledger").glob("*.jsonl"):
            for e in _jsonl(path):
                if e["direction"] == "out" and e["payload_type"] not in STRUCTURAL:
                    up[rnd(e)] += e["bytes"] / n
    return up, down


def one_run(mode: str, n: int, data_dirs: list[Path], root: Path, args, log, procs: PartyProcesses | None = None,
            work: tuple[int, int] | None = None) -> dict:
    """One run; the parties in this process one after another, or (``procs``) each in its own process.
    ``work``: (local steps, batch size), default ``--local-steps`` x ``--batch-size``."""
    steps, batch = work or (args.local_steps, args.batch)
    overrides = {"schedule.phases": SCHEDULE, "schedule.sft-rounds": 1, "train.local-steps": steps,
                 "train.batch-size": batch, "train.threads": args.threads, "data.max-eval-examples": 4,
                 "data.synth-examples": args.examples, "eval.max-new-tokens": 2, "federation.wait-timeout": 1.0,
                 "checkpoint.keep": 1, "privacy.mode": mode, "privacy.secagg-premask": not args.no_premask}
    cfg = parse_run_config(overrides)
    run_id = f"bench-secagg-{mode}-{n}-{uuid.uuid4().hex[:8]}"
    base = root / run_id
    work_dirs = [base / f"work-{i}" for i in range(n)]
    nodes = {100 + i: parse_node_config({"data-path": str(d), "work-dir": str(w)}, cfg.sim)
             for i, (d, w) in enumerate(zip(data_dirs, work_dirs, strict=True))}
    transport = (ProcessTransport(cfg, nodes, run_id, procs) if procs is not None
                 else TimedTransport(cfg, nodes, run_id))
    run_dir = base / "run"
    coord = TimedCoordinator(cfg, run_dir, transport, run_id=run_id, log=log)
    t = time.perf_counter()
    record = coord.run()
    total = time.perf_counter() - t
    if record.get("status") != "completed":
        raise RuntimeError(f"{run_id}: run did not complete: {record.get('error')}")
    kinds = [p.kind for p in cfg.schedule.phases for _ in range(p.rounds)]  # round i + 1 -> kind
    up, down = _bytes_per_round(run_dir, work_dirs, n)
    train = [e for e in read_metrics(run_dir / "metrics.jsonl") if e.get("event") == "train"]
    included = {int(e.get("parties", 0)) for e in train if e.get("party") == "all"}
    if included != {n}:
        print(f"WARNING: {run_id}: train events aggregate {sorted(included)} parties, expected {n}")
    out = {"total_s": total, "start_wire_s": coord.start_wire_s, "setup_party_s": transport.party_s.get(0, 0.0),
           "setup_up": up.get(0, 0.0), "setup_down": down.get(0, 0.0), "params": record["model"]["parameters"],
           "trainable": record["model"]["trainable_numel"]}
    for r, kind in enumerate(kinds, start=1):
        out[kind] = {"wall_s": coord.round_s[r], "party_s": transport.party_s.get(r, 0.0),
                     "cpu_s": transport.party_cpu_s.get(r, 0.0),
                     "up": up.get(r, 0.0), "down": down.get(r, 0.0)}
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------------- protocol only
def protocol_cost(n: int, length: int, seed: int = 0) -> dict:
    """SecAgg stage by stage for n clients and one [length] vector in Z_2^64 (as ``LocalFederation``)."""
    t_thr = max(2, n // 2 + 1)
    params = sa.SecAggParams(os.urandom(16), t_thr, 64, length)
    ids = list(range(1, n + 1))
    server = sa.SecAggServer(params)
    clients = {i: sa.SecAggClient(params, i) for i in ids}
    rng = np.random.default_rng(seed)
    xs = {i: rng.integers(0, np.iinfo(np.uint64).max, length, dtype=np.uint64, endpoint=True) for i in ids}
    t = time.perf_counter()
    directory = server.register([c.advertise() for c in clients.values()])
    keys = []
    for i in server.roster:
        clients[i].receive_directory(directory)
        keys.append(clients[i].share_keys(1))
    server.add_share_keys(keys)
    setup_s = time.perf_counter() - t
    starts = server.begin_round(1, length)
    masked, mask_s = [], []
    for i in server.roster:
        t = time.perf_counter()
        masked.append(clients[i].masked_input(starts[i], xs[i]))
        mask_s.append(time.perf_counter() - t)
    t = time.perf_counter()
    checks = server.receive_masked(1, masked)
    recv_s = time.perf_counter() - t
    signed, check_s = [], []
    for i, q in checks.items():  # the consistency stage (Bonawitz et al. §4)
        t = time.perf_counter()
        signed.append(clients[i].consistency(q))
        check_s.append(time.perf_counter() - t)
    t = time.perf_counter()
    request = server.receive_consistency(1, signed, min_contributors=2)
    recv_check_s = time.perf_counter() - t
    responses, unmask_s = [], []
    for i, _, _ in request.signatures:
        t = time.perf_counter()
        responses.append(clients[i].unmask(request, min_contributors=2))
        unmask_s.append(time.perf_counter() - t)
    t = time.perf_counter()
    res = server.finish(1, responses)
    finish_s = time.perf_counter() - t
    expect = np.zeros(length, np.uint64)
    for x in xs.values():
        expect += x
    if not np.array_equal(res.total, expect):
        raise RuntimeError("secure sum differs from the plain sum")
    plain = [rng.standard_normal(length, dtype=np.float32) for _ in ids]
    t = time.perf_counter()
    acc = np.zeros(length, np.float32)
    for x in plain:
        acc += x
    plain_s = time.perf_counter() - t
    return {"setup_s": setup_s, "mask_s": statistics.median(mask_s), "mask_total_s": sum(mask_s),
            "server_s": recv_s + recv_check_s + finish_s, "plain_sum_s": plain_s,
            "check_s": statistics.median(check_s), "server_check_s": recv_check_s,
            "unmask_s": statistics.median(unmask_s),
            "check_bytes": sa.payload_bytes(signed[0]) + sa.payload_bytes(next(iter(checks.values())))
            + sa.payload_bytes(request.signatures) + sa.payload_bytes(masked[0].count_shares)}


# ------------------------------------------------------------------------------------------ report
def _size(b: float) -> str:
    return f"{b / MB:.2f} MB" if b >= MB else f"{b / 1e3:.1f} KB"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


EXECS = ("inproc", "procs")
EXEC_TEXT = {"inproc": "in process", "procs": "processes"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parties", type=int, nargs="+", default=[3, 5, 10])
    ap.add_argument("--quick", action="store_true", help="only 3 parties, one run per mode (overrides both)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode and party count (median reported)")
    ap.add_argument("--local-steps", type=int, default=2)
    ap.add_argument("--batch", "--batch-size", dest="batch", type=int, default=4)
    ap.add_argument("--examples", type=int, default=24, help="synthetic examples per task per party")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--exec", nargs="+", choices=EXECS, default=list(EXECS),
                    help="inproc: the parties one after another in this process; procs: each party its own OS "
                         "process, served concurrently, messages as Flower protobuf bytes over pipes")
    ap.add_argument("--work", nargs="+", choices=("stress", "default"), default=["stress"],
                    help="stress: --local-steps x --batch-size (2 x 4: the protocol dominates); default: the default "
                         "local work of train.* (40 x 16); both in one invocation with --work stress default")
    ap.add_argument("--default-repeats", type=int, default=1, help="runs per mode for the default-work cells")
    ap.add_argument("--warmup", type=int, default=1, help="unrecorded runs before each cell's first (cold start)")
    ap.add_argument("--no-flower", action="store_true", help="skip Flower's own SecAgg+ (bench/flower_secaggplus.py)")
    ap.add_argument("--no-protocol", action="store_true", help="skip the SecAgg-only measurement")
    ap.add_argument("--no-premask", action="store_true",
                    help="privacy.secagg-premask = false: expand the update's masks after training, not during it")
    ap.add_argument("--keep", action="store_true", help="keep the run and work directories")
    ap.add_argument("--dir", default="", help="where to put data and runs (default: a temporary directory)")
    ap.add_argument("--verbose", action="store_true", help="print the coordinator's log lines")
    args = ap.parse_args()
    parties = [3] if args.quick else sorted(set(args.parties))
    if args.quick:
        args.repeats = 1
    execs = [e for e in EXECS if e in args.exec]
    torch.set_num_threads(args.threads)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="distmoe-bench-secagg-"))
    root.mkdir(parents=True, exist_ok=True)
    log = print if args.verbose else (lambda _s: None)

    works = {"stress": (args.local_steps, args.batch), "default": DEFAULT_WORK}
    works = {w: works[w] for w in ("stress", "default") if w in args.work}
    res: dict[tuple[int, str, str, str], list[dict]] = defaultdict(list)
    flower: dict[tuple[int, bool], list[dict]] = defaultdict(list)
    t_all = time.perf_counter()
    try:
        for n in parties:
            data = write_synthetic(root / f"data-{n}-{uuid.uuid4().hex[:6]}", parties=n,
                                   examples_per_task=args.examples, seed=0)
            for ex in execs:
                procs = PartyProcesses(n, args.threads) if ex == "procs" else None
                try:
                    for _ in range(args.warmup):  # not recorded: builds each process's base, warms torch
                        one_run("plaintext", n, data, root, args, log, procs)
                    for w, wk in works.items():
                        for rep in range(args.repeats if w == "stress" else args.default_repeats):
                            for mode in (MODES if rep % 2 == 0 else MODES[::-1]):  # alternate which mode goes first
                                r = one_run(mode, n, data, root, args, log, procs, wk)
                                res[(n, ex, mode, w)].append(r)
                                print(f"  {n:2d} parties, {EXEC_TEXT[ex]:10s}, {w:7s} work, {mode:9s} run {rep + 1}: "
                                      f"{r['total_s']:.1f} s (sft {r['sft']['wall_s']:.2f} s, stats "
                                      f"{r['stats']['wall_s']:.2f} s, eval {r['eval']['wall_s']:.2f} s)", flush=True)
                finally:
                    if procs is not None:
                        procs.close()
        length_of: dict[int, int] = {}
        if not (args.no_protocol and args.no_flower):
            cfg = parse_run_config({})
            model = apply_trainable(build_model(cfg.model)[0], cfg.model)
            shapes = spec_of(model, cfg.model.trainable).shapes
            length_of = {n: UpdateLayout.build(shapes, n, cfg.privacy.update_clip).length for n in parties}
        if not args.no_flower:
            from flower_secaggplus import flower_round  # bench/flower_secaggplus.py (this folder is on sys.path)

            for n in parties:
                for rep in range(args.repeats):
                    for secure in ((False, True) if rep % 2 == 0 else (True, False)):
                        flower[(n, secure)].append(flower_round(n, length_of[n], secure, rep))
                print(f"  Flower SecAgg+, {n:2d} parties: done", flush=True)
        proto = {}
        if not args.no_protocol:
            for n in parties:
                proto[n] = (length_of[n], protocol_cost(n, length_of[n]))
                print(f"  protocol only, {n:2d} parties: done", flush=True)
    finally:
        if not args.dir and not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    w0 = next(iter(works))  # the wire start and the bytes do not depend on the local work

    def med(n: int, ex: str, mode: str, *path: str, work: str = "") -> float:
        vals = []
        for r in res[(n, ex, mode, work or w0)]:
            v = r
            for p in path:
                v = v[p]
            vals.append(v)
        return statistics.median(vals)

    def fmed(n: int, secure: bool, key: str) -> float:
        return statistics.median(r[key] for r in flower[(n, secure)])

    first = res[(parties[0], execs[0], "secagg", w0)][0]
    print()
    print(f"model {first['params'] / 1e6:.2f}M params ({first['trainable'] / 1e6:.2f}M trainable), schedule "
          f"'{SCHEDULE}', local work " + ", ".join(f"{w} {st} steps x batch {b}" for w, (st, b) in works.items())
          + f", {args.threads} thread(s) per party, {args.repeats} run(s) per stress cell and {args.default_repeats} "
          f"per default-work cell (median), {os.cpu_count()} CPU(s), "
          f"total {time.perf_counter() - t_all:.0f} s")
    print("\nWall time per round (s); 'in parties' = in process: the sum of the parties' serve calls (one after "
          "another); processes: from the first send to the last reply (the parties concurrently). 'parties CPU s' "
          "= plaintext/secagg CPU seconds of the parties' serve calls, all their threads (on cores the parties "
          "saturate, the wall ratio tends to this ratio)")
    print(f"{'round':6s} {'work':>7s} {'parties':>7s} {'exec':>10s} {'plaintext':>10s} {'secagg':>8s} {'ratio':>7s} "
          f"{'plain in parties':>17s} {'secagg in parties':>18s} {'extra s':>8s} {'parties CPU s':>15s} "
          f"{'CPU ratio':>9s}")
    for w in works:
        for kind in KINDS:
            for n in parties:
                for ex in execs:
                    p, s = med(n, ex, "plaintext", kind, "wall_s", work=w), med(n, ex, "secagg", kind, "wall_s", work=w)
                    pp = med(n, ex, "plaintext", kind, "party_s", work=w)
                    sp = med(n, ex, "secagg", kind, "party_s", work=w)
                    pc = med(n, ex, "plaintext", kind, "cpu_s", work=w)
                    sc = med(n, ex, "secagg", kind, "cpu_s", work=w)
                    print(f"{kind:6s} {w:>7s} {n:7d} {EXEC_TEXT[ex]:>10s} {p:10.2f} {s:8.2f} {_ratio(s, p):>7s} "
                          f"{pp:17.2f} {sp:18.2f} {s - p:8.2f} {f'{pc:.2f}/{sc:.2f}':>15s} {_ratio(sc, pc):>9s}")
    if flower:
        print("\nPeer: Flower's own SecAgg+ (flwr 1.42 SecAggPlusWorkflow + secaggplus_mod, complete graph: "
              "num_shares = n, threshold n//2+1), one fit round over a float32 vector of the SFT update's length, "
              "in process (bench/flower_secaggplus.py: the clients return a fixed vector, no training)")
        print(f"{'round':6s} {'parties':>7s} {'exec':>10s} {'Flower plain':>13s} {'SecAgg+':>8s} {'ratio':>7s} "
              f"{'extra s':>8s} {'max abs err':>12s}")
        for n in parties:
            p, s = fmed(n, False, "wall_s"), fmed(n, True, "wall_s")
            print(f"{'fit':6s} {n:7d} {EXEC_TEXT['inproc']:>10s} {p:13.2f} {s:8.2f} {_ratio(s, p):>7s} {s - p:8.2f} "
                  f"{fmed(n, True, 'max_err'):12.1e}")
    print("\nOne-off wire start before round 1 (s): allow-list + ledger (both modes) + secure setup (secagg only)")
    print(f"{'parties':>7s} {'exec':>10s} {'secagg':>7s} {'plaintext':>10s} {'setup extra':>12s} {'in parties':>11s} "
          f"{'up/party':>10s} {'down/party':>11s}")
    for n in parties:
        for ex in execs:
            s_w, p_w = med(n, ex, "secagg", "start_wire_s"), med(n, ex, "plaintext", "start_wire_s")
            print(f"{n:7d} {EXEC_TEXT[ex]:>10s} {s_w:7.2f} {p_w:10.2f} {s_w - p_w:12.2f} "
                  f"{med(n, ex, 'secagg', 'setup_party_s'):11.2f} {_size(med(n, ex, 'secagg', 'setup_up')):>10s} "
                  f"{_size(med(n, ex, 'secagg', 'setup_down')):>11s}")
    print("\nBytes per party per round (distmoe: from the ledgers; Flower: its protobuf messages of the fit round)")
    print(f"{'round':6s} {'parties':>7s} {'up plain':>10s} {'up secagg':>10s} {'ratio':>7s} {'up SecAgg+':>11s} "
          f"{'ratio':>7s} {'down plain':>11s} {'down secagg':>12s} {'ratio':>7s} {'down SecAgg+':>13s}")
    ex0 = execs[0]  # the bytes do not depend on how the parties are run
    for kind in KINDS:
        for n in parties:
            up_p, up_s = med(n, ex0, "plaintext", kind, "up"), med(n, ex0, "secagg", kind, "up")
            dn_p, dn_s = med(n, ex0, "plaintext", kind, "down"), med(n, ex0, "secagg", kind, "down")
            f_up = f_dn = "-"
            f_ratio = "-"
            if kind == "sft" and flower:
                f_up, f_dn = _size(fmed(n, True, "up")), _size(fmed(n, True, "down"))
                f_ratio = _ratio(fmed(n, True, "up"), fmed(n, False, "up"))
            print(f"{kind:6s} {n:7d} {_size(up_p):>10s} {_size(up_s):>10s} {_ratio(up_s, up_p):>7s} {f_up:>11s} "
                  f"{f_ratio:>7s} {_size(dn_p):>11s} {_size(dn_s):>12s} {_ratio(dn_s, dn_p):>7s} {f_dn:>13s}")
    if proto:
        print("\nProtocol only (SecAggClient/SecAggServer, one round over the SFT update vector in Z_2^64)")
        print(f"{'parties':>7s} {'length':>10s} {'setup s':>8s} {'mask/client s':>14s} {'mask all s':>11s} "
              f"{'server s':>9s} {'float32 sum s':>14s}")
        for n, (length, c) in proto.items():
            print(f"{n:7d} {length:10d} {c['setup_s']:8.3f} {c['mask_s']:14.3f} {c['mask_total_s']:11.3f} "
                  f"{c['server_s']:9.3f} {c['plain_sum_s']:14.3f}")
            print(f"        consistency check: client {c['check_s'] * 1e3:.2f} ms (sign) + "
                  f"{c['unmask_s'] * 1e3:.2f} ms (verify + unmask), server {c['server_check_s'] * 1e3:.2f} ms, "
                  f"{c['check_bytes']} extra bytes per party per round")


if __name__ == "__main__":
    main()
