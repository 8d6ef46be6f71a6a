"""Where distmoe's per-round time goes, against the plain-Flower peer's doing the same training, in one process.

    python bench/round_profile.py [--mode default|plaintext] [--rounds 4] [--steps 40] [--out DIR] [--json FILE]
                                  [--no-peer] [--cprofile [--top N] [--pstats FILE]]
    python bench/round_profile.py --ledger RUN_DIR

The run is ``bench/peer_flower.py``'s distmoe arm (``schedule.phases = 'sft:lookup'``, 3 parties of synthetic
data, the default model, ``train.local-steps`` steps of 16, ``privacy.mode`` as given) driven by the coordinator over
``distmoe.inprocess.LocalTransport``: the parties' exact code path (guards, codec, ledgers, secure aggregation, the
carried routing probe), packed as Flower carries it, all in this one process and thread. In rounds 2..R-1 (the
steady rounds ``bench/peer_flower.py`` compares) named steps (``TIMED``) add up their ``time.thread_time``, split by
side (inside a party's ``serve`` or not), so a loaded machine inflates no figure with other processes' time; the
round's total ``time.process_time`` beside it adds this process's other threads (the mask expansion on spare
threads, ``privacy.secagg-premask``); ``os.fsync`` calls are counted per side with their wall time (the disk's, not
CPU). ``--cprofile`` adds cProfile for finding candidates only: its per-call cost inflates Python-heavy functions.

The peer's per-round work is then timed the same way on the same data and model: per party, what its ClientApp's
``train`` handler does (``bench/peer_flower/peer_app.py``: the ``ArrayRecord`` into the model, the AdamW steps with
torch's fused kernel, the reply's ``ArrayRecord``) and Flower's ``FedAvg`` aggregation at the server.

``--ledger RUN_DIR`` reads a real run's ledgers instead (``distmoe simulate``'s run directory): per round and
message stage, the coordinator's time before it, the slowest party's wait for the message, its work and the way
back (``ledger_stages``): the wall-clock stalls no CPU profile shows. Not measured here: what the Simulation Engine
adds to both arms (Ray, Flower's message serialisation: the same records and sizes in both).

Must not: be imported by the library (bench only).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from distmoe.config import parse_node_config, parse_run_config  # noqa: E402
from distmoe.coordinator import Coordinator  # noqa: E402
from distmoe.coordinator import loop as _loop  # noqa: E402
from distmoe.data.synth import synth_tasks, write_synthetic  # noqa: E402
from distmoe.inprocess import LocalTransport  # noqa: E402

# (label, module, attribute[, class]): each wrapped with a thread-CPU accumulator, split by side (inside a party's
# ``serve`` or not); nested components are inclusive (a parent's figure contains its children's)
TIMED = [
    ("serve: everything a party does per message", "distmoe.inprocess", "serve"),
    ("unpack (packed records to logical ones)", "distmoe.wire.packing", "unpack"),
    ("read_instruction (strict decode)", "distmoe.wire.party_guard", "read_instruction"),
    ("ledger entry of a message (describe: sha256; sign)", "distmoe.wire.party_guard", "_log"),
    ("describe (keys, shapes, sha256 of the content)", "distmoe.wire.inspect", "describe"),
    ("carried routing probe", "distmoe.party.service", "run_carried"),
    ("run_sft", "distmoe.party.work", "run_sft"),
    ("train_sft (the optimizer steps)", "distmoe.party.work", "train_sft"),
    ("prepare_model (sft)", "distmoe.party.work", "prepare_model"),
    ("prepare_model (probe)", "distmoe.party.probe", "prepare_model"),
    ("load_data", "distmoe.party.work", "load_data"),
    ("update encode (clip, quantise)", "distmoe.privacy.releases.update", "encode"),
    ("masked input", "distmoe.party.session", "masked", "PartySession"),
    ("codec.encode", "distmoe.wire.codec", "encode"),
    ("outbound guard check", "distmoe.wire.party_guard", "check", "OutboundGuard"),
    ("run receipt", "distmoe.party.service", "write_receipt"),
    ("PartyService()", "distmoe.party.service", "__init__", "PartyService"),
    ("pack (transport)", "distmoe.inprocess", "pack"),
    ("server guard outbound", "distmoe.wire.server_guard", "outbound", "ServerGuard"),
    ("server guard inbound", "distmoe.wire.server_guard", "inbound", "ServerGuard"),
    ("secure collect (whole exchange)", "distmoe.coordinator.secure", "collect", "SecureAggregator"),
    ("checkpoint", "distmoe.coordinator.context", "checkpoint", "RunContext"),
    ("secagg server: receive masked inputs", "distmoe.privacy.secagg.server", "receive_masked", "SecAggServer"),
    ("secagg server: unmask (reconstruct, remove masks)", "distmoe.privacy.secagg.server_unmask", "finish",
     "ServerUnmasking"),
    ("sum bound check (aggregate_problem)", "distmoe.privacy.releases.update", "aggregate_problem"),
    ("plaintext norm screen (divergent_updates)", "distmoe.coordinator.aggregator", "divergent_updates"),
    ("plaintext FedAvg (weighted_average)", "distmoe.coordinator.aggregator", "weighted_average"),
    ("sft aggregate (the model update)", "distmoe.coordinator.phases.sft", "aggregate", "Sft"),
    ("sft configure (the instruction)", "distmoe.coordinator.phases.sft", "configure", "Sft"),
    ("carried probe's replies (combine, record)", "distmoe.coordinator.phases.probe", "apply_carried"),
]
_ACC: dict[tuple[str, str], list[float]] = {}  # (side, label) -> [thread seconds, calls]
_SIDE = {"party": 0}
_ON = {"on": False}


def _wrap(label: str, fn):
    import functools

    is_serve = label == TIMED[0][0]

    @functools.wraps(fn)
    def timed(*a, **k):
        if not _ON["on"]:
            return fn(*a, **k)
        if is_serve:
            _SIDE["party"] += 1
        side = "party" if _SIDE["party"] else "coordinator"
        t0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            acc = _ACC.setdefault((side, label), [0.0, 0])
            acc[0] += time.thread_time() - t0
            acc[1] += 1
            if is_serve:
                _SIDE["party"] -= 1
    return timed


def install_timers() -> None:
    import importlib

    real_fsync = os.fsync

    def fsync(fd):  # counted per side: an fsync costs wall time (the disk), not CPU
        if _ON["on"]:
            acc = _ACC.setdefault(("party" if _SIDE["party"] else "coordinator", "os.fsync (wall ms, count)"), [0.0, 0])
            t0 = time.perf_counter()
            try:
                return real_fsync(fd)
            finally:
                acc[0] += time.perf_counter() - t0
                acc[1] += 1
        return real_fsync(fd)

    os.fsync = fsync

    for label, mod, attr, *cls in TIMED:
        owner = importlib.import_module(mod)
        if cls:
            owner = getattr(owner, cls[0])
        setattr(owner, attr, _wrap(label, getattr(owner, attr)))


def lay_out(out: Path, mode: str, rounds: int, steps: int):
    overrides = {"schedule.phases": "sft:lookup", "schedule.sft-rounds": rounds, "train.local-steps": steps}
    if mode == "plaintext":
        overrides["privacy.mode"] = "plaintext"
    cfg = parse_run_config(overrides)
    run_dir = out / f"run-{mode}-{uuid.uuid4().hex[:6]}"
    data = write_synthetic(run_dir / "work" / "data", 3, cfg.data.synth_examples, cfg.run.seed, canaries=1,
                           tasks=synth_tasks(cfg.schedule.tasks))
    nodes = {}
    for i, d in enumerate(data):
        nodes[100 + i] = parse_node_config({"data-path": str(d), "party-name": d.name, "base-cache": "off",
                                            "work-dir": str(run_dir / "work" / d.name / "w")}, cfg.sim)
    return cfg, nodes, run_dir, data


def profile_distmoe(out: Path, mode: str, rounds: int, steps: int, cprofile: bool):
    cfg, nodes, run_dir, data = lay_out(out, mode, rounds, steps)
    steady = set(range(2, rounds))  # rounds 2..R-1
    prof = cProfile.Profile(time.thread_time)
    per_round: dict[int, tuple[float, float]] = {}
    orig = _loop.Coordinator.play_round

    state = {"on": None, "t0": 0.0, "p0": 0.0}

    def close() -> None:  # the round being profiled ends where the next round starts (or the run ends)
        if state["on"] is not None:
            if cprofile:
                prof.disable()
            per_round[state["on"]] = (time.thread_time() - state["t0"], time.process_time() - state["p0"])
            state["on"] = None
            _ON["on"] = False

    def play_round(self, index, phase):
        close()
        rnd = self.ctx.s.round  # set by the schedule loop before it plays the round
        if rnd in steady:
            state.update(on=rnd, t0=time.thread_time(), p0=time.process_time())
            _ON["on"] = True
            if cprofile:
                prof.enable()
        return orig(self, index, phase)

    _loop.Coordinator.play_round = play_round
    try:
        transport = LocalTransport(cfg, nodes, "prof")
        Coordinator(cfg, run_dir, transport, f"prof-{mode}", log=lambda s: None).run()
        close()
    finally:
        _loop.Coordinator.play_round = orig
    return prof, per_round, cfg, data


def profile_peer(cfg, data, rounds: int, steps: int) -> dict[int, tuple[float, float, float]]:
    """The peer's ClientApp ``train`` handler for each party, and FedAvg's aggregation, timed per round."""
    from flwr.app import ArrayRecord, MetricRecord, RecordDict
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    from distmoe.data.party import load_party
    from distmoe.data.template import batch_iterator, collate, encode_fitting
    from distmoe.model.build import build_model

    torch.manual_seed(0)
    model, tok = build_model(cfg.model)
    glob = ArrayRecord({k: v.detach().clone() for k, v in model.state_dict().items()})
    enc = [encode_fitting(tok, load_party(d, cfg.data).train("lookup"), cfg.model.max_seq_len)[1] for d in data]
    out = {}
    for rnd in range(1, rounds + 1):
        t0, p0, tr = time.thread_time(), time.process_time(), 0.0
        replies = []
        for pid, encoded in enumerate(enc):
            model.load_state_dict(glob.to_torch_state_dict())
            seed = 1000 * rnd + pid
            torch.manual_seed(seed)
            model.train()
            t1 = time.thread_time()
            opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=0.0, fused=True)
            for raw in batch_iterator(encoded, cfg.train.batch_size, steps, seed):
                batch = collate(raw, tok.pad_token_id)  # [B, T]
                opt.zero_grad(set_to_none=True)
                loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             labels=batch["labels"], use_cache=False).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
                opt.step()
            model.eval()
            tr += time.thread_time() - t1
            replies.append(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                       "metrics": MetricRecord({"num-examples": len(encoded)})}))
        glob = aggregate_arrayrecords(replies, "num-examples")
        out[rnd] = (time.thread_time() - t0, time.process_time() - p0, tr)
    return out


def ledger_stages(run_dir: Path) -> None:
    """Per round of a real run (``distmoe simulate``), the wall-clock path from the ledgers' timestamps: each message
    stage from the coordinator's first instruction to its last reply logged; inside it, the slowest party's time
    from the coordinator's send to the party's own ``in`` entry (transport, queueing, decode and hash), the party's
    work (``in`` to ``out``) and from its ``out`` to the coordinator's ``in`` (transport, the pull); and the
    coordinator's own time between stages (reply checks, unmasking, aggregation, checkpoint, the next
    instruction), when no party works."""
    import json as _json

    def read(path: Path) -> list[dict]:
        return [_json.loads(x) for x in path.read_text().splitlines() if x.strip()]

    coord = read(run_dir / "ledger" / "coordinator.jsonl")
    parties = {p.stem: read(p) for p in sorted(run_dir.glob("work/*/**/ledger/*.jsonl"))}
    rounds = sorted({e["round"] for e in coord if isinstance(e.get("round"), int) and e["round"] >= 1})
    print(f"{run_dir}: stage = first instruction out -> last reply in at the coordinator; 'to party' / 'work' / "
          "'back' = the slowest party's share; 'coord' = coordinator time before the stage's first instruction")
    prev_end = None
    for r in rounds:
        es = [e for e in coord if e.get("round") == r]
        stages: list[tuple[str, list[dict], list[dict]]] = []
        for e in es:
            if e["direction"] == "out" and e["payload_type"] not in ("run-end",):
                if not stages or stages[-1][2]:
                    stages.append((e["payload_type"], [], []))
                stages[-1][1].append(e)
            elif e["direction"] == "in" and stages and not e["payload_type"].startswith("release:"):
                stages[-1][2].append(e)
        release = next((e["time"] for e in es if e["payload_type"].startswith("release:")), None)
        parts = []
        for name, outs, ins in stages:
            t_out, t_in = outs[0]["time"], (ins[-1]["time"] if ins else outs[-1]["time"])
            gap = t_out - prev_end if prev_end is not None else float("nan")
            worst = (0.0, 0.0, 0.0)
            for pe in parties.values():
                got = [x for x in pe if x.get("round") == r and x["direction"] == "in"
                       and x["payload_type"] == name]
                sent = [x for x in pe if x.get("round") == r and x["direction"] == "out"
                        and x["seq"] > (got[0]["seq"] if got else 1 << 60)]
                if got and sent:
                    w = (got[0]["time"] - t_out, sent[0]["time"] - got[0]["time"], t_in - sent[0]["time"])
                    worst = max(worst, w, key=lambda x: x[0] + x[1])
            parts.append(f"{name} {t_in - t_out:.3f} (coord {gap:.3f}, to party {worst[0]:.3f}, work {worst[1]:.3f}"
                         f", back {worst[2]:.3f})")
            prev_end = t_in
        after = f"; release at +{release - es[0]['time']:.3f}" if release is not None else ""
        print(f"round {r}: " + " | ".join(parts) + after)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["default", "plaintext"], default="default")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=Path("runs") / "round-profile")
    ap.add_argument("--top", type=int, default=0, help="with --cprofile: the top functions by own time")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--cprofile", action="store_true",
                    help="also run cProfile (its per-call cost inflates Python-heavy functions: for finding, not "
                         "for the figures)")
    ap.add_argument("--pstats", type=Path, help="with --cprofile: dump the raw profile here")
    ap.add_argument("--ledger", type=Path, metavar="RUN_DIR",
                    help="only print the wall-clock stage path of a real run's ledgers (distmoe simulate's run dir)")
    args = ap.parse_args()
    if args.ledger is not None:
        ledger_stages(args.ledger)
        return
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    install_timers()
    prof, per_round, cfg, data = profile_distmoe(args.out.resolve(), args.mode, args.rounds, args.steps,
                                                 args.cprofile)
    n = len(per_round)
    d_thr = sum(t for t, _ in per_round.values()) / n
    d_proc = sum(p for _, p in per_round.values()) / n
    peer = {} if args.no_peer else profile_peer(cfg, data, args.rounds, args.steps)
    steady_peer = [peer[r] for r in range(2, args.rounds)] if peer else []
    mean = lambda i: sum(x[i] for x in steady_peer) / len(steady_peer) if steady_peer else float("nan")  # noqa: E731
    p_thr, p_proc, p_train = mean(0), mean(1), mean(2)
    load1 = os.getloadavg()[0]
    print(f"mode {args.mode}, {args.steps} steps, steady rounds {sorted(per_round)}, 1-min load {load0:.1f} -> "
          f"{load1:.1f} on {os.cpu_count()} CPUs")
    print(f"CPU s per round: distmoe thread {d_thr:.3f} process {d_proc:.3f} | peer thread {p_thr:.3f} (its "
          f"training loop {p_train:.3f}) process {p_proc:.3f} | difference thread {d_thr - p_thr:+.3f}")
    print("\ncomponents: thread CPU ms per steady round (all 3 parties together; inclusive), calls per round")
    comps = {}
    for side in ("party", "coordinator"):
        for label, *_ in [*TIMED, ("os.fsync (wall ms, count)",)]:
            if (side, label) in _ACC:
                sec, calls = _ACC[(side, label)]
                comps[f"{side}: {label}"] = 1000 * sec / n
                print(f"  {side:11s} {label:52s} {1000 * sec / n:9.1f}  {calls / n:.0f}")
    serve = _ACC.get(("party", TIMED[0][0]), [0.0])[0] / n
    train = _ACC.get(("party", "train_sft (the optimizer steps)"), [0.0])[0] / n
    print(f"  party work outside train_sft: {1000 * (serve - train):.1f} ms; everything else in the round (the "
          f"coordinator, transport): {1000 * (d_thr - serve):.1f} ms; peer outside its training loop: "
          f"{1000 * (p_thr - p_train):.1f} ms")
    if args.cprofile:
        if args.pstats:
            prof.dump_stats(str(args.pstats))
        st = pstats.Stats(prof)
        items = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:args.top]  # type: ignore[attr-defined]
        for (file, line, fn), (_, nc, tt, ct, _) in items:
            print(f"  {1000 * tt / n:8.1f} own {1000 * ct / n:8.1f} cum  {nc // n:6d}x  "
                  f"{'/'.join(Path(file).parts[-2:])}:{line} {fn}")
    if args.json:
        args.json.write_text(json.dumps({"mode": args.mode, "steps": args.steps, "load": [load0, load1],
                                         "distmoe": {"thread": d_thr, "process": d_proc},
                                         "peer": {"thread": p_thr, "process": p_proc, "train": p_train},
                                         "components_ms": comps, "rounds": sorted(per_round)}, indent=1))


if __name__ == "__main__":
    main()
