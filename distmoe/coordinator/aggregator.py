"""How the replies of one round become one aggregate: the ``Aggregator`` interface and its plaintext form.

Owns: ``SumRequest`` (what a phase asks of its round), the ``Aggregator`` interface (``collect``), and
``PlaintextAggregator`` (the three sums a phase asks for: ``updates``, the weighted mean model update and its
metrics; ``router_stats``, the summed ``[L, E]`` router statistics; ``evaluation``, the evaluation aggregate; the
benchmark baseline: each party's reply is seen and summed in the clear; FedAvg with the norm-ratio
screen of ``distmoe.aggregate``). The secure form is ``distmoe.coordinator.secure.SecureAggregator``.
Each implementation logs its release in the coordinator's ledger (``ServerGuard.log_release``); the sums' types are
``distmoe.privacy.releases.base``'s.

The round loop asks for a phase's sum with ``collect(instr, request)`` (``SumRequest``: which sum, the phase's wire
kind and release name, its ``metrics.jsonl`` fields); that call is the round's one exchange with the parties, over
the transport the aggregator was built with (``distmoe.wire.server_guard.GuardedTransport``). Phases
(``distmoe.coordinator.phases``) are written once against the sums it returns, in the style of Flower strategies'
``aggregate_*``: they never branch on the privacy mode.

Must not: change the global model or the anchor (the phases do), or import ``flwr``.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field

import numpy as np

from distmoe.aggregate import divergent_updates, weighted_average
from distmoe.coordinator.context import RunContext
from distmoe.coordinator.errors import RunFailed
from distmoe.privacy import train_metrics as TM
from distmoe.privacy.releases.base import EvalSum, Skip, StatsSum, UpdateSum
from distmoe.wire.allow_list import ProbeBounds
from distmoe.wire.schema import EVAL_ROUTING_KEYS, EvalReply, ModelUpdate, ProbePart, RouterStats
from distmoe.wire.server_guard import GuardedTransport, ServerGuard

SUMS = ("update", "stats", "eval")  # what a phase can ask the aggregator for


@dataclass(frozen=True)
class SumRequest:
    """What a phase asks of its round: ``sum`` (one of ``SUMS``), its wire kind (``sft``, ``rl``, ``stats``,
    ``eval``: the SecAgg round's phase and the ledger's), the release name (``model-update``, ``rl-update``,
    ``router-stats``, ``eval``), the label for its error lines, ``event``: the fields of the round's
    ``metrics.jsonl`` lines (update sums), and ``probe``: the bounds of the routing probe the instruction carries
    (``phases/probe.py``; the collected probes are in ``Aggregator.probes`` afterwards)."""

    sum: str
    kind: str
    release: str
    label: str
    event: dict = field(default_factory=dict)
    probe: ProbeBounds | None = None  # the instruction carries the routing probe: each reply's probe bounds


class Aggregator(abc.ABC):
    """One implementation per privacy mode (module docstring), chosen once per run (``coordinator/plane.py``)."""

    def __init__(self, co: RunContext, transport: GuardedTransport, guard: ServerGuard):
        self.co, self.transport, self.guard = co, transport, guard
        self.probes: dict[int, ProbePart] = {}  # node -> the routing probe carried on its reply, last ``collect``

    @abc.abstractmethod
    def collect(self, instr: object, req: SumRequest) -> UpdateSum | StatsSum | EvalSum | Skip:
        """The round's one exchange: send ``instr`` to every party and return the sum ``req`` asks for."""

    def nodes(self) -> list[int]:
        """The connected nodes, at least ``federation.min-available`` of them (else ``RunFailed``)."""
        nodes, need = self.transport.node_ids(), self.co.cfg.federation.min_available
        if len(nodes) < need:
            raise RunFailed(f"{len(nodes)} parties connected, federation.min-available = {need}")
        return nodes


