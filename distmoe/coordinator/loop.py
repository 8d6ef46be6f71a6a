"""The coordinator's round loop, independent of Flower: read it top to bottom.

``Coordinator.run`` writes the run record (``run.json``, ``config.toml``, ``metrics.jsonl``), builds the
server's model once (``distmoe.model.adapters.server_model``: its trainable tensors and router shape; in
``lora`` mode only the adapters, never the base), restores a checkpoint when resuming
(``distmoe.coordinator.resume``) or takes a start point (``distmoe.coordinator.start``), waits for
``federation.min-available`` parties, starts the privacy plane (``distmoe.coordinator.plane``: signed ledger,
allow-list, server guard, secure-aggregation setup, the aggregator chosen once for the run), then plays every round
of ``schedule.phases``. A round (``play_round``) is a pipeline this loop owns::

    ctx.s = step.begin(ctx, phase)                  # phases/<kind>.py: the state the round starts from
    instr = step.configure(ctx, phase)              # phases/<kind>.py: what every party is sent
    out   = aggregator.collect(instr, request)      # the round's one exchange, summed (aggregator.py / secure.py)
    ctx.s, line = step.aggregate(ctx, ..., instr, out)  # phases/<kind>.py: a new state with the sum folded in

then, after an applied update, the bias settle exchange (``phases/settle.py``) and the round's checkpoint holding
the global model and the coordinator state (``distmoe.coordinator.state``), and the routing probe of the round's
model (``phases/probe.py``): carried on the next round's instruction when that round sends the same weights
(answered beside its replies, so it costs no stage of its own), else its own exchange. Phases see a ``RunContext``
(``coordinator/context.py``), never the transport. Parties that fail (error replies, malformed payloads, timeouts)
are logged and left out of the round; a round without a usable sum leaves the model unchanged and, with
``federation.on-round-failure = "stop"``, ends the run.

The one transport type is ``distmoe.wire.server_guard.GuardedTransport``: the ServerApp's over Flower's ``Grid``
(``server/app.py``); tests and benchmarks use the in-process one (``distmoe.inprocess``). Layout and protocol:
``docs/architecture.md``.

Must not: import ``flwr``, build Flower records, or read party data.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from distmoe.config import Phase, RunConfig, to_toml
from distmoe.coordinator import plane, resume, start
from distmoe.coordinator.aggregator import Skip
from distmoe.coordinator.context import RunContext
from distmoe.coordinator.errors import PrivacyStop, RunFailed
from distmoe.coordinator.phases import PHASES, probe, settle
from distmoe.coordinator.plane import Plane
from distmoe.io import write_text_atomic
from distmoe.model.adapters import server_model
from distmoe.model.build import ModelError
from distmoe.model.expand import check_expandable
from distmoe.report.progress import fit
from distmoe.wire.server_guard import GuardedTransport

PLAINTEXT_WARNING = ("privacy.mode = plaintext: model updates, router statistics and metrics travel to the "
                     "server as plain (un-noised, un-masked) arrays and are summed there; a benchmark baseline "
                     "only: do not use this run on data that must stay private from the coordinator (the audit "
                     "fails it)")


class Coordinator:
    def __init__(self, cfg: RunConfig, run_dir: Path, transport: GuardedTransport, run_id: str,
                 log: Callable[[str], None] = print):
        """``run_id``: this process's run id (Flower's). On resume (``cfg.run.resume``) the coordinator
        keeps the interrupted run's id as the logical run id (``ctx.run_id``: the ledger, the parties'
        accountants) and records ``run_id`` as this session's."""
        self.ctx = RunContext(cfg, run_dir, run_id, log)
        self.transport = transport
        self.plane: Plane | None = None  # set by start_plane: ledger, guard, SecAgg driver, the aggregator
        self.ctx.peer = self._peer  # party names in error lines: the guard's, once the plane has one
        self._end_lock = threading.Lock()
        self._ended: str | None = None  # how the run ended ("completed", "failed", or the stop signal's text)

    # ------------------------------------------------------------------ the run, top to bottom
    def run(self) -> dict:
        ctx = self.ctx
        if ctx.cfg.run.resume:
            ctx.run_id, ctx.epoch = resume.begin(ctx)
        else:
            self._start_record()
        status = "completed"
        try:
            self._build_model()
            restored = resume.restore(ctx) if ctx.cfg.run.resume else None
            if restored is not None:
                ctx.model, ctx.s, ctx.resumed_from = restored.model, restored.state, restored.resumed_from
                ctx.ckpt_round = restored.state.round
            else:
                self._start_from()  # run.init-from / model.warmup-steps (a new run only)
                ctx.checkpoint()
            self.start_plane(self._wait_for_parties())
            self._run_schedule()
        except BaseException as exc:  # Ctrl-C closes the ledger as "interrupted" (the audit judges what it holds)
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            with self._end_lock:
                if self._ended is not None:  # a stop signal closed the run already (``interrupt``)
                    raise
                self._ended = status
                ctx.record.update(status=status, finished=time.time(), error=f"{type(exc).__name__}: {exc}")
                ctx.metrics.append({"event": "run_end", "status": status, "error": str(exc)})
                plane.close(ctx, self.plane, status)
            ctx.say(f"run {status.upper()}: {type(exc).__name__}: {exc}")
            if not isinstance(exc, (RunFailed, PrivacyStop)):
                ctx.log(traceback.format_exc())
            raise
        with self._end_lock:
            if self._ended is not None:
                return ctx.record.data
            self._ended = "completed"
            plane.close(ctx, self.plane, "completed")
            ctx.record.update(status="completed", finished=time.time())
            ctx.metrics.append({"event": "run_end", "status": "completed", "rounds": ctx.s.round})
        ctx.say(f"run completed: {ctx.s.round} rounds, results in {ctx.run_dir}")
        return ctx.record.data

    def interrupt(self, why: str = "stopped by a signal") -> None:
        """A stop signal reached this process while the run goes on, possibly in another thread (Flower's
        Simulation Engine runs the ServerApp in a worker thread, where no signal arrives): record the run as
        interrupted and close the ledger with ``run-end`` (status ``interrupted``) once, sealed, so the run's
        own thread cannot write after it. ``--resume`` continues it (``docs/operations.md``)."""
        ctx = self.ctx
        with self._end_lock:
            if self._ended is not None:
                return
            self._ended = why
            try:  # an exit handler: never raise
                ctx.record.update(status="interrupted", finished=time.time(), error=why)
                ctx.metrics.append({"event": "run_end", "status": "interrupted", "error": why})
            except Exception as exc:
                ctx.say(f"could not record the stop: {exc}")
            plane.close(ctx, self.plane, "interrupted", seal=why)
        ctx.say(f"run INTERRUPTED: {why}; the ledger is closed, `--resume` continues the run")

    def _run_schedule(self) -> None:
        ctx = self.ctx
        total = ctx.cfg.schedule.total_rounds
        rounds = [(i, ph) for i, ph in enumerate(ctx.cfg.schedule.phases) for _ in range(ph.rounds)]  # per round
        if ctx.cfg.run.resume and 0 < ctx.s.round <= total:  # the checkpointed round's probe, if it never ran
            probe.resume_pending(ctx, rounds[ctx.s.round - 1][1].label())
            if not self._keeps(rounds, ctx.s.round):  # no next round to carry it: exchanged now
                ctx.say(self._exchange_pending().removeprefix(" | "))
        for rnd, (index, phase) in enumerate(rounds, 1):
            if rnd <= ctx.s.round:  # completed before the restart
                continue
            ctx.s = replace(ctx.s, round=rnd)
            ctx.phase_label = phase.label()
            t0 = time.perf_counter()
            ctx.phase_end = rnd == total or rnd == sum(p.rounds for p in ctx.cfg.schedule.phases[:index + 1])
            text = self.play_round(index, phase)
            if ctx.ckpt_round != ctx.s.round and ctx.checkpoint_due(phase.kind):
                ctx.checkpoint()  # a resume point (checkpoint.every; the due rounds: RunContext.checkpoint_due)
            # the round's global model on the public probe set: not sent again for a model already probed, and
            # carried on the next round's instruction when that round sends these weights (phases/probe.py)
            again = probe.repeat(ctx)
            text += again if again is not None else ("" if probe.defer(ctx, self._keeps(rounds, rnd))
                                                     else self.exchange_public(probe, "probe"))
            for line in fit([f"round {rnd}/{total} ({time.perf_counter() - t0:.1f} s)", phase.label(),
                             *text.split(" | ")]):  # lines of <= 100 columns
                ctx.say(line)

    def _keeps(self, rounds: list[tuple[int, Phase]], rnd: int) -> bool:
        """Whether the round after ``rnd`` exists and sends the global weights as they are now (it can carry the
        probe of round ``rnd``: ``phases/probe.py``)."""
        nxt = rounds[rnd][1] if rnd < len(rounds) else None
        return nxt is not None and PHASES[nxt.kind].keeps_weights(self.ctx, nxt)

    def start_plane(self, nodes: list[int]) -> None:
        """Ledger, allow-list, guard, secure setup, aggregator (``distmoe.coordinator.plane``)."""
        self.plane = Plane()  # filled as each part opens: a failed setup still closes the ledger it opened
        plane.start(self.ctx, self.transport, nodes, self.plane)

    def play_round(self, index: int, phase: Phase) -> str:
        """One round of the ``index``-th phase: configure, the one exchange, aggregate; returns its progress line.
        The probe of the round before rides on the instruction when pending (``phases/probe.py``: recorded as that
        round's, before this round's sum is folded in); one the instruction cannot carry is exchanged first."""
        ctx, step = self.ctx, PHASES[phase.kind]
        ctx.s = step.begin(ctx, phase)  # a new task: the model and evaluation before it kept
        instr, bounds = probe.carry(ctx, step.configure(ctx, phase))
        before = self._exchange_pending() if bounds is None else ""  # a pending probe this instruction cannot carry
        req = replace(step.request(ctx, index, phase, instr), probe=bounds)
        out = self.plane.aggregator.collect(instr, req)  # every party asked, the replies summed
        carried = probe.apply_carried(ctx, self.plane.aggregator.probes) if bounds is not None else ""
        if isinstance(out, Skip):  # nothing released: the state stays as it is
            text = ctx.round_failed(out.text, failed=out.failed)
            if req.sum == "update":
                ctx.metrics.append({**req.event, "party": "all", "num_examples": 0, "skipped": True})
            return text + before + carried
        ctx.s, text = step.aggregate(ctx, index, phase, instr, out)  # the new round state
        if step.updates_model:
            self.exchange_public(settle, "settle")  # routing.balance-settle-steps: before the checkpoint
            if ctx.checkpoint_due(phase.kind):
                ctx.checkpoint()
        return text + before + carried

    def _peer(self, node: int) -> str:
        guard = self.plane.guard if self.plane is not None else None
        return guard.peer(node) if guard is not None else f"node {node}"

    def exchange_public(self, mod, name: str) -> str:
        """An exchange of public inputs after a round (``phases/probe.py``, ``phases/settle.py``): its
        ``instruction`` to every connected party (none when not due), its ``apply`` on the replies."""
        ctx = self.ctx
        instr = mod.instruction(ctx)
        if instr is None:
            return ""
        ctx.s, text = mod.apply(ctx, *self._to_all(instr, mod.REPLY, name))
        return text

    def _exchange_pending(self) -> str:
        """The pending probe (``phases/probe.py``) on its own exchange, recorded as its round's; "" when none."""
        instr = probe.pending_instruction(self.ctx)
        return "" if instr is None else probe.apply_pending(self.ctx, *self._to_all(instr, probe.REPLY, "probe"))

    def _to_all(self, instr, reply: type, name: str) -> tuple[dict, dict]:
        """``instr`` to every connected party: their checked replies and the reasons of the others."""
        return self.transport.exchange({n: instr for n in self.transport.node_ids()}, reply,
                                       self.ctx.cfg.federation.round_timeout, rnd=instr.round, phase=name)

    # ------------------------------------------------------------------ steps of run()
    def _start_from(self) -> None:
        """A new run's round 0 from ``run.init-from`` or the warm-up base (``coordinator/start.py``), recorded."""
        ctx = self.ctx
        sp = start.load_start(ctx.cfg, ctx.run_dir, ctx.model, ctx.say)
        if sp is None:
            return
        ctx.s = replace(ctx.s, weights=sp.weights)
        if sp.anchor is not None:
            ctx.s = replace(ctx.s, anchor=sp.anchor, anchor_versions=sp.anchor_versions)
        ctx.record.update(started_from=sp.info)
        ctx.metrics.append({"event": "start_from", **sp.info})
        ctx.say(start.start_line(sp))

    # ------------------------------------------------------------------ steps of run()
    def _start_record(self) -> None:
        ctx = self.ctx
        if ctx.files.ledger.exists():  # refused before anything is written (run.json, checkpoints, the run's key)
            raise RunFailed(f"{ctx.files.ledger} exists: {ctx.run_dir} holds a run already (a run directory is used "
                            f"by one run only; run.resume='{ctx.run_dir}' continues an interrupted one)")
        cfg, p = ctx.cfg, ctx.cfg.privacy
        schedule = [ph.label() + (f"*{ph.rounds}" if ph.rounds > 1 else "") for ph in cfg.schedule.phases]
        warn = [] if p.secure else [PLAINTEXT_WARNING]
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(ctx.files.config, to_toml(cfg.as_flat()))
        updates = ("secure-sum + client-level DP" if p.update_noise_multiplier else "secure-sum") if p.secure \
            else "plaintext"
        ctx.record.update(run_id=ctx.run_id, name=cfg.run.name, status="running", started=time.time(),
                          finished=None, error=None, config=cfg.as_flat(), schedule=schedule, warnings=warn,
                           privacy={"mode": p.mode, "secure_aggregation": p.secure,
                                    "router_stats": "secure-sum + distributed Skellam DP" if p.secure
                                    else "plaintext-sum", "model_updates": updates,
                                    "plan": ctx.plan.as_dict(), "epsilon_budget": p.epsilon, "delta": p.delta},
                           parties={})
        for w in warn:
            ctx.say(f"WARNING: {w}", wrapped=True)
        if p.secure:
            stats = (f"router statistics with distributed DP at z = {ctx.plan.noise_multiplier:.3f}"
                     f"{' (derived)' if ctx.plan.derived else ''} over {ctx.plan.stats_releases} release(s)"
                     if ctx.plan.stats_releases else "no router-statistics release")  # not 'z = 0.000 over 0'
            ctx.say(f"privacy: secure aggregation on every reply; {stats}, evaluations at z_m = "
                     f"{ctx.plan.metric_noise_multiplier:g} over {ctx.plan.eval_releases}: planned epsilon "
                     f"{ctx.plan.planned_epsilon:.3f} <= "
                     f"{p.epsilon:g} at delta {p.delta:g} per party", wrapped=True)
        ctx.metrics.append({"event": "run_start", "run_id": ctx.run_id, "schedule": schedule, "warnings": warn})

    def _build_model(self) -> None:
        ctx = self.ctx
        cfg = ctx.cfg
        ctx.probe_prompts = probe.prompts_for(cfg)  # a bad routing.probe-path fails here, before any round
        model = server_model(cfg.model)
        if cfg.retention.expand_experts:  # refuse an unsupported family now, not at the task boundary
            try:
                check_expandable(model.module)
            except ModelError as exc:
                raise RunFailed(str(exc)) from None
        ctx.model = model
        ctx.s = replace(ctx.s, weights=dict(model.weights))
        mspec, tspec, n_params = model.mspec, model.tspec, model.n_params
        ctx.record.update(model={"family": mspec.family, "parameters": n_params,
                                 "trainable": cfg.model.trainable, "trainable_numel": tspec.numel,
                                 "server_holds": "base and trainable" if model.holds_base else "adapters",
                                 "router_spec": mspec.router_spec()})
        ctx.say(f"model {mspec.family}: {n_params / 1e6:.2f}M parameters, {tspec.numel / 1e6:.2f}M "
                f"trainable ({cfg.model.trainable}); {len(mspec.moe_layers)} MoE layers x "
                f"{mspec.num_experts} experts, top-{mspec.top_k}"
                + ("" if model.holds_base else "; the server holds the adapters only"))

    def _wait_for_parties(self) -> list[int]:
        need, wait = self.ctx.cfg.federation.min_available, self.ctx.cfg.federation.wait_timeout
        deadline = time.monotonic() + wait
        while True:
            nodes = self.transport.node_ids()
            if len(nodes) >= need:
                self.ctx.say(f"{len(nodes)} parties connected")
                return nodes
            if time.monotonic() > deadline:
                raise RunFailed(f"only {len(nodes)} of federation.min-available = {need} parties connected within "
                                f"federation.wait-timeout = {wait} s")
            time.sleep(1.0)

    # ------------------------------------------------------------------ read-only views (tests, benchmarks)
    cfg = property(lambda self: self.ctx.cfg)
    run_dir = property(lambda self: self.ctx.run_dir)
    run_id = property(lambda self: self.ctx.run_id)
    s = property(lambda self: self.ctx.s)
    model = property(lambda self: self.ctx.model)
    tspec = property(lambda self: self.ctx.tspec)
    mspec = property(lambda self: self.ctx.mspec)
    plan = property(lambda self: self.ctx.plan)
    probe_prompts = property(lambda self: self.ctx.probe_prompts)
    record = property(lambda self: self.ctx.record)
    metrics = property(lambda self: self.ctx.metrics)
    secure = property(lambda self: self.plane.secure if self.plane is not None else None)
    aggregator = property(lambda self: self.plane.aggregator if self.plane is not None else None)
    guard = property(lambda self: self.plane.guard if self.plane is not None else None)

    def say(self, text: str, wrapped: bool = False) -> None:
        self.ctx.say(text, wrapped)

    @staticmethod
    def np_weights(w: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        return RunContext.np_weights(w)

