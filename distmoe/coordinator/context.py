"""What a phase, an aggregator and the run's setup steps may see of a run: the ``RunContext``.

Owns: the run's config, directory and ids, the round state (``distmoe.coordinator.state.RoundState``), the
server's model (``ServerModel``: trainable weights' spec ``tspec``, routing shape ``mspec``), the run's record
(``run.json``) and metrics log (``metrics.jsonl``), and the services every step of a round uses to record what
happened (``say``, ``warn``, ``event``, ``report_errors``, ``round_failed``, ``flag_anomalies``, ``checkpoint``).

Holds no transport, no aggregator and no ledger: a phase that is handed a ``RunContext`` can configure an
instruction and fold a sum into a new round state, but cannot talk to a party. The round loop
(``distmoe.coordinator.loop.Coordinator``) owns the exchange and builds this context once per run; ``plane``,
``resume``, ``start`` and ``expand`` read it and return values the loop applies.

Must not: import ``flwr``, the loop, the phases or the privacy plane (they import this module).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

from distmoe.checkpoint import save_checkpoint
from distmoe.config import UPDATE_KINDS, RunConfig
from distmoe.coordinator.errors import RunFailed
from distmoe.coordinator.record import RunRecord, flag_anomalies
from distmoe.coordinator.state import RoundState, pinned, to_checkpoint
from distmoe.model.adapters import ServerModel
from distmoe.model.build import hash_tensors
from distmoe.privacy.plan import PrivacyPlan, plan_privacy
from distmoe.report.progress import wrap
from distmoe.routing.health import RoutingWatch
from distmoe.rundir import MetricsLog, RunDir
from distmoe.wire.errors import ALL_REASONS, reason_name


class RunContext:
    """One run's shared state and recording services (module docstring)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, run_id: str, log: Callable[[str], None] = print):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_id = str(run_id)  # the logical run id (a resumed run keeps the interrupted run's)
        self.session_id = str(run_id)  # this process's run id (Flower's)
        self.log = log
        self.epoch = 0  # secure-aggregation setup epoch: the number of resumes so far
        self.resume_warnings: list[str] = []
        self.resumed_from: dict | None = None  # checkpoint, round and hash a resume continued from
        self.ckpt_round = -1  # the round of the last checkpoint written by this process
        self.phase_label = ""  # the label of the phase of the round being played
        self.phase_end = False  # the round being played is its phase's last (always checkpointed: checkpoint_due)
        self.files = RunDir(self.run_dir)  # every path of the run directory
        self.metrics = MetricsLog(self.files.metrics)
        self.record = RunRecord(self.files.record)
        self.s = RoundState()
        self.plan: PrivacyPlan = plan_privacy(cfg.privacy, cfg.schedule)
        self.model: ServerModel | None = None  # what trains (lora: the adapters only, no base); set once built
        self.peer: Callable[[int], str] = lambda node: f"node {node}"  # the party name of a node (the guard's)
        # the routing probe (distmoe.coordinator.phases.probe): its prompts, the last probe's top-1, the health watch
        self.probe_prompts: tuple[str, ...] = ()
        self.probe_prev_top1: np.ndarray | None = None
        self.probe_anchor_version = 0  # the anchor version the last probe row was measured against
        # what the last probe measured (base, weights hash) and its median: (key, routing, top1, parties, disagreeing)
        self.probe_last: tuple[str, np.ndarray, np.ndarray, int, int] | None = None
        self.probe_warned: set[str] = set()
        self.probe_pending = None  # phases/probe.Measured: a due probe the next round's instruction carries
        self.probe_key_memo: tuple[dict, str, str] | None = None  # (weights dict, base hash, key): phases/probe
        self.settle_warned: set[str] = set()  # parties named once for an unusable or disagreeing bias settle
        self.routing_watch = RoutingWatch(cfg.routing.load_cv_warn, cfg.routing.kl_rise_rounds,
                                          str(cfg.routing.balance))

    @property
    def tspec(self):
        """The trainable tensors' spec (``distmoe.model.trainable.TrainableSpec``) of the model now."""
        return self.model.tspec if self.model is not None else None

    @property
    def mspec(self):
        """The routing shape (``distmoe.model.build.ModelSpec``) of the model now."""
        return self.model.mspec if self.model is not None else None

    # ------------------------------------------------------------------ recording
    def say(self, text: str, wrapped: bool = False) -> None:
        """One line of the progress stream. ``wrapped``: a long text without a path or command to copy (a warning,
        the privacy header) in lines of at most 100 columns as the terminal shows them
        (``distmoe.report.progress.wrap``); a round line is already packed (``fit``)."""
        for line in wrap(text) if wrapped else [text]:
            self.log(f"distmoe | {line}")

    def warn(self, text: str) -> None:
        """A resume warning: printed, and kept in ``run.json`` ``warnings`` and the ``run-resume`` entry."""
        self.say(f"WARNING: {text}", wrapped=True)
        self.resume_warnings.append(text)
        self.record.append("warnings", text)

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
            who = self.peer(node)
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
        self.say(f"WARNING: {text}", wrapped=True)
        self.record.append("warnings", text)
        self.metrics.append({"event": "round_skipped", "round": self.s.round, "phase_label": label,
                             "detail": text})
        if failed and self.cfg.federation.on_round_failure == "stop":
            raise RunFailed(f"round {self.s.round}: {message} (federation.on-round-failure = 'stop')")
        return message

    def flag_anomalies(self, event: str, agg: Mapping[str, float]) -> tuple[list[str], dict[str, list[float]]]:
        """Anomalies of an aggregate (``distmoe.coordinator.record``), recorded in ``run.json``
        (``anomalies``) and ``metrics.jsonl`` (``event: anomaly``); the report lists them. Returns them and the
        anomaly history with this aggregate's values (a new dict, for the new round state)."""
        history = {k: list(v) for k, v in self.s.anomaly_history.items()}
        if self.cfg.privacy.secure:  # only the training-metric slots' means, not judged here (docs/operations.md)
            return [], history
        found = flag_anomalies(history, event, agg, self.cfg.federation.anomaly_z)
        for text in found:
            self.say(f"round {self.s.round}: ANOMALY: {text}")
            self.metrics.append({"event": "anomaly", "round": self.s.round, "kind": event, "party": "all",
                                 "detail": text})
            self.record.append("anomalies", {"round": self.s.round, "detail": text})
        return found, history

    def checkpoint_due(self, kind: str) -> bool:
        """Whether round ``s.round`` (of a phase of ``kind``) ends with a checkpoint: the initial model, the last round
        of each phase (the model before a task: rollback and retention pin it; and the run's last round), every round
        whose release is DP-charged (a repeat after a crash would be charged again) and every ``checkpoint.every``-th
        round. A round skipped here that a crash loses is repeated from the last checkpoint with the same seeds."""
        every, rnd = self.cfg.checkpoint.every, self.s.round
        charged = kind not in UPDATE_KINDS or self.cfg.privacy.update_noise_multiplier > 0
        return every <= 1 or rnd == 0 or self.phase_end or charged or rnd % every == 0

    def checkpoint(self) -> None:
        """The model and the coordinator state at the end of round ``s.round`` (the resume point)."""
        s, model = self.s, self.model
        state, tensors = to_checkpoint(s, self.cfg.schedule.phases, run_id=self.run_id, session=self.session_id,
                                       epoch=self.epoch)
        save_checkpoint(self.files.checkpoints, s.round, s.weights, hash_tensors(s.weights),
                        write_model=lambda d: model.save(d, s.weights),
                        meta={"run_id": self.run_id, "anchor_version": s.anchor_versions, **model.manifest_meta(),
                              **pinned(self.cfg.schedule.phases, s.round, s.current_task)},
                        keep=self.cfg.checkpoint.keep, state=state, tensors=tensors)
        self.ckpt_round = s.round
