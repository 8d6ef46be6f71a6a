"""The routing probe after a round: every party measures the round's global model on the public probe prompts,
the coordinator takes the median and derives the routing metrics, and the routing-health watch warns.

Not a schedule phase: the loop runs it at the end of every ``routing.probe-every``-th round, whatever its
phase, with the global model as it stands then (what the next round's instruction carries). The probe prompts are
public (``distmoe.routing.probe``: the default set from ``run.seed``, or ``routing.probe-path``, read and validated
here and sent in the instruction); each party answers with ``(R [L, E], T [L, N])`` in the clear, a deterministic
function of public inputs (``docs/privacy.md`` §3). The element-wise median of the replies is used, and a party
whose reply disagrees with it is named in a warning (once per party): a wrong reply can only skew diagnostics,
and the median bounds that to a minority of parties.

Writes one ``probe`` row per probe to ``metrics.jsonl`` (``routing_kl``, ``load_cv``, ``top1_consistency``,
``expert_counts``) and a ``routing_warning`` row per health warning (``distmoe.routing.health``), which also
goes to ``run.json`` ``warnings`` and the progress stream. A probe that gets no usable reply is a warning too;
it never fails a round or the run. After a resume the top-1 consistency and the KL-rise count start afresh.

The round loop does the exchange: ``instruction`` (None when no probe is due) goes to every party, and ``apply``
combines the replies. A probe due on a model the last probe already measured (after a ``stats`` or ``eval`` round,
which change no weight) is not sent again (``repeat``): the replies are a deterministic function of the public
prompts, the base and the weights, all unchanged, so the last probe's median stands for it and its metrics are
recomputed against the anchor of now; in a deployment that saves one message stage per such round. A party that
joined since the last probe is probed at the next change of the weights.

The probe of a training round's model rides on the next round's instruction (``defer`` at the end of the round,
``carry`` at the next): that instruction carries exactly those global weights anyway, so it also carries the probe
request (the public prompts, ``probe``), each party answers the probe on the received weights before its local work,
beside its reply (``schema.ProbePart``, in the clear in both modes, checked by both guards), and ``apply_carried``
records it as the earlier round's probe, before the next round's sum is folded in. In a deployment that saves one
message stage per training round. The probe is exchanged on its own (``instruction``, ``apply``) after the last
round, before a round that grows the model (``retention.expand-experts``), or when the next round's instruction
does not carry the same weights (``pending_instruction``, ``apply_pending``); ``resume_pending`` carries, after a
resume, the probe of the checkpointed round when ``metrics.jsonl`` holds none.

Must not: import ``flwr``, talk to a party, read party data, or change the model or the anchor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from distmoe.coordinator.context import RunContext
from distmoe.coordinator.errors import RunFailed
from distmoe.coordinator.state import RoundState
from distmoe.model.build import hash_tensors
from distmoe.routing.probe import ProbeError, combine, default_probe_prompts, probe_metrics, read_probe_file
from distmoe.rundir.metrics import read_metrics
from distmoe.wire.allow_list import ProbeBounds
from distmoe.wire.schema import CARRIED_BY, ProbeInstruction, ProbePart, ProbeReply

REPLY = ProbeReply  # what each party answers


def prompts_for(cfg) -> tuple[str, ...]:
    """The run's probe prompts (empty when ``routing.probe-every = 0``); ``RunFailed`` naming the file and line."""
    r = cfg.routing
    if r.probe_every <= 0:
        return ()
    try:
        return read_probe_file(r.probe_path) if r.probe_path else default_probe_prompts(cfg.run.seed, r.probe_prompts)
    except ProbeError as exc:
        raise RunFailed(f"config key 'routing.probe-path': {exc}") from None


@dataclass(frozen=True)
class Measured:
    """What one probe measures and where its row goes: the global model after ``round`` (its weights: the round
    state's dict, never changed in place) with the anchor of then, keyed by the base and the weights' hash."""

    round: int
    phase_label: str
    anchor: object  # RoundAnchor | None
    weights: dict
    key: str


def _now(co: RunContext, label: str | None = None) -> Measured:
    s = co.s
    return Measured(s.round, co.phase_label if label is None else label, s.anchor, s.weights, _measured(co))


