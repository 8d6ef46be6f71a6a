"""The coordinator's round schedule, independent of Flower: it runs the configured phases
(``sft``, ``rl``, ``stats``, ``eval``) against a ``Transport``, aggregates updates (weighted FedAvg),
builds and versions the router anchor, checkpoints the global model after every round that
changes it, and writes the run record (``run.json``) and ``metrics.jsonl``.

Privacy plane (``privacy.mode = "secagg"``, the default): the coordinator keeps a signed ledger
(``ledger/coordinator.jsonl``; the run's allow-list is its first entry), every exchange passes the
server guard, and every reply of every phase is a secure sum (``distmoe.privacy.rounds``): the
coordinator sees only sums over at least ``privacy.min-parties`` parties, router statistics carry
distributed Skellam noise, and each release is logged with its survivors and DP parameters for the
audit. ``"plaintext"`` is a benchmark baseline: warned about and failed by the audit.

The ServerApp supplies a transport over Flower's ``Grid`` (``server/app.py``); tests can supply an
in-process one. Party replies that fail (error replies, malformed payloads, wrong shapes, timeouts)
are logged and left out of the round; a round without any usable reply leaves the model unchanged.

Crash and resume (``docs/operations.md``, Resume): every completed round ends with a checkpoint
(``distmoe.checkpoint``) holding the global model *and* the coordinator state at that boundary
(``state.json``: round counter, hence the schedule position; current and trained tasks; the anchor
version with its probabilities and metadata; the reference weights and baseline evaluation for retention;
the last evaluation; the anomaly history). With ``run.resume = <run dir>`` a new coordinator process
refuses a completed run or a config that differs in a key outside ``RESUME_MAY_CHANGE``, takes the
newest checkpoint that verifies (a corrupted or truncated one is moved aside with a warning in
``run.json`` and the log, and the previous one is used), reopens the ledger with the run's own
coordinator key (``keys/coordinator.key``; the chain and every signature are verified on open, a torn
tail is truncated with a warning), checks that the rebuilt allow-list equals the one signed at
``run-start``, appends a ``run-resume`` entry, and runs a fresh secure-aggregation setup (epoch =
number of resumes) starting at the next round. The model and state fall back together; privacy does
not: the server accountants (``privacy/ledger.json``) and the ledger are never rolled back, so a
release of a round lost in the crash stays charged (and is charged again when that round is re-run).
Only the round in flight is lost; its ``metrics.jsonl`` lines move to ``metrics.lost.jsonl``.

Must not: import ``flwr``, build Flower records, or read party data.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from distmoe.aggregate import (
    aggregate_problem,
    divergent_updates,
    eval_sum_problem,
    stats_sum_problem,
    weighted_average,
)
from distmoe.checkpoint import CheckpointError, load_checkpoint, resumable, save_checkpoint
from distmoe.config import Phase, RunConfig, to_toml
from distmoe.model.build import build_model, describe, hash_tensors, param_count
from distmoe.model.trainable import TrainableError, apply_trainable, load_trainable, spec_of, trainable_state
from distmoe.privacy.accountant import PrivacyEvent
from distmoe.privacy.plan import plan_privacy, stats_spec
from distmoe.privacy.rounds import PrivacyStop, SecureRounds
from distmoe.privacy.vectors import EvalLayout, StatsLayout, UpdateLayout, from_ring64
from distmoe.report.metrics_log import MetricsLog, sanitize, write_json_atomic, write_text_atomic
from distmoe.routing.anchor import Anchor, AnchorVersion, build_anchor, save_anchor
from distmoe.wire.ledger import canonical_json
from distmoe.wire.schema import (
    EVAL_ROUTING_KEYS,
    TRAIN_METRIC_KEYS,
    EvalInstruction,
    EvalReply,
    ModelUpdate,
    RlInstruction,
    RouterStats,
    SftInstruction,
    StatsInstruction,
    eval_metric_keys,
    rl_metric_keys,
)

PLAINTEXT_WARNING = ("privacy.mode = plaintext: model updates, router statistics and metrics travel to the "
                     "server as plain (un-noised, un-masked) arrays and are summed there; a benchmark baseline "
                     "only: do not use this run on data that must stay private from the coordinator (the audit "
                     "fails it)")


# config keys a resumed run may change (timeouts, threads, where things are, how many checkpoints are
# kept); any other difference to the interrupted run's config is refused, naming the keys
RESUME_MAY_CHANGE = frozenset({"run.resume", "run.dir", "run.name", "federation.wait-timeout",
                               "federation.round-timeout", "federation.setup-timeout", "federation.unmask-timeout",
                               "federation.min-parties", "federation.on-round-failure", "train.threads",
                               "checkpoint.keep", "sim.nodes-dir"})
STATE_FORMAT = 1  # of the coordinator state inside each checkpoint

# aggregate metrics watched for anomalies (non-finite, or a spike beyond federation.anomaly-z)
ANOMALY_KEYS = {"train": ("loss", "loss_last"), "rl": ("k3", "logp_diff_mean")}

class Transport(Protocol):
    def node_ids(self) -> list[int]: ...

    def exchange(self, instructions: dict[int, object], expected: type, timeout: float, *, rnd: int | None = None,
                 phase: str = "", lengths: dict[int, int] | None = None
                 ) -> tuple[dict[int, object], dict[int, str]]:
        """Send one instruction per node; return (payloads by node, error reasons by node)."""
        ...

    def attach(self, guard) -> None:
        """Give the transport the server guard (``distmoe.wire.server_side.ServerGuard``)."""
        ...


class RunFailed(RuntimeError):
    """The schedule cannot continue (no parties, nothing usable)."""


def config_differences(before: Mapping[str, object], after: Mapping[str, object]) -> dict[str, tuple]:
    """Keys outside ``RESUME_MAY_CHANGE`` whose values differ: ``{key: (before, after)}``. Values are
    compared as ``run.json`` stores them (JSON, non-finite as null); a key unknown before counts as a
    difference only if the new value is not its default."""
    from distmoe.config import DEFAULTS

    out = {}
    now = json.loads(json.dumps(sanitize(dict(after))))
    for k in sorted(set(before) | set(now)):
        if k in RESUME_MAY_CHANGE:
            continue
        a = before[k] if k in before else json.loads(json.dumps(sanitize(DEFAULTS.get(k))))
        if a != now.get(k):
            out[k] = (a, now.get(k))
    return out


def check_resumable(run_dir: Path, cfg: RunConfig) -> dict:
    """The interrupted run's record if ``cfg`` may resume the run in ``run_dir``; else ``RunFailed`` naming
    why (no run record, already completed, a config key that matters changed)."""
    run_dir = Path(run_dir)
    where = Path(cfg.run.resume)
    if where.resolve() != run_dir.resolve():
        raise RunFailed(f"config key 'run.resume': value {str(where)!r} is not the run directory {run_dir} "
                        "this coordinator writes")
    path = run_dir / "run.json"
    try:
        prev = json.loads(path.read_text())
    except FileNotFoundError:
        raise RunFailed(f"config key 'run.resume': {path} does not exist: {where} is not a distmoe run "
                        "directory") from None
    except (OSError, ValueError) as exc:
        raise RunFailed(f"config key 'run.resume': {path} is unreadable ({exc})") from None
    if not isinstance(prev, dict) or not prev.get("run_id") or not isinstance(prev.get("config"), dict):
        raise RunFailed(f"config key 'run.resume': {path} is not a distmoe run record (no run_id or config)")
    if prev.get("status") == "completed":
        raise RunFailed(f"config key 'run.resume': run {prev['run_id']} in {where} already completed; there is "
                        "nothing to resume (start a new run)")
    changed = config_differences(prev["config"], cfg.as_flat())
    if changed:
        raise RunFailed("config key 'run.resume': the config differs from the interrupted run's in "
                        + "; ".join(f"{k} (was {a!r}, now {b!r})" for k, (a, b) in changed.items())
                        + f"; a resumed run may change only {', '.join(sorted(RESUME_MAY_CHANGE))}")
    _check_ledger_for_resume(run_dir)
    return prev


def _check_ledger_for_resume(run_dir: Path) -> None:
    """Read-only: the coordinator key loads and is the published one, and the ledger's complete entries
    verify (a torn last line is fine: the reopen truncates it with a warning)."""
    from distmoe.wire.ledger import load_signing_key, public_key_hex, verify_ledger

    lpath = run_dir / "ledger" / "coordinator.jsonl"
    if not lpath.exists():
        return  # the interrupted session never opened it: the resume starts the wire afresh
    kpath = run_dir / "keys" / "coordinator.key"
    try:
        key = load_signing_key(kpath)
    except (OSError, ValueError, TypeError) as exc:
        raise RunFailed(f"config key 'run.resume': the coordinator key {kpath} cannot be loaded ({exc}); the "
                        "ledger chain can only be continued with the key that signed it") from None
    pub = lpath.with_suffix(".pub")
    if not pub.exists() or pub.read_text().strip() != public_key_hex(key):
        raise RunFailed(f"config key 'run.resume': {kpath} is not the key published in {pub}")
    res = verify_ledger(lpath, key)
    errors = [e for e in res.errors if "torn trailing line" not in e]
    if errors:
        raise RunFailed(f"config key 'run.resume': the coordinator ledger does not verify ({'; '.join(errors[:3])}); "
                        "a chain that cannot be vouched for is never extended")


@dataclass
class _State:
    round: int = 0
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    anchor: Anchor | None = None
    anchor_versions: int = 0
    current_task: str | None = None
    trained_tasks: list[str] = field(default_factory=list)
    ref_weights: dict[str, torch.Tensor] | None = None  # global model before the current task
    last_eval: dict[str, dict[str, float]] = field(default_factory=dict)  # party -> metrics
    baseline: dict[str, dict[str, float]] = field(default_factory=dict)  # eval before current task


class Coordinator:
    def __init__(self, cfg: RunConfig, run_dir: Path, transport: Transport, run_id: str,
                 log: Callable[[str], None] = print):
        """``run_id``: this process's run id (Flower's). On resume (``cfg.run.resume``) the coordinator
        keeps the interrupted run's id as the logical run id (``self.run_id``: the ledger, the parties'
        accountants) and records ``run_id`` as this session's."""
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.transport = transport
        self.run_id = run_id
        self.session_id = str(run_id)
        self.resuming = bool(cfg.run.resume)
        self.epoch = 0  # secure-aggregation setup epoch: the number of resumes so far
        self.resume_warnings: list[str] = []
        self._ckpt_round = -1  # the round of the last checkpoint written by this process
        self.log = log
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self.record: dict = {}
        self.s = _State()
        self._history: dict[str, list[float]] = {}  # aggregate losses per event, for the anomaly flags

    # ------------------------------------------------------------------ run record
    def _write_record(self, **changes) -> None:
        self.record.update(changes)
        write_json_atomic(self.run_dir / "run.json", self.record)

    def _say(self, text: str) -> None:
        self.log(f"distmoe | {text}")

    # ------------------------------------------------------------------ main loop
    def run(self) -> dict:
        cfg = self.cfg
        schedule = [p.label() + (f"*{p.rounds}" if p.rounds > 1 else "") for p in cfg.schedule.phases]
        p = cfg.privacy
        self.plan = plan_privacy(p, cfg.schedule)
        warn = [] if p.secure else [PLAINTEXT_WARNING]
        if self.resuming:
            return self._run_resumed(schedule)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.run_dir / "config.toml", to_toml(cfg.as_flat()))
        self._write_record(run_id=self.run_id, name=cfg.run.name, status="running", started=time.time(),
                           finished=None, error=None, config=cfg.as_flat(), schedule=schedule, warnings=warn,
                           privacy={"mode": p.mode, "secure_aggregation": p.secure,
                                    "router_stats": "secure-sum + distributed Skellam DP" if p.secure
                                    else "plaintext-sum",
                                    "model_updates": ("secure-sum + client-level DP" if p.update_noise_multiplier
                                                      else "secure-sum") if p.secure else "plaintext",
                                    "plan": self.plan.as_dict(), "epsilon_budget": p.epsilon, "delta": p.delta},
                           parties={})
        for w in warn:
            self._say(f"WARNING: {w}")
        if p.secure:
            self._say(f"privacy: secure aggregation on every reply; router statistics with distributed DP at "
                      f"z = {self.plan.noise_multiplier:.3f}{' (derived)' if self.plan.derived else ''} over "
                      f"{self.plan.stats_releases} release(s): planned epsilon {self.plan.planned_epsilon:.3f} <= "
                      f"{p.epsilon:g} at delta {p.delta:g} per party")
        self.metrics.append({"event": "run_start", "run_id": self.run_id, "schedule": schedule, "warnings": warn})
        return self._execute()

    def _execute(self) -> dict:
        status = "completed"
        try:
            self._run_schedule()
        except BaseException as exc:
            status = "failed"
            self._write_record(status="failed", finished=time.time(),
                               error=f"{type(exc).__name__}: {exc}")
            self.metrics.append({"event": "run_end", "status": "failed", "error": str(exc)})
            self._say(f"run FAILED: {type(exc).__name__}: {exc}")
            if not isinstance(exc, (RunFailed, PrivacyStop)):
                self.log(traceback.format_exc())
            raise
        finally:
            self._ledger_end(status)
        self._write_record(status="completed", finished=time.time())
        self.metrics.append({"event": "run_end", "status": "completed", "rounds": self.s.round})
        self._say(f"run completed: {self.s.round} rounds, results in {self.run_dir}")
        return self.record

    # ------------------------------------------------------------------ privacy plane
    def _start_wire(self, nodes: list[int]) -> None:
        """Coordinator ledger, the run's allow-list (entry 0), the server guard; secure setup."""
        from distmoe.wire.ledger import Ledger, generate_signing_key, public_key_hex
        from distmoe.wire.server_side import ServerGuard, build_policy, policy_digest

        cfg, p = self.cfg, self.cfg.privacy
        lpath = self.run_dir / "ledger" / "coordinator.jsonl"
        continuing = self.resuming and lpath.exists()  # else the interrupted session never opened its ledger
        if continuing:
            self.ledger, start, entries = self._reopen_ledger(lpath)
        else:
            key = generate_signing_key(self.run_dir / "keys" / "coordinator.key", force=True)
            if lpath.exists():
                raise RunFailed(f"{lpath} exists: a run directory is used by one run only")
            self.ledger = Ledger(lpath, key)
            write_text_atomic(lpath.with_suffix(".pub"), public_key_hex(key) + "\n")
        n = len(nodes)
        L, E = self.mspec.num_moe_layers, self.mspec.num_experts
        self.layout_facts = dict(
            update_length=UpdateLayout.build(self.tspec.shapes, TRAIN_METRIC_KEYS, n, p.update_clip,
                                             p.max_weight).length,
            rl_update_length=UpdateLayout.build(self.tspec.shapes, rl_metric_keys(L, cfg.rl.simulator), n,
                                                p.update_clip, p.max_weight).length,
            stats_length=L * E + p.canaries, eval_length=2 * len(eval_metric_keys(cfg.schedule.tasks)))
        if p.secure and self.plan.stats_releases:  # fail before anything is sent, naming the bound
            from distmoe.privacy.dp import WrapError
            from distmoe.privacy.plan import threshold_for
            try:
                stats_spec(p, self.plan.noise_multiplier, L, E, n, threshold_for(n, p.min_parties, p.secagg_graph))
            except WrapError as exc:
                raise RunFailed(f"router statistics of {n} parties cannot be summed in Z_2^64: {exc}; lower "
                                "privacy.num-sequences-max or privacy.scale") from None
        policy = build_policy(secure=p.secure, n_parties=n, trainable=dict(self.tspec.shapes), layers=L, experts=E,
                              tasks=cfg.schedule.tasks, **self.layout_facts)
        blob = canonical_json(policy).encode("ascii")
        if continuing:
            self._ledger_resume(policy, start, entries, n)
        else:
            self.ledger.append(run=self.run_id, round=0, phase="run-start", direction="out", payload_type="policy",
                               keys=[], shapes={}, bytes=len(blob), sha256=policy_digest(policy), verdict="accepted",
                               peer="all", info={"policy": policy, "mode": p.mode,
                                                 "privacy": {k: v for k, v in cfg.as_flat().items()
                                                             if k.startswith("privacy.") or k == "data.canaries"},
                                                 "plan": self.plan.as_dict(), "router_spec": self.mspec.router_spec()})
        self.guard = ServerGuard(self.ledger, self.run_id, policy)
        self.transport.attach(self.guard)
        self.secure = None
        if p.secure:
            self.secure = SecureRounds(cfg, self.plan, self.transport, self.run_dir, self._say, self._report_errors)
            if continuing:
                self._restore_accountants(entries)
            self.secure.setup(nodes, max(self.layout_facts.values()), first_round=self.s.round + 1,
                              logical_run=self.run_id, epoch=self.epoch)
            self._write_record(parties={**(self.record.get("parties") or {}),
                                        **{self.guard.peer(nd): {"node": str(nd),
                                                                 "ledger_public_key": self.guard.public_keys.get(
                                                                     self.guard.peer(nd), "")}
                                           for nd in self.secure.roster}},
                               privacy={**self.record["privacy"], "threshold": self.secure.threshold,
                                        "n_parties": len(self.secure.roster)})

    # ------------------------------------------------------------------ resume
    def _run_resumed(self, schedule: list[str]) -> dict:
        """Continue the interrupted run in ``run.resume`` (module docstring); refusals change nothing."""
        prev = check_resumable(self.run_dir, self.cfg)
        self.run_id = str(prev["run_id"])
        resumes = list(prev.get("resumes") or [])
        self.epoch = len(resumes) + 1
        self.record = prev
        self._write_record(status="running", finished=None, error=None,
                           resumes=[*resumes, {"epoch": self.epoch, "session": self.session_id, "time": time.time(),
                                               "interrupted_status": prev.get("status"),
                                               "interrupted_error": prev.get("error")}])
        why = f"{prev.get('status')}" + (f": {prev['error']}" if prev.get("error") else "")
        self._say(f"resuming run {self.run_id} in {self.run_dir} (resume {self.epoch}, session {self.session_id}; "
                  f"the interrupted session ended {why})")
        return self._execute()

    def _warn(self, text: str) -> None:
        """A resume warning: printed, and kept in ``run.json`` ``warnings`` and the ``run-resume`` entry."""
        self._say(f"WARNING: {text}")
        self.resume_warnings.append(text)
        self._write_record(warnings=[*self.record.get("warnings", []), text])

    def _restore(self) -> bool:
        """Model and coordinator state from the newest checkpoint that verifies (older ones on failure).
        False: the interrupted session died before its first checkpoint and before it contacted anyone (no
        ledger), so the run simply starts at round 0."""
        root = self.run_dir / "checkpoints"
        path, notes = resumable(root)
        for text in notes:
            self._warn(text)
        if path is None and not (self.run_dir / "ledger" / "coordinator.jsonl").exists():
            self._warn(f"no checkpoint in {root} and no ledger: the interrupted session died before round 0 was "
                       "saved; the run starts from round 0")
            return False
        if path is None:
            raise RunFailed(f"config key 'run.resume': no usable checkpoint in {root} (none verifies against its "
                            "manifest): the run cannot resume")
        try:
            manifest, weights, extra, state = load_checkpoint(path)
        except CheckpointError as exc:
            raise RunFailed(f"config key 'run.resume': {exc}") from None
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT or state.get("run_id") != self.run_id:
            raise RunFailed(f"{path / 'state.json'}: not a state of run {self.run_id} in format {STATE_FORMAT}")
        weights = {k: v.to(torch.float32) for k, v in weights.items()}
        try:
            load_trainable(self.model, weights, self.tspec)
        except TrainableError as exc:
            raise RunFailed(f"{path}: the checkpoint does not fit this model: {exc}") from None
        if hash_tensors(weights) != manifest.get("trainable_hash"):
            raise RunFailed(f"{path}: trainable weights do not match the manifest's trainable_hash")
        anchor = None
        if state.get("anchor") is not None:
            probs = extra.get("anchor", {}).get("probs")
            if probs is None:
                raise RunFailed(f"{path}: state.json names anchor v{state['anchor'].get('version')}, but "
                                "anchor.safetensors is missing")
            anchor = Anchor(probs=probs.numpy().astype(np.float32), meta=AnchorVersion(**state["anchor"]))
        as_float = lambda d: {p: {k: (math.nan if v is None else float(v)) for k, v in m.items()}  # noqa: E731
                              for p, m in (d or {}).items()}
        self.s = _State(round=int(state["round"]), weights=weights, anchor=anchor,
                        anchor_versions=int(state["anchor_versions"]), current_task=state.get("current_task"),
                        trained_tasks=list(state.get("trained_tasks") or []),
                        ref_weights=({k: v.to(torch.float32) for k, v in extra["ref"].items()}
                                     if "ref" in extra else None),
                        last_eval=as_float(state.get("last_eval")), baseline=as_float(state.get("baseline")))
        if hasattr(self, "_history"):
            self._history = {k: [float(x) for x in v] for k, v in (state.get("anomaly_history") or {}).items()}
        self._ckpt_round = self.s.round
        self._resume_from = {"checkpoint": str(path.relative_to(self.run_dir)), "round": self.s.round,
                             "trainable_hash": manifest.get("trainable_hash")}
        lost = self._set_aside_lost_metrics(self.s.round)
        total = self.cfg.schedule.total_rounds
        self.metrics.append({"event": "run_resume", "run_id": self.run_id, "session": self.session_id,
                             "epoch": self.epoch, "from_round": self.s.round,
                             "checkpoint": self._resume_from["checkpoint"],
                             "lost_metric_lines": lost, "warnings": list(self.resume_warnings)})
        resumes = self.record.get("resumes") or [{}]
        self._write_record(resumes=[*resumes[:-1], {**resumes[-1], **self._resume_from}])
        self._say(f"resume: checkpoint {self._resume_from['checkpoint']} (round {self.s.round}/{total}, anchor "
                  f"v{self.s.anchor_versions}); continuing with round {self.s.round + 1}")
        return True

    def _set_aside_lost_metrics(self, last_round: int) -> int:
        """Move the ``metrics.jsonl`` lines of rounds after ``last_round`` (the round lost in the crash) to
        ``metrics.lost.jsonl``; returns how many moved."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return 0
        keep, lost = [], []
        for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
            if not line.endswith("\n"):
                continue  # a torn tail from the crash
            try:
                rnd = json.loads(line).get("round")
            except (ValueError, AttributeError):
                rnd = None
            (lost if isinstance(rnd, int) and rnd > last_round else keep).append(line)
        if lost:  # first kept aside durably, then removed from the log (a crash in between only duplicates)
            with (self.run_dir / "metrics.lost.jsonl").open("a", encoding="utf-8") as fh:
                fh.writelines(lost)
                fh.flush()
                os.fsync(fh.fileno())
        write_text_atomic(path, "".join(keep))
        return len(lost)

    def _state_for_checkpoint(self) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
        """The coordinator state at this round boundary (``state.json``) and its tensors."""
        s = self.s
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        if s.ref_weights is not None:
            tensors["ref"] = s.ref_weights
        if s.anchor is not None:
            tensors["anchor"] = {"probs": torch.from_numpy(np.ascontiguousarray(s.anchor.probs, dtype=np.float32))}
        state = {"format": STATE_FORMAT, "run_id": self.run_id, "session": self.session_id, "epoch": self.epoch,
                 "round": s.round, "position": self._position(s.round), "anchor_versions": s.anchor_versions,
                 "anchor": asdict(s.anchor.meta) if s.anchor is not None else None,
                 "current_task": s.current_task, "trained_tasks": list(s.trained_tasks),
                 "last_eval": sanitize(s.last_eval), "baseline": sanitize(s.baseline),
                 "anomaly_history": sanitize(getattr(self, "_history", {}))}
        return state, tensors

    def _position(self, rnd: int) -> dict | None:
        """Where round ``rnd`` sits in the schedule (None for round 0, before the first phase)."""
        done = 0
        for i, ph in enumerate(self.cfg.schedule.phases):
            if rnd <= done + ph.rounds:
                return {"phase": i, "label": ph.label(), "round_in_phase": rnd - done} if rnd > 0 else None
            done += ph.rounds
        return {"phase": len(self.cfg.schedule.phases), "label": "end", "round_in_phase": 0}

    def _reopen_ledger(self, lpath: Path):
        """The interrupted run's ledger, opened with its own key (chain and signatures verified)."""
        from distmoe.wire.ledger import Ledger, LedgerError, TornLedgerWarning, load_signing_key, public_key_hex

        kpath = self.run_dir / "keys" / "coordinator.key"
        try:
            key = load_signing_key(kpath)
        except (OSError, ValueError, TypeError) as exc:
            raise RunFailed(f"config key 'run.resume': the coordinator key {kpath} cannot be loaded ({exc}); the "
                            "ledger chain can only be continued with the key that signed it") from None
        if not lpath.exists():
            raise RunFailed(f"config key 'run.resume': the coordinator ledger {lpath} is missing")
        pub = lpath.with_suffix(".pub")
        if not pub.exists() or pub.read_text().strip() != public_key_hex(key):
            raise RunFailed(f"config key 'run.resume': {kpath} is not the key published in {pub}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", TornLedgerWarning)
            try:
                led = Ledger(lpath, key)
            except LedgerError as exc:
                raise RunFailed(f"config key 'run.resume': the coordinator ledger does not verify ({exc}); a chain "
                                "that cannot be vouched for is never extended") from None
        for w in caught:
            if issubclass(w.category, TornLedgerWarning):
                self._warn(str(w.message))
        entries = [json.loads(x) for x in lpath.read_text(encoding="ascii").splitlines() if x]
        start = entries[0] if entries else {}
        if start.get("phase") != "run-start" or start.get("payload_type") != "policy":
            raise RunFailed(f"config key 'run.resume': {lpath} does not begin with the run-start policy entry")
        return led, start, entries

    def _ledger_resume(self, policy: dict, start: dict, entries: list[dict], n_nodes: int) -> None:
        """Check the rebuilt allow-list against the signed one, then append the ``run-resume`` entry."""
        from distmoe.wire.server_side import policy_digest

        digest = policy_digest(policy)
        if digest != start.get("sha256"):
            old = (start.get("info") or {}).get("policy") or {}
            diff = sorted(k for k in set(old) | set(policy) if old.get(k) != policy.get(k))
            raise RunFailed(f"config key 'run.resume': the allow-list for the {n_nodes} parties connected now differs "
                            f"from the one signed at run-start (in {', '.join(diff[:6])}): a resumed run needs the "
                            f"same number of parties ({(self.record.get('privacy') or {}).get('n_parties', '?')} "
                            "in the run) and the same model")
        seq, head = self.ledger.head()
        info = {"session": self.session_id, "epoch": self.epoch, **self._resume_from,
                "previous_head": {"seq": seq, "hash": head}, "policy_sha256": digest,
                "dp_releases": self._dp_release_counts(entries), "warnings": list(self.resume_warnings)}
        blob = canonical_json(info).encode("ascii")
        self.ledger.append(run=self.run_id, round=self.s.round, phase="run-resume", direction="out",
                           payload_type="run-resume", keys=[], shapes={}, bytes=len(blob),
                           sha256=hashlib.sha256(blob).hexdigest(), verdict="accepted", peer="all", info=info)

    @staticmethod
    def _dp_release_counts(entries: list[dict]) -> dict[str, int]:
        """DP releases per party in the ledger (what the audit will charge)."""
        out: dict[str, int] = {}
        for e in entries:
            if str(e.get("payload_type", "")).startswith("release:") and isinstance(e.get("dp"), dict):
                for party in (e.get("info") or {}).get("included") or []:
                    out[str(party)] = out.get(str(party), 0) + 1
        return out

    def _restore_accountants(self, entries: list[dict]) -> None:
        """The server accountants of the interrupted run; each must hold every DP release in the ledger."""
        counts = self._dp_release_counts(entries)
        if not counts and not (self.secure.dir / "ledger.json").exists():
            self._say("resume: no accountant state yet (the interrupted session died before any release)")
            return
        accs = self.secure.restore_accountants()
        for party, n in sorted(counts.items()):
            have = len(accs[party].events) if party in accs else 0
            if have < n:
                raise RunFailed(f"config key 'run.resume': {self.secure.dir / 'ledger.json'} holds {have} releases of "
                                f"party {party}, the ledger {n}: the accountant lags the ledger and the run cannot "
                                "resume without under-counting privacy")
        spent = ", ".join(f"{k} {a.primary_epsilon():.3f}" for k, a in sorted(accs.items()))
        self._say(f"resume: privacy accountants carried over (epsilon spent so far: {spent or 'none'})")

    def _ledger_end(self, status: str) -> None:
        led = getattr(self, "ledger", None)
        if led is None:
            return
        try:
            eps = self.secure.epsilon() if getattr(self, "secure", None) else {}
            led.append(run=self.run_id, round=self.s.round, phase="run-end", direction="out", payload_type="run-end",
                       keys=[], shapes={}, bytes=0, sha256=hashlib.sha256(b"").hexdigest(), verdict="accepted",
                       peer="all", info={"status": status, "epsilon": eps})
            if eps:
                self._write_record(privacy={**self.record["privacy"], "epsilon_spent": eps})
        except Exception as exc:  # never mask the run's own error
            self._say(f"could not close the ledger: {exc}")

    def _run_schedule(self) -> None:
        cfg = self.cfg
        model, tok = build_model(cfg.model)
        self.model = apply_trainable(model, cfg.model)
        self.tok = tok
        self.tspec = spec_of(self.model, cfg.model.trainable)
        self.mspec = describe(self.model)
        self.s.weights = trainable_state(self.model)
        self._write_record(model={"family": self.mspec.family, "parameters": param_count(self.model),
                                  "trainable": cfg.model.trainable, "trainable_numel": self.tspec.numel,
                                  "router_spec": self.mspec.router_spec()})
        self._say(f"model {self.mspec.family}: {param_count(self.model) / 1e6:.2f}M parameters, "
                  f"{self.tspec.numel / 1e6:.2f}M trainable ({cfg.model.trainable}); "
                  f"{len(self.mspec.moe_layers)} MoE layers x {self.mspec.num_experts} experts, "
                  f"top-{self.mspec.top_k}")
        if cfg.privacy.dp_sgd:  # fail before any party is contacted, with opacus' own verdict
            from distmoe.privacy.dpsgd import DPSGDUnsupported, require_dp_sgd_support

            try:
                require_dp_sgd_support(self.model, "config key 'privacy.dp-sgd'")
            except DPSGDUnsupported as exc:
                raise RunFailed(str(exc)) from None
            raise RunFailed("config key 'privacy.dp-sgd': opacus supports this model's trainable parameters, but the "
                            "DP-SGD training loop is not wired into local SFT yet; use privacy.update-noise-multiplier")
        if not (self.resuming and self._restore()):
            self._checkpoint()
        self._start_wire(self._wait_for_parties())
        total = cfg.schedule.total_rounds
        rnd = 0
        for pi, phase in enumerate(cfg.schedule.phases):
            for _ in range(phase.rounds):
                rnd += 1
                if rnd <= self.s.round:  # completed before the restart
                    continue
                self.s.round = rnd
                t0 = time.perf_counter()
                head = f"round {self.s.round}/{total} | {phase.label()}"
                if phase.kind == "sft":
                    text = self._sft_round(pi, phase)
                elif phase.kind == "rl":
                    text = self._rl_round(pi, phase)
                elif phase.kind == "stats":
                    text = self._stats_round(phase)
                else:
                    text = self._eval_round()
                if self._ckpt_round != self.s.round:  # every completed round ends with a checkpoint
                    self._checkpoint()
                self._say(f"{head} | {text} | {time.perf_counter() - t0:.1f} s")

    def _wait_for_parties(self) -> list[int]:
        need = self.cfg.federation.min_parties
        deadline = time.monotonic() + self.cfg.federation.wait_timeout
        while True:
            nodes = self.transport.node_ids()
            if len(nodes) >= need:
                self._say(f"{len(nodes)} parties connected")
                return nodes
            if time.monotonic() > deadline:
                raise RunFailed(f"only {len(nodes)} of federation.min-parties = {need} parties connected "
                                f"within federation.wait-timeout = {self.cfg.federation.wait_timeout} s")
            time.sleep(1.0)

    def _nodes(self) -> list[int]:
        nodes = self.transport.node_ids()
        if len(nodes) < self.cfg.federation.min_parties:
            raise RunFailed(f"{len(nodes)} parties connected, federation.min-parties = "
                            f"{self.cfg.federation.min_parties}")
        return nodes

    def _np_weights(self, w: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        return {k: v.numpy() for k, v in w.items()}

    def _report_errors(self, phase: str, errors: dict[int, str]) -> None:
        for node, reason in errors.items():
            who = self.guard.peer(node) if getattr(self, "guard", None) else f"node {node}"
            self._say(f"round {self.s.round}: party {who} left out of {phase}: {reason}")
            self.metrics.append({"event": "party_error", "round": self.s.round, "phase_label": phase,
                                 "node": str(node), "party": who, "reason": reason[:500]})

    # ------------------------------------------------------------------ phases
    def _sft_round(self, phase_index: int, phase: Phase) -> str:
        s, cfg = self.s, self.cfg
        if phase.task != s.current_task:
            # a new task starts: remember the model and the evaluation before it
            s.ref_weights = {k: v.clone() for k, v in s.weights.items()}
            s.baseline = {p: dict(m) for p, m in s.last_eval.items()}
            s.current_task = phase.task
            if phase.task not in s.trained_tasks:
                s.trained_tasks.append(phase.task)
        use_anchor = s.anchor is not None and cfg.routing.anchor_kl_coef > 0
        instr = SftInstruction(round=s.round, task=phase.task, weights=self._np_weights(s.weights),
                               base_hash=self.tspec.base_hash, seed=cfg.run.seed * 100_003 + s.round,
                               anchor=s.anchor.probs if use_anchor else None,
                               anchor_version=s.anchor.meta.version if use_anchor else 0)
        out = self._update_round(phase_index, phase, instr, "train", {"anchor_version": instr.anchor_version})
        if isinstance(out, str):
            return out
        agg, n_parties, n_nodes = out
        kl = f", anchor KL {agg['anchor_kl']:.4f}" if use_anchor and math.isfinite(agg.get("anchor_kl", math.nan)) \
            else ""
        if not math.isfinite(agg.get("skipped_steps", math.nan)):
            return f"{n_parties}/{n_nodes} parties | training metrics withheld (client-level DP on updates)"
        return (f"{n_parties}/{n_nodes} parties | task loss {agg['loss_first']:.3f} -> "
                f"{agg['loss_last']:.3f}{kl} | skipped steps {int(agg['skipped_steps'])}")

    def _rl_round(self, phase_index: int, phase: Phase) -> str:
        """Local GRPO at each party; the update is aggregated exactly like an SFT update."""
        s, cfg = self.s, self.cfg
        if phase.task not in s.trained_tasks:
            s.trained_tasks.append(phase.task)
        instr = RlInstruction(round=s.round, task=phase.task, weights=self._np_weights(s.weights),
                              base_hash=self.tspec.base_hash, seed=cfg.run.seed * 100_003 + s.round)
        out = self._update_round(phase_index, phase, instr, "rl", {"engine": cfg.rl.engine,
                                                                  "correction": cfg.rl.correction})
        if isinstance(out, str):
            return out
        agg, n_parties, n_nodes = out
        if self.cfg.privacy.secure and self.cfg.privacy.update_noise_multiplier > 0:
            return f"{n_parties}/{n_nodes} parties | RL metrics withheld (client-level DP on updates)"
        return (f"{n_parties}/{n_nodes} parties | reward {agg['reward_first']:.3f} -> {agg['reward_last']:.3f} "
                f"| |dlogp| mean {agg['logp_diff_mean']:.4f} max {agg['logp_diff_max']:.3f} | masked "
                f"{agg['masked_frac_low'] + agg['masked_frac_high']:.4f} | K3 {agg['k3']:.2e}")

    def _update_round(self, phase_index: int, phase: Phase, instr: object, event: str, extra: dict
                      ) -> str | tuple[dict[str, float], int, int]:
        """Send ``instr`` to every party, aggregate the updates (a secure weighted sum, or plaintext FedAvg
        in the baseline mode), log, checkpoint."""
        s, cfg = self.s, self.cfg
        base = {"event": event, "round": s.round, "phase": phase_index, "phase_label": phase.label(),
                "task": phase.task, **extra}
        if self.secure is not None:
            out = self._secure_update(phase, instr, event)
            if isinstance(out, str):
                self.metrics.append({**base, "party": "all", "num_examples": 0, "skipped": True})
                return out
            avg, weight, agg, included, n_nodes = out
            for k, d in avg.items():
                s.weights[k] = s.weights[k] + torch.from_numpy(d)
            self.metrics.append({**base, "party": "all", "num_examples": int(round(weight)), "parties": included,
                                 **agg})
            self._flag_anomalies(event, agg)
            self._checkpoint()
            return agg, included, n_nodes
        nodes = self._nodes()
        replies, errors = self.transport.exchange({n: instr for n in nodes}, ModelUpdate,
                                                  cfg.federation.round_timeout, rnd=s.round, phase=phase.kind)
        updates: list[tuple[dict[str, np.ndarray], float]] = []
        for node, upd in list(replies.items()):
            problem = self._check_update(upd)
            if problem:
                errors[node] = problem
                del replies[node]
        rejected = divergent_updates({nd: u.delta for nd, u in replies.items()}, cfg.federation.max_norm_ratio)
        for node, problem in rejected.items():
            errors[node] = problem
            del replies[node]
        updates = [(u.delta, float(u.num_examples)) for u in replies.values()]
        self._report_errors(phase.label(), errors)
        for upd in replies.values():
            self.metrics.append({**base, "party": upd.party, "num_examples": upd.num_examples,
                                 **upd.metrics})
        avg = weighted_average(updates)
        if avg is None:
            self.metrics.append({**base, "party": "all", "num_examples": 0, "skipped": True})
            return self._round_failed(f"no usable update ({len(errors)} errors): model unchanged")
        self.guard.log_release(rnd=s.round, phase=phase.kind, release="model-update",
                               total=np.concatenate([a.ravel() for a in avg.values()]), dp=None,
                               info={"mode": "plaintext", "release": "model-update",
                                     "included": sorted(u.party for u in replies.values()), "dropped": [],
                                     "responders": [],
                                     "rejected": {self.guard.peer(nd): why for nd, why in rejected.items()}})
        for k, d in avg.items():
            s.weights[k] = s.weights[k] + torch.from_numpy(d)
        agg = self._weighted_metrics([(u.metrics, u.num_examples) for u in replies.values()
                                      if u.num_examples > 0])
        n_total = sum(u.num_examples for u in replies.values())
        self.metrics.append({**base, "party": "all", "num_examples": n_total, "parties": len(updates), **agg})
        self._flag_anomalies(event, agg)
        self._checkpoint()
        return agg, len(updates), len(nodes)

    def _secure_update(self, phase: Phase, instr: object, event: str):
        cfg, p, s = self.cfg, self.cfg.privacy, self.s
        rl = event == "rl"
        keys = rl_metric_keys(self.mspec.num_moe_layers, cfg.rl.simulator) if rl else TRAIN_METRIC_KEYS
        z_u = self.secure.plan.update_noise_multiplier
        layout = UpdateLayout.build(self.tspec.shapes, keys, len(self.secure.roster), p.update_clip, p.max_weight,
                                    private=z_u > 0)
        release = "rl-update" if rl else "model-update"
        n, t = len(self.secure.roster), self.secure.threshold

        def event_at(n_active: int) -> PrivacyEvent:
            return PrivacyEvent(z_u * math.sqrt(n_active / t), 1.0, 1, "gaussian", f"{release} round {s.round}")

        res = self.secure.round(s.round, phase.kind, instr, release, layout.length, event_at if z_u > 0 else None)
        if res is None:
            return self._round_failed("no secure sum this round: model unchanged")
        avg, weight, agg = layout.decode(res.total)
        problem = aggregate_problem(layout, avg, weight, len(res.included), z_u, t)
        dp = None
        if z_u > 0:
            dp = {"mechanism": "gaussian", "unit": "party", "neighbours": "add/remove", "noise_multiplier": z_u,
                  "n_parties": n, "n_active": res.n_active, "max_dropouts": n - t,
                  "z_eff": z_u * math.sqrt(res.n_active / t), "clip": p.update_clip, "weights": "uniform",
                  "sensitivity": layout.sensitivity, "metrics": "withheld"}
        self.guard.log_release(rnd=s.round, phase=phase.kind, release=release, total=res.total, dp=dp,
                               info={"mode": "secagg", "release": release, "included": list(res.included),
                                     "dropped": list(res.dropped), "responders": list(res.responders),
                                     "weight_sum": weight, "frac_bits": layout.frac_bits,
                                     "applied": problem is None, **({"rejected": problem} if problem else {})},
                               verdict="accepted" if problem is None else f"rejected: {problem}")
        if problem is not None:
            self._say(f"round {s.round}: the secure sum of {release} is rejected: {problem}")
            return self._round_failed(f"aggregate rejected ({problem}): model unchanged")
        if avg is None:
            return f"{len(res.included)} parties, total weight 0 (no data for task {phase.task!r}): model unchanged"
        return avg, weight, agg, len(res.included), len(self.secure.roster)

    def _round_failed(self, message: str) -> str:
        """A round that released nothing: go on (``federation.on-round-failure = skip``) or stop the run."""
        if self.cfg.federation.on_round_failure == "stop":
            raise RunFailed(f"round {self.s.round}: {message} (federation.on-round-failure = 'stop')")
        return message

    def _flag_anomalies(self, event: str, agg: Mapping[str, float]) -> list[str]:
        """Flag a non-finite aggregate loss or one beyond ``federation.anomaly-z`` rolling z-scores of the
        same event's earlier rounds (window 8, at least 3 earlier values). Recorded in ``run.json``
        (``anomalies``) and ``metrics.jsonl`` (``event: anomaly``); the report lists them."""
        z_max = self.cfg.federation.anomaly_z
        found = []
        if self.cfg.privacy.secure and self.cfg.privacy.update_noise_multiplier > 0:
            return found  # metrics withheld under client-level DP: nothing to judge
        for key in ANOMALY_KEYS.get(event, ()):
            if key not in agg:
                continue
            v = float(agg[key])
            hist = self._history.setdefault(f"{event}/{key}", [])
            if not math.isfinite(v):
                found.append(f"{event} {key} is {v} (non-finite)")
                continue
            recent = hist[-8:]
            if z_max > 0 and len(recent) >= 3:
                mu = sum(recent) / len(recent)
                sd = math.sqrt(sum((x - mu) ** 2 for x in recent) / (len(recent) - 1))
                z = (v - mu) / max(sd, 1e-6 * max(abs(mu), 1.0))
                if z > z_max:
                    found.append(f"{event} {key} {v:.4g} is {z:.1f} rolling standard deviations above the "
                                 f"mean {mu:.4g} of the last {len(recent)} rounds (federation.anomaly-z = {z_max:g})")
            hist.append(v)
        for text in found:
            self._say(f"round {self.s.round}: ANOMALY: {text}")
            self.metrics.append({"event": "anomaly", "round": self.s.round, "kind": event, "party": "all",
                                 "detail": text})
            self._write_record(anomalies=[*self.record.get("anomalies", []), {"round": self.s.round, "detail": text}])
        return found

    def _check_update(self, upd: ModelUpdate) -> str | None:
        expected = dict(self.tspec.shapes)
        if set(upd.delta) != set(expected):
            return "update keys do not match the trainable parameters"
        for k, shape in expected.items():
            if tuple(upd.delta[k].shape) != shape:
                return f"update tensor {k!r} has shape {tuple(upd.delta[k].shape)}, expected {shape}"
            if not np.all(np.isfinite(upd.delta[k])):
                return f"update tensor {k!r} contains NaN or Inf"
        return None

    @staticmethod
    def _weighted_metrics(items: list[tuple[dict[str, float], float]]) -> dict[str, float]:
        out: dict[str, float] = {}
        if not items:
            return out
        keys = sorted({k for m, _ in items for k in m})
        for k in keys:
            vals = [(m[k], w) for m, w in items if k in m and math.isfinite(m[k]) and w > 0]
            if not vals:
                out[k] = math.nan
                continue
            if k in ("steps", "skipped_steps"):
                out[k] = float(sum(v for v, _ in vals))
            elif k == "logp_diff_max":
                out[k] = float(max(v for v, _ in vals))
            else:
                out[k] = sum(v * w for v, w in vals) / sum(w for _, w in vals)
        return out

    def _stats_round(self, phase: Phase) -> str:
        s, cfg = self.s, self.cfg
        instr = StatsInstruction(round=s.round, task=phase.task or "", weights=self._np_weights(s.weights),
                                 base_hash=self.tspec.base_hash)
        shape = (self.mspec.num_moe_layers, self.mspec.num_experts)
        if self.secure is not None:
            out = self._secure_stats(instr, shape)
            if isinstance(out, str):
                return out
            total, n_parties, n_nodes, dp_text = out
        else:
            nodes = self._nodes()
            replies, errors = self.transport.exchange({n: instr for n in nodes}, RouterStats,
                                                      cfg.federation.round_timeout, rnd=s.round, phase="stats")
            good = []
            for node, st in replies.items():
                if tuple(st.sums.shape) != shape:
                    errors[node] = f"router statistics have shape {tuple(st.sums.shape)}, expected {shape}"
                else:
                    good.append(st.sums)
            self._report_errors(phase.label(), errors)
            if not good:
                return "no usable router statistics: anchor unchanged"
            total = np.sum(good, axis=0)  # [L, E]
            self.guard.log_release(rnd=s.round, phase="stats", release="router-stats", total=total, dp=None,
                                   info={"mode": "plaintext", "release": "router-stats",
                                         "included": sorted(self.guard.peer(nd) for nd in replies),
                                         "dropped": [], "responders": [], "layers": shape[0], "experts": shape[1]})
            n_parties, n_nodes, dp_text = len(good), len(nodes), "no DP (plaintext baseline)"
        n_seq = float(total.sum(1).mean())
        if n_seq <= 0 or np.any(np.clip(total, 0, None).sum(1) <= 0):
            return "router statistics are empty (or all noise): anchor unchanged"
        s.anchor_versions += 1
        meta = AnchorVersion(version=s.anchor_versions, round=s.round,
                             source_checkpoint=hash_tensors(s.weights),
                             router_spec=self.mspec.router_spec(), num_sequences=n_seq, task=phase.task)
        s.anchor = build_anchor(total, meta)
        save_anchor(s.anchor, self.run_dir / "anchors")
        self.metrics.append({"event": "stats", "round": s.round, "party": "all", "task": phase.task,
                             "anchor_version": meta.version, "num_sequences": n_seq, "parties": n_parties})
        ent = float(-(s.anchor.probs * np.log(np.clip(s.anchor.probs, 1e-9, None))).sum(1).mean())
        return (f"{n_parties}/{n_nodes} parties | anchor v{meta.version} from ~{n_seq:.0f} sequences "
                f"| mean routing entropy {ent:.3f} nats | {dp_text}")

    def _secure_stats(self, instr: StatsInstruction, shape: tuple[int, int]):
        p, s = self.cfg.privacy, self.s
        sec = self.secure
        n, t = len(sec.roster), sec.threshold
        spec = stats_spec(p, sec.plan.noise_multiplier, shape[0], shape[1], n, t)
        layout = StatsLayout(spec)

        def event_at(n_active: int) -> PrivacyEvent:
            return PrivacyEvent(spec.effective_noise_multiplier(n_active), 1.0, 1, "skellam",
                                f"router-stats round {s.round}")

        res = sec.round(s.round, "stats", instr, "router-stats", layout.length, event_at)
        if res is None:
            return self._round_failed("no secure sum this round: anchor unchanged")
        noisy, canaries = layout.decode(res.total)  # [L, E] sequence units, [K] integer units
        ints = from_ring64(res.total)[:spec.dim].reshape(shape)
        dp = spec.dp_params(res.n_active)
        problem = stats_sum_problem(ints, spec.scale, res.n_active, p.num_sequences_max,
                                    spec.aggregate_sigma(res.n_active))
        self.guard.log_release(rnd=s.round, phase="stats", release="router-stats", total=res.total, dp=dp,
                               info={"mode": "secagg", "release": "router-stats", "included": list(res.included),
                                     "dropped": list(res.dropped), "responders": list(res.responders),
                                     "layers": shape[0], "experts": shape[1],
                                     "canary": {"k": int(spec.n_canaries), "values": [int(v) for v in canaries]},
                                     "row_sums": [int(v) for v in ints.sum(1)], "applied": problem is None,
                                     **({"rejected": problem} if problem else {})},
                               verdict="accepted" if problem is None else f"rejected: {problem}")
        if problem is not None:  # the privacy cost is spent (the sum was unmasked), the anchor stays
            self._say(f"round {s.round}: the secure sum of router statistics is rejected: {problem}")
            return self._round_failed(f"aggregate rejected ({problem}): anchor unchanged")
        eps = sec.epsilon()
        worst = max((max(v["prv"], v["rdp"]) for v in eps.values()), default=0.0)
        return (np.asarray(noisy), len(res.included), n,
                f"DP z_eff {dp['z_eff']:.2f}, epsilon spent <= {worst:.3f} of {p.epsilon:g}")

    def _eval_round(self) -> str:
        s, cfg = self.s, self.cfg
        tasks = tuple(s.trained_tasks) or cfg.schedule.tasks
        ref = s.ref_weights if s.ref_weights is not None else None
        instr = EvalInstruction(round=s.round, tasks=tasks, new_task=s.current_task or "",
                                weights=self._np_weights(s.weights), base_hash=self.tspec.base_hash,
                                ref_weights=self._np_weights(ref) if ref is not None else None,
                                anchor=s.anchor.probs if s.anchor is not None else None,
                                anchor_version=s.anchor.meta.version if s.anchor is not None else 0)
        if self.secure is not None:
            keys = eval_metric_keys(tasks)
            layout = EvalLayout(keys, len(self.secure.roster), cfg.privacy.num_sequences_max)
            res = self.secure.round(s.round, "eval", instr, "eval", layout.length)
            if res is None:
                return self._round_failed("no secure sum this round: no evaluation")
            agg = layout.decode(res.total)
            problem = eval_sum_problem(agg, len(res.included), cfg.privacy.num_sequences_max)
            self.guard.log_release(rnd=s.round, phase="eval", release="eval", total=res.total, dp=None,
                                   info={"mode": "secagg", "release": "eval", "included": list(res.included),
                                         "dropped": list(res.dropped), "responders": list(res.responders),
                                         "applied": problem is None, **({"rejected": problem} if problem else {})},
                                   verdict="accepted" if problem is None else f"rejected: {problem}")
            if problem is not None:
                self._say(f"round {s.round}: the secure sum of evaluation numbers is rejected: {problem}")
                return self._round_failed(f"aggregate rejected ({problem}): no evaluation")
            per_party: dict[str, dict[str, float]] = {"all": agg}
            n_replies, n_nodes = len(res.included), len(self.secure.roster)
        else:
            nodes = self._nodes()
            replies, errors = self.transport.exchange({n: instr for n in nodes}, EvalReply,
                                                      cfg.federation.round_timeout, rnd=s.round, phase="eval")
            self._report_errors("eval", errors)
            if not replies:
                return "no evaluation replies"
            per_party = {r.party: dict(r.metrics) for r in replies.values()}
            agg = self._aggregate_eval(list(per_party.values()), tasks)
            self.guard.log_release(rnd=s.round, phase="eval", release="eval", total=np.zeros(1), dp=None,
                                   info={"mode": "plaintext", "release": "eval", "included": sorted(per_party),
                                         "dropped": [], "responders": []})
            per_party["all"] = agg
            n_replies, n_nodes = len(replies), len(nodes)
        earlier = [t for t in s.trained_tasks if t != s.current_task]
        for party, m in per_party.items():
            before = s.baseline.get(party, {})
            for t in earlier:
                b, now = before.get(f"acc/{t}", math.nan), m.get(f"acc/{t}", math.nan)
                if math.isfinite(b) and math.isfinite(now) and b > 0:
                    m[f"retention/{t}"] = now / b
            if s.current_task:
                m["new_task"] = s.current_task
                m["new_task_loss"] = m.get(f"loss/{s.current_task}", math.nan)
            self.metrics.append({"event": "eval", "round": s.round, "phase_label": "eval", "party": party,
                                 "anchor_version": instr.anchor_version, **m})
        s.last_eval = {p: {k: v for k, v in m.items() if isinstance(v, float)} for p, m in per_party.items()}
        accs = ", ".join(f"{t} {agg.get(f'acc/{t}', math.nan):.2f}" for t in tasks)
        extra = [f"{k} {agg[k]:.3f}" for k in EVAL_ROUTING_KEYS if math.isfinite(agg.get(k, math.nan))]
        ret = [f"retention {t} {agg[f'retention/{t}']:.2f}" for t in earlier if f"retention/{t}" in agg]
        return f"{n_replies}/{n_nodes} parties | acc: {accs} | " + " | ".join(extra + ret)

    @staticmethod
    def _aggregate_eval(parties: list[dict[str, float]], tasks: tuple[str, ...]) -> dict[str, float]:
        out: dict[str, float] = {}
        for t in tasks:
            n_key = f"n/{t}"
            items = [(m, m.get(n_key, 0.0)) for m in parties if m.get(n_key, 0.0) > 0]
            n = sum(w for _, w in items)
            out[n_key] = n
            for k in ("acc", "loss"):
                vals = [(m[f"{k}/{t}"], w) for m, w in items if math.isfinite(m.get(f"{k}/{t}", math.nan))]
                out[f"{k}/{t}"] = sum(v * w for v, w in vals) / sum(w for _, w in vals) if vals else math.nan
        for k in EVAL_ROUTING_KEYS:
            vals = [(m[k], sum(m.get(f"n/{t}", 0.0) for t in tasks)) for m in parties
                    if math.isfinite(m.get(k, math.nan))]
            wsum = sum(w for _, w in vals)
            out[k] = sum(v * w for v, w in vals) / wsum if vals and wsum > 0 else math.nan
        return out

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint(self) -> None:
        """The model and the coordinator state at the end of round ``s.round`` (the resume point)."""
        load_trainable(self.model, self.s.weights, self.tspec)
        state, tensors = self._state_for_checkpoint()
        save_checkpoint(self.run_dir / "checkpoints", self.s.round, self.model, self.tok, self.s.weights,
                        hash_tensors(self.s.weights),
                        meta={"run_id": self.run_id, "anchor_version": self.s.anchor_versions,
                              "trainable": self.cfg.model.trainable},
                        keep=self.cfg.checkpoint.keep, state=state, tensors=tensors)
        self._ckpt_round = self.s.round
