"""The coordinator's round loop, independent of Flower: read it top to bottom.

``Coordinator.run`` writes the run record (``run.json``, ``config.toml``, ``metrics.jsonl``), builds the
server's model once (``distmoe.model.adapters.server_model``: its trainable tensors and router shape; in
``lora`` mode only the adapters, never the base), restores a checkpoint when resuming
(``distmoe.coordinator.resume``), waits for ``federation.min-available`` parties, starts the privacy
plane (``distmoe.coordinator.plane``: signed ledger, allow-list, server guard, secure-aggregation
setup, the aggregator), then runs every round of ``schedule.phases`` through its phase module
(``distmoe.coordinator.phases``) and ends every completed round with a checkpoint holding the global
model and the coordinator state (``distmoe.coordinator.state``). Parties that fail (error replies,
malformed payloads, timeouts) are logged and left out of the round; a round without a usable sum leaves
the model unchanged and, with ``federation.on-round-failure = "stop"``, ends the run.

The ServerApp supplies a transport over Flower's ``Grid`` (``server/app.py``); tests and benchmarks use
the in-process one (``distmoe.inprocess``). Layout and protocol: ``docs/architecture.md``.

Must not: import ``flwr``, build Flower records, or read party data.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

from distmoe.checkpoint import save_checkpoint
from distmoe.config import RunConfig, to_toml
from distmoe.coordinator import plane, resume, start
from distmoe.coordinator.aggregator import Aggregator
from distmoe.coordinator.errors import PrivacyStop, RunFailed
from distmoe.coordinator.phases import probe, run_round
from distmoe.coordinator.record import RunRecord, flag_anomalies
from distmoe.coordinator.secagg import SecureRounds
from distmoe.coordinator.state import RoundState, pinned, to_checkpoint
from distmoe.coordinator.transport import Transport
from distmoe.io import write_text_atomic
from distmoe.ledger import Ledger
from distmoe.model.adapters import ServerModel, server_model
from distmoe.model.build import ModelError, hash_tensors
from distmoe.model.expand import check_expandable
from distmoe.privacy.plan import plan_privacy
from distmoe.report.metrics_log import MetricsLog
from distmoe.report.progress import fit
from distmoe.routing.health import RoutingWatch
from distmoe.wire.errors import ALL_REASONS, reason_name
from distmoe.wire.server_guard import ServerGuard

PLAINTEXT_WARNING = ("privacy.mode = plaintext: model updates, router statistics and metrics travel to the "
                     "server as plain (un-noised, un-masked) arrays and are summed there; a benchmark baseline "
                     "only: do not use this run on data that must stay private from the coordinator (the audit "
                     "fails it)")


class Coordinator:
    def __init__(self, cfg: RunConfig, run_dir: Path, transport: Transport, run_id: str,
                 log: Callable[[str], None] = print):
        """``run_id``: this process's run id (Flower's). On resume (``cfg.run.resume``) the coordinator
        keeps the interrupted run's id as the logical run id (``self.run_id``: the ledger, the parties'
        accountants) and records ``run_id`` as this session's."""
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.transport = transport
        self.run_id = str(run_id)
        self.session_id = str(run_id)
        self.log = log
        self.resuming = bool(cfg.run.resume)
        self.epoch = 0  # secure-aggregation setup epoch: the number of resumes so far
        self.resume_warnings: list[str] = []
        self.resumed_from: dict | None = None  # checkpoint, round and hash a resume continued from
        self.ckpt_round = -1  # the round of the last checkpoint written by this process
        self.phase_end = False  # the round being played is its phase's last (always checkpointed: checkpoint_due)
        self.phase_label = ""  # the label of the phase of the round being played
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self.record = RunRecord(self.run_dir / "run.json")
        self.s = RoundState()
        self.plan = plan_privacy(cfg.privacy, cfg.schedule)
        # set once the model is built (run) and the privacy plane started (plane.start)
        self.model: ServerModel | None = None  # what trains (lora: the adapters only, no base)
        self.tspec = None  # distmoe.model.trainable.TrainableSpec
        self.mspec = None  # distmoe.model.build.ModelSpec
        self.ledger: Ledger | None = None
        self.guard: ServerGuard | None = None
        self.secure: SecureRounds | None = None
        self.aggregator: Aggregator | None = None
        self._end_lock = threading.Lock()
        self._ended: str | None = None  # how the run ended ("completed", "failed", or the stop signal's text)
        # the routing probe (distmoe.coordinator.phases.probe): its prompts, the last probe's top-1, the health watch
        self.probe_prompts: tuple[str, ...] = ()
        self.probe_prev_top1: np.ndarray | None = None
        self.probe_warned: set[str] = set()
        self.settle_warned: set[str] = set()  # parties named once for an unusable or disagreeing bias settle
        self.routing_watch = RoutingWatch(cfg.routing.load_cv_warn, cfg.routing.kl_rise_rounds,
                                          str(cfg.routing.balance))

    # ------------------------------------------------------------------ the run, top to bottom
    def run(self) -> dict:
        if self.resuming:
            resume.begin(self)
        else:
            self._start_record()
        status = "completed"
        try:
            self._build_model()
            if not (self.resuming and resume.restore(self)):
                start.apply_start(self)  # run.init-from / model.warmup-steps (a new run only)
                self.checkpoint()
            self.start_plane(self._wait_for_parties())
            self._run_schedule()
        except BaseException as exc:  # Ctrl-C closes the ledger as "interrupted" (the audit judges what it holds)
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            with self._end_lock:
                if self._ended is not None:  # a stop signal closed the run already (``interrupt``)
                    raise
                self._ended = status
                self.record.update(status=status, finished=time.time(), error=f"{type(exc).__name__}: {exc}")
                self.metrics.append({"event": "run_end", "status": status, "error": str(exc)})
                plane.close(self, status)
            self.say(f"run {status.upper()}: {type(exc).__name__}: {exc}")
            if not isinstance(exc, (RunFailed, PrivacyStop)):
                self.log(traceback.format_exc())
            raise
        with self._end_lock:
            if self._ended is not None:
                return self.record.data
            self._ended = "completed"
            plane.close(self, "completed")
            self.record.update(status="completed", finished=time.time())
            self.metrics.append({"event": "run_end", "status": "completed", "rounds": self.s.round})
        self.say(f"run completed: {self.s.round} rounds, results in {self.run_dir}")
        return self.record.data

    def interrupt(self, why: str = "stopped by a signal") -> None:
        """A stop signal reached this process while the run goes on, possibly in another thread (Flower's
        Simulation Engine runs the ServerApp in a worker thread, where no signal arrives): record the run as
        interrupted and close the ledger with ``run-end`` (status ``interrupted``) once, sealed, so the run's
        own thread cannot write after it. ``--resume`` continues it (``docs/operations.md``)."""
        with self._end_lock:
            if self._ended is not None:
                return
            self._ended = why
            try:  # an exit handler: never raise
                self.record.update(status="interrupted", finished=time.time(), error=why)
                self.metrics.append({"event": "run_end", "status": "interrupted", "error": why})
            except Exception as exc:
                self.say(f"could not record the stop: {exc}")
            plane.close(self, "interrupted", seal=why)
        self.say(f"run INTERRUPTED: {why}; the ledger is closed, `--resume` continues the run")

    def _run_schedule(self) -> None:
        total = self.cfg.schedule.total_rounds
        rnd = 0
        for index, phase in enumerate(self.cfg.schedule.phases):
            for _ in range(phase.rounds):
                rnd += 1
                if rnd <= self.s.round:  # completed before the restart
                    continue
                self.s.round = rnd
                self.phase_label = phase.label()
                t0 = time.perf_counter()
                self.phase_end = rnd == total or self.s.round == sum(p.rounds for p in
                                                                     self.cfg.schedule.phases[:index + 1])
                text = self.play_round(index, phase)
                if self.ckpt_round != self.s.round and self.checkpoint_due(phase.kind):
                    self.checkpoint()  # a resume point (checkpoint.every; the due rounds: checkpoint_due)
                text += probe.after_round(self)  # the round's global model on the public probe set
                for line in fit([f"round {rnd}/{total} ({time.perf_counter() - t0:.1f} s)", phase.label(),
                                 *text.split(" | ")]):  # lines of <= 100 columns
                    self.say(line)

    def start_plane(self, nodes: list[int]) -> None:
        """Ledger, allow-list, guard, secure setup, aggregator (``distmoe.coordinator.plane``)."""
        plane.start(self, nodes)

    def play_round(self, index: int, phase) -> str:
        """One round of the ``index``-th phase; returns its progress line."""
        return run_round(self, index, phase)

    # ------------------------------------------------------------------ steps of run()
    def _start_record(self) -> None:
        cfg, p = self.cfg, self.cfg.privacy
        schedule = [ph.label() + (f"*{ph.rounds}" if ph.rounds > 1 else "") for ph in cfg.schedule.phases]
        warn = [] if p.secure else [PLAINTEXT_WARNING]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.run_dir / "config.toml", to_toml(cfg.as_flat()))
        updates = ("secure-sum + client-level DP" if p.update_noise_multiplier else "secure-sum") if p.secure \
            else "plaintext"
        self.record.update(run_id=self.run_id, name=cfg.run.name, status="running", started=time.time(),
                           finished=None, error=None, config=cfg.as_flat(), schedule=schedule, warnings=warn,
                           privacy={"mode": p.mode, "secure_aggregation": p.secure,
                                    "router_stats": "secure-sum + distributed Skellam DP" if p.secure
                                    else "plaintext-sum", "model_updates": updates,
                                    "plan": self.plan.as_dict(), "epsilon_budget": p.epsilon, "delta": p.delta},
                           parties={})
        for w in warn:
            self.say(f"WARNING: {w}")
        if p.secure:
            self.say(f"privacy: secure aggregation on every reply; router statistics with distributed DP at "
                     f"z = {self.plan.noise_multiplier:.3f}{' (derived)' if self.plan.derived else ''} over "
                     f"{self.plan.stats_releases} release(s), evaluations at z_m = "
                     f"{self.plan.metric_noise_multiplier:g} over {self.plan.eval_releases}: planned epsilon "
                     f"{self.plan.planned_epsilon:.3f} <= "
                     f"{p.epsilon:g} at delta {p.delta:g} per party")
        self.metrics.append({"event": "run_start", "run_id": self.run_id, "schedule": schedule, "warnings": warn})

    def _build_model(self) -> None:
        cfg = self.cfg
        self.probe_prompts = probe.prompts_for(cfg)  # a bad routing.probe-path fails here, before any round
        self.model = server_model(cfg.model)
        if cfg.retention.expand_experts:  # refuse an unsupported family now, not at the task boundary
            try:
                check_expandable(self.model.module)
            except ModelError as exc:
                raise RunFailed(str(exc)) from None
        self.tspec, self.mspec = self.model.tspec, self.model.mspec
        self.s.weights = dict(self.model.weights)
        n_params = self.model.n_params
        self.record.update(model={"family": self.mspec.family, "parameters": n_params,
                                  "trainable": cfg.model.trainable, "trainable_numel": self.tspec.numel,
                                  "server_holds": "base and trainable" if self.model.holds_base else "adapters",
                                  "router_spec": self.mspec.router_spec()})
        self.say(f"model {self.mspec.family}: {n_params / 1e6:.2f}M parameters, {self.tspec.numel / 1e6:.2f}M "
                 f"trainable ({cfg.model.trainable}); {len(self.mspec.moe_layers)} MoE layers x "
                 f"{self.mspec.num_experts} experts, top-{self.mspec.top_k}"
                 + ("" if self.model.holds_base else "; the server holds the adapters only"))

    def _wait_for_parties(self) -> list[int]:
        need, wait = self.cfg.federation.min_available, self.cfg.federation.wait_timeout
        deadline = time.monotonic() + wait
        while True:
            nodes = self.transport.node_ids()
            if len(nodes) >= need:
                self.say(f"{len(nodes)} parties connected")
                return nodes
            if time.monotonic() > deadline:
                raise RunFailed(f"only {len(nodes)} of federation.min-available = {need} parties connected within "
                                f"federation.wait-timeout = {wait} s")
            time.sleep(1.0)

    # ------------------------------------------------------------------ services for phases and aggregators
    def say(self, text: str) -> None:
        self.log(f"distmoe | {text}")

    def warn(self, text: str) -> None:
        """A resume warning: printed, and kept in ``run.json`` ``warnings`` and the ``run-resume`` entry."""
        self.say(f"WARNING: {text}")
        self.resume_warnings.append(text)
        self.record.append("warnings", text)

    def nodes(self) -> list[int]:
        """The connected nodes, at least ``federation.min-available`` of them (else ``RunFailed``)."""
        nodes = self.transport.node_ids()
        if len(nodes) < self.cfg.federation.min_available:
            raise RunFailed(f"{len(nodes)} parties connected, federation.min-available = "
                            f"{self.cfg.federation.min_available}")
        return nodes

    @staticmethod
    def np_weights(w: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        return {k: v.numpy() for k, v in w.items()}

    def event(self, name: str, index: int, phase, **extra) -> dict:
        """The common fields of a round's ``metrics.jsonl`` lines."""
        return {"event": name, "round": self.s.round, "phase": index, "phase_label": phase.label(),
                "task": phase.task, **extra}

    def report_errors(self, phase: str, errors: dict[int, str]) -> None:
        """Print and record why each party was left out. ``metrics.jsonl`` gets the reason's name and fixed
        text from the closed table (``distmoe.wire.errors.ALL_REASONS``) only; the coordinator's own detail
        of a server-side reason (a timeout, what its guard rejected) is printed, never recorded."""
        for node, reason in errors.items():
            who = self.guard.peer(node) if self.guard is not None else f"node {node}"
            name = reason_name(reason)
            text = ALL_REASONS[name]
            own = "" if str(reason) == text else f" ({reason})"
            self.say(f"round {self.s.round}: party {who} left out of {phase}: [{name}] {text.split(': ', 1)[1]}{own}")
            self.metrics.append({"event": "party_error", "round": self.s.round, "phase_label": phase,
                                 "node": str(node), "party": who, "code": name, "reason": text})

    def round_failed(self, message: str, failed: bool = True) -> str:
        """A round that released nothing (or whose release was not used): a warning in ``run.json``
        (``warnings``) and ``metrics.jsonl`` (``event: round_skipped``), which the report lists; then go on
        (``federation.on-round-failure = skip``, or ``failed`` False) or stop the run."""
        label = self.phase_label
        text = f"round {self.s.round} ({label}) released nothing: {message}"
        self.say(f"WARNING: {text}")
        self.record.append("warnings", text)
        self.metrics.append({"event": "round_skipped", "round": self.s.round, "phase_label": label,
                             "detail": text})
        if failed and self.cfg.federation.on_round_failure == "stop":
            raise RunFailed(f"round {self.s.round}: {message} (federation.on-round-failure = 'stop')")
        return message

    def flag_anomalies(self, event: str, agg: Mapping[str, float]) -> list[str]:
        """Anomalies of an aggregate (``distmoe.coordinator.record``), recorded in ``run.json``
        (``anomalies``) and ``metrics.jsonl`` (``event: anomaly``); the report lists them."""
        if self.cfg.privacy.secure:
            return []  # secure aggregation: only the training-metric slots' means, not judged here (docs/operations.md)
        found = flag_anomalies(self.s.anomaly_history, event, agg, self.cfg.federation.anomaly_z)
        for text in found:
            self.say(f"round {self.s.round}: ANOMALY: {text}")
            self.metrics.append({"event": "anomaly", "round": self.s.round, "kind": event, "party": "all",
                                 "detail": text})
            self.record.append("anomalies", {"round": self.s.round, "detail": text})
        return found

    def checkpoint_due(self, kind: str) -> bool:
        """Whether round ``s.round`` (of a phase of ``kind``) ends with a checkpoint: the initial model, the last round
        of each phase (the model before a task: rollback and retention pin it; and the run's last round), every round
        whose release is DP-charged (a repeat after a crash would be charged again) and every ``checkpoint.every``-th
        round. A round skipped here that a crash loses is repeated from the last checkpoint with the same seeds."""
        every, rnd = self.cfg.checkpoint.every, self.s.round
        charged = kind not in ("sft", "rl", "dpo") or self.cfg.privacy.update_noise_multiplier > 0
        return every <= 1 or rnd == 0 or self.phase_end or charged or rnd % every == 0

    def checkpoint(self) -> None:
        """The model and the coordinator state at the end of round ``s.round`` (the resume point)."""
        s, model = self.s, self.model
        state, tensors = to_checkpoint(s, self.cfg.schedule.phases, run_id=self.run_id, session=self.session_id,
                                       epoch=self.epoch)
        save_checkpoint(self.run_dir / "checkpoints", s.round, s.weights, hash_tensors(s.weights),
                        write_model=lambda d: model.save(d, s.weights),
                        meta={"run_id": self.run_id, "anchor_version": s.anchor_versions, **model.manifest_meta(),
                              **pinned(self.cfg.schedule.phases, s.round, s.current_task)},
                        keep=self.cfg.checkpoint.keep, state=state, tensors=tensors)
        self.ckpt_round = s.round