def weighted_metrics(items: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """Example-weighted mean of each metric; counts are summed, ``logp_diff_max`` is a max."""
    out: dict[str, float] = {}
    for k in sorted({k for m, _ in items for k in m}):
        vals = [(m[k], w) for m, w in items if k in m and math.isfinite(m[k]) and w > 0]
        if not vals:
            out[k] = math.nan
        elif k in ("steps", "skipped_steps"):
            out[k] = float(sum(v for v, _ in vals))
        elif k == "logp_diff_max":
            out[k] = float(max(v for v, _ in vals))
        else:
            out[k] = sum(v * w for v, w in vals) / sum(w for _, w in vals)
    return out


def aggregate_eval(parties: list[dict[str, float]], tasks: tuple[str, ...]) -> dict[str, float]:
    """Held-out-count-weighted mean of each task's accuracy and loss, and of the routing metrics."""
    out: dict[str, float] = {}
    for t in tasks:
        n_key = f"n/{t}"
        items = [(m, m.get(n_key, 0.0)) for m in parties if m.get(n_key, 0.0) > 0]
        out[n_key] = sum(w for _, w in items)
        for k in ("acc", "loss"):
            vals = [(m[f"{k}/{t}"], w) for m, w in items if math.isfinite(m.get(f"{k}/{t}", math.nan))]
            out[f"{k}/{t}"] = sum(v * w for v, w in vals) / sum(w for _, w in vals) if vals else math.nan
    for k in EVAL_ROUTING_KEYS:
        vals = [(m[k], sum(m.get(f"n/{t}", 0.0) for t in tasks)) for m in parties
                if math.isfinite(m.get(k, math.nan))]
        wsum = sum(w for _, w in vals)
        out[k] = sum(v * w for v, w in vals) / wsum if vals and wsum > 0 else math.nan
    return out


def check_update(upd: ModelUpdate, expected: dict[str, tuple[int, ...]]) -> str | None:
    """None if a plaintext update has exactly the trainable tensors, with their shapes, all finite."""
    if set(upd.delta) != set(expected):
        return "update keys do not match the trainable parameters"
    for k, shape in expected.items():
        if tuple(upd.delta[k].shape) != shape:
            return f"update tensor {k!r} has shape {tuple(upd.delta[k].shape)}, expected {shape}"
        if not np.all(np.isfinite(upd.delta[k])):
            return f"update tensor {k!r} contains NaN or Inf"
    return None


class PlaintextAggregator(Aggregator):
    """``privacy.mode = "plaintext"``: a benchmark baseline; the server sees every reply."""

    def collect(self, instr, req):
        self.probes, self._probe = {}, req.probe
        if req.sum == "update":
            return self.updates(instr, req.kind, req.release, req.event)
        if req.sum == "stats":
            return self.router_stats(instr, (self.co.mspec.num_moe_layers, self.co.mspec.num_experts), req.label)
        if req.sum == "eval":
            return self.evaluation(instr, tuple(instr.tasks))
        raise ValueError(f"unknown sum {req.sum!r} (one of {', '.join(SUMS)})")

    def _ask(self, instr: object, expected: type, phase: str) -> tuple[dict, dict, int]:
        co = self.co
        nodes = self.nodes()
        replies, errors = self.transport.exchange({n: instr for n in nodes}, expected, co.cfg.federation.round_timeout,
                                                rnd=co.s.round, phase=phase, probe=self._probe)
        self.probes = {n: r.probe for n, r in replies.items() if r.probe is not None}  # whatever the sum's fate
        return replies, errors, len(nodes)

    def _release(self, phase: str, release: str, total: np.ndarray, included: list[str], **info) -> None:
        self.guard.log_release(rnd=self.co.s.round, phase=phase, release=release, total=total, dp=None,
                                  info={"mode": "plaintext", "release": release, "included": sorted(included),
                                        "dropped": [], "responders": [], **info})

    def updates(self, instr, kind, release, event):
        co = self.co
        replies, errors, n_nodes = self._ask(instr, ModelUpdate, kind)
        shapes = dict(co.tspec.shapes)
        for node, upd in list(replies.items()):
            problem = check_update(upd, shapes)
            if problem:
                errors[node] = problem
                del replies[node]
        rejected = divergent_updates({nd: u.delta for nd, u in replies.items()}, co.cfg.federation.max_norm_ratio)
        for node, problem in rejected.items():
            errors[node] = problem
            del replies[node]
        co.report_errors(event["phase_label"], errors)
        for upd in replies.values():
            co.metrics.append({**event, "party": upd.party, "num_examples": upd.num_examples, **upd.metrics})
        avg = weighted_average([(u.delta, float(u.num_examples)) for u in replies.values()])
        if avg is None:
            return Skip(f"no usable update ({len(errors)} errors): model unchanged")
        self._release(kind, "model-update", np.concatenate([a.ravel() for a in avg.values()]),
                      [u.party for u in replies.values()],
                      rejected={self.guard.peer(nd): why for nd, why in rejected.items()})
        metrics = weighted_metrics([(u.metrics, u.num_examples) for u in replies.values() if u.num_examples > 0])
        # the secure release's figures, computed the same way: each contributor's value clipped, uniform mean
        slots = TM.slots_for(TM.objective_of(kind, getattr(instr, "objective", None)), co.cfg.privacy.metric_loss_bound)
        metrics.update(TM.plain_means([u.metrics for u in replies.values() if u.num_examples > 0], slots))
        return UpdateSum(avg, metrics, sum(u.num_examples for u in replies.values()), len(replies), n_nodes)

    def router_stats(self, instr, shape, label):
        co = self.co
        replies, errors, n_nodes = self._ask(instr, RouterStats, "stats")
        good = []
        for node, st in replies.items():
            if tuple(st.sums.shape) != shape:
                errors[node] = f"router statistics have shape {tuple(st.sums.shape)}, expected {shape}"
            else:
                good.append(st.sums)
        co.report_errors(label, errors)
        if not good:
            return Skip("no usable router statistics: anchor unchanged", failed=False)
        total = np.sum(good, axis=0)  # [L, E]
        self._release("stats", "router-stats", total, [self.guard.peer(nd) for nd in replies],
                      layers=shape[0], experts=shape[1])
        return StatsSum(total, len(good), n_nodes, "no DP (plaintext baseline)")

    def evaluation(self, instr, tasks):
        co = self.co
        replies, errors, n_nodes = self._ask(instr, EvalReply, "eval")
        co.report_errors("eval", errors)
        if not replies:
            return Skip("no evaluation replies", failed=False)
        per_party = {r.party: dict(r.metrics) for r in replies.values()}
        agg = aggregate_eval(list(per_party.values()), tasks)
        self._release("eval", "eval", np.zeros(1), list(per_party))
        return EvalSum({**per_party, "all": agg}, len(replies), n_nodes)