def _usable(rep, layers: int, experts: int) -> bool:
    r, t = np.asarray(rep.routing), np.asarray(rep.top1)
    return (r.shape == (layers, experts) and t.ndim == 2 and t.shape[0] == layers and t.shape[1] > 0
            and bool(np.all((t >= 0) & (t < experts))))


def instruction(co: RunContext) -> ProbeInstruction | None:
    """The probe of the global model after round ``co.s.round``; None when it is not due."""
    s = co.s
    if not _due(co):
        return None
    return ProbeInstruction(round=s.round, base_hash=co.tspec.base_hash, prompts=co.probe_prompts,
                            weights=co.np_weights(s.weights))


def _measured(co: RunContext) -> str:
    """What a probe of the model now measures: the base and the global weights (the prompts are the run's). The
    weights' hash is kept for the very dict it hashed (a round state's dict is never changed in place, as
    ``carry`` relies on too): the end of a round asks twice (``repeat``, ``defer``), 28.5 MB hashed once."""
    w, base = co.s.weights, co.tspec.base_hash
    memo = co.probe_key_memo
    if memo is None or memo[0] is not w or memo[1] != base:
        memo = co.probe_key_memo = (w, base, f"{base}:{hash_tensors(w)}")
    return memo[2]


def repeat(co: RunContext) -> str | None:
    """A due probe of the model the last probe measured, from that probe's median (its row written again for this
    round, without a top-1 consistency); None when no probe is due or the model changed since (the loop then
    exchanges). Its progress text is only the KL to an anchor built since the last probe: the same load CV again and
    a top-1 consistency of 1 with itself would read as a second, improved probe beside the one the round carried."""
    last = co.probe_last
    if last is None or not _due(co):
        return None
    m = _now(co)
    if last[0] != m.key:
        return None
    _, routing, top1, parties, disagreeing = last
    before = co.probe_anchor_version
    mt = _record(co, m, routing, top1, parties, disagreeing, repeated=True)
    new_anchor = m.anchor is not None and m.anchor.meta.version != before
    return _text(mt, ("routing_kl",)) if new_anchor and math.isfinite(mt["routing_kl"]) else ""


def _due(co: RunContext) -> bool:
    every = co.cfg.routing.probe_every
    return every > 0 and bool(co.probe_prompts) and co.s.round % every == 0


def defer(co: RunContext, next_keeps_weights: bool) -> bool:
    """At the end of a round whose probe is due (and not a ``repeat``): keep it for the next round's instruction
    (True) when that round exists and starts from these weights; False: the loop exchanges it now."""
    if not _due(co) or not next_keeps_weights:
        return False
    co.probe_pending = _now(co)
    return True


def carry(co: RunContext, instr: object) -> tuple[object, ProbeBounds | None]:
    """The round's instruction with the pending probe's request, and the bounds each reply's probe must meet; the
    instruction unchanged and None when no probe is pending, or the instruction does not carry the pending probe's
    weights (the loop then exchanges it on its own first: ``pending_instruction``)."""
    m = co.probe_pending
    if m is None or not isinstance(instr, CARRIED_BY) or co.s.weights is not m.weights:
        return instr, None
    bounds = ProbeBounds(co.mspec.num_moe_layers, co.mspec.num_experts,
                         len(co.probe_prompts) * co.cfg.model.max_seq_len)
    return replace(instr, probe=co.probe_prompts), bounds


def pending_instruction(co: RunContext) -> ProbeInstruction | None:
    """The pending probe as its own instruction (its round, its weights); None when none is pending."""
    m = co.probe_pending
    if m is None:
        return None
    return ProbeInstruction(round=m.round, base_hash=co.tspec.base_hash, prompts=co.probe_prompts,
                            weights=co.np_weights(m.weights))


def apply_pending(co: RunContext, replies: dict[int, object], errors: dict[int, str]) -> str:
    """The pending probe's replies (carried on a phase reply, or from its own exchange) recorded as the probe of its
    round (``Measured``); the text for the progress line of the round that carried it."""
    m, co.probe_pending = co.probe_pending, None
    text = _apply(co, m, replies, errors)
    return text.replace(" | probe: ", f" | probe of round {m.round}: ", 1)


def apply_carried(co: RunContext, parts: dict[int, ProbePart]) -> str:
    """``apply_pending`` on the probes carried on the round's replies (the parties' other errors are the round's)."""
    return apply_pending(co, parts, {})


def resume_pending(co: RunContext, label: str) -> None:
    """After a resume from the checkpoint of round ``co.s.round`` (phase ``label``): its probe, when due and not in
    ``metrics.jsonl`` (the round was checkpointed before the round that would have carried it), is pending again."""
    if co.s.round <= 0 or not _due(co):
        return
    if any(e.get("event") == "probe" and e.get("round") == co.s.round for e in read_metrics(co.files.metrics)):
        return
    co.probe_pending = _now(co, label)


def apply(co: RunContext, replies: dict[int, ProbeReply], errors: dict[int, str]) -> tuple[RoundState, str]:
    """The median of the usable replies, its routing metrics recorded and watched; the round state (unchanged: the
    probe only measures) and the text for the round's progress line."""
    return co.s, _apply(co, _now(co), replies, errors)


def _apply(co: RunContext, m: Measured, replies: dict[int, object], errors: dict[int, str]) -> str:
    L, E = co.mspec.num_moe_layers, co.mspec.num_experts
    co.report_errors("probe", errors)
    got = {co.peer(n): (np.asarray(r.routing, np.float64), np.asarray(r.top1, np.int64))
           for n, r in replies.items() if _usable(r, L, E)}
    bad = sorted(co.peer(n) for n, r in replies.items() if not _usable(r, L, E))
    if not got:
        _warn(co, m.round, "probe", f"round {m.round}: routing probe got no usable reply ({len(errors)} errors)")
        return " | probe: no reply"
    routing, top1, disagree = combine(got)
    for party in sorted(set(disagree + bad) - co.probe_warned):
        co.probe_warned.add(party)
        _warn(co, m.round, "probe", f"round {m.round}: party {party}'s routing probe disagrees with the median of "
                                    f"{len(got)} parties (another device or precision, or a wrong report); the "
                                    "median is used")
    co.probe_last = (m.key, routing, top1, len(got), len(set(disagree + bad)))
    return _text(_record(co, m, routing, top1, len(got), len(set(disagree + bad))))


def _record(co: RunContext, m: Measured, routing: np.ndarray, top1: np.ndarray, parties: int,
            disagreeing: int, repeated: bool = False) -> dict:
    """The probe's metrics row and health watch from the parties' median; returns its metrics (``probe_metrics``).
    ``repeated``: the last probe's median standing for an unchanged model (``repeat``): its row has no top-1
    consistency (a 1 with itself would plot and log, in ``metrics.jsonl``, the report's table and TensorBoard, as an
    improvement)."""
    E, anchor = co.mspec.num_experts, m.anchor
    anchor_version = anchor.meta.version if anchor is not None else 0
    mt = probe_metrics(routing, top1, E, anchor.probs if anchor is not None else None,
                       None if repeated else co.probe_prev_top1)
    co.probe_prev_top1, co.probe_anchor_version = top1, anchor_version
    co.metrics.append({"event": "probe", "round": m.round, "phase_label": m.phase_label, "parties": parties,
                       "disagreeing": disagreeing, "anchor_version": anchor_version,
                       "routing_kl": mt["routing_kl"], "load_cv": mt["load_cv"],
                       "top1_consistency": mt["top1_consistency"], "expert_counts": mt["expert_counts"]})
    for kind, text in co.routing_watch.observe(m.round, mt["load_cv"], mt["routing_kl"], anchor_version):
        _warn(co, m.round, kind, text)
    return mt


_SHOWN = (("routing_kl", "KL", 3), ("load_cv", "load CV", 2), ("top1_consistency", "top-1", 2))


def _text(mt: dict, keys: tuple[str, ...] = tuple(k for k, _, _ in _SHOWN)) -> str:
    """The probe's progress text: each of ``keys`` (in ``_SHOWN``'s order) that is finite, with its name."""
    parts = [f"{name} {mt[k]:.{d}f}" for k, name, d in _SHOWN if k in keys and math.isfinite(mt[k])]
    return " | probe: " + ", ".join(parts)


def _warn(co: RunContext, rnd: int, kind: str, text: str) -> None:
    co.say(f"WARNING: {text}", wrapped=True)
    co.record.append("warnings", text)
    co.metrics.append({"event": "routing_warning", "round": rnd, "kind": kind, "detail": text})
