"""The bias settle after an aggregated update (``routing.balance-settle-steps``): every party settles the routing
bias of the new global model on the public balance prompts, the coordinator takes the element-wise median and
writes it into the global weights before the round's checkpoint.

Why: FedAvg makes the global bias the mean of biases each fitted to one party's weights, not to their mean, and
the per-step bias update trails weights that move at every step (``docs/results.md``, Public balance: settling an
aggregated model's bias on public prompts took the held-out load CV from 0.72 to 0.34 in 12 updates). Settling
the aggregated model fixes the bias to the weights the federation actually holds.

Like the probe (``phases/probe.py``), the exchange carries public inputs only: the global weights down, the settled
bias ``[L, E]`` up in the clear, a deterministic function of them (``distmoe.party.settle``; ``docs/privacy.md``
§3). Honest parties return the same array; the median is theirs when they are a majority. Each reply must also
lie within ``U = sum(u_i)`` of the global bias in every entry (``K`` updates at the schedule's rates ``u_i``,
``model.balance.settle_rates``, can move it no further) and be finite: a reply that does not is unusable, so even a
dishonest majority moves the bias by at most ``U`` per round. A party whose reply is unusable or differs from the
median is named in a warning (once per party). With no usable reply the bias stays as aggregated and the round
goes on (a warning, never a failure).

Writes one ``settle`` row per exchange to ``metrics.jsonl`` (``parties``, ``disagreeing``, ``moved``: the largest
|change| of a bias entry).

The round loop does the exchange: ``instruction`` (None when no settle is due) goes to every party, and ``apply``
returns the round state with the replies folded into the global weights.

Must not: import ``flwr``, talk to a party, read party data, or change any weight but the routing bias.
"""

from __future__ import annotations

import numpy as np
import torch

from distmoe.coordinator.context import RunContext
from distmoe.coordinator.state import RoundState
from distmoe.model.balance import BIAS_NAMES, settle_rates
from distmoe.wire.schema import SettleInstruction, SettleReply

REPLY = SettleReply  # what each party answers

DISAGREE_TOL = 1e-5  # max |b_party - b_median| above which a party's settled bias disagrees


def bias_keys(weights: dict) -> list[str]:
    """The routing bias entries of the global weights, in MoE-layer order (the trainable spec's order)."""
    return [k for k in weights if k.rsplit(".", 1)[-1] in BIAS_NAMES]


def move_bound(routing) -> float:
    """``U``: the most ``K`` settle updates at the schedule's rates move a bias entry (``routing``: the run's
    ``RoutingConfig``), with room for float32 rounding."""
    u = sum(settle_rates(routing.balance_settle_steps, routing.balance_settle_rate, routing.balance_settle_schedule))
    return u * (1 + 1e-6) + 1e-6


def usable(bias: np.ndarray, current: np.ndarray, bound: float) -> bool:
    """A settled bias of the global bias's shape, finite, within ``bound`` of it in every entry."""
    b = np.asarray(bias)
    return (b.shape == current.shape and bool(np.isfinite(b).all())
            and float(np.abs(b - current).max(initial=0.0)) <= bound)


def _keys(co: RunContext) -> list[str]:
    return bias_keys(co.s.weights) if co.cfg.routing.balance_settle_steps > 0 else []


def instruction(co: RunContext) -> SettleInstruction | None:
    """The settle request after round ``co.s.round``'s applied update; None when no settle is configured (or the
    model has no routing bias)."""
    s = co.s
    if not _keys(co):
        return None
    return SettleInstruction(round=s.round, base_hash=co.tspec.base_hash, weights=co.np_weights(s.weights))


def apply(co: RunContext, replies: dict[int, SettleReply], errors: dict[int, str]) -> tuple[RoundState, str]:
    """The round state with the median of the usable settled biases in its global weights; recorded. Returns it and
    ``""`` (the settle adds nothing to the round's line)."""
    s, keys = co.s, _keys(co)
    current = np.stack([s.weights[k].detach().double().cpu().numpy() for k in keys])  # [L, E]
    bound = move_bound(co.cfg.routing)
    co.report_errors("settle", errors)
    ok = {co.peer(n): usable(rep.bias, current, bound) for n, rep in replies.items()}
    got = {co.peer(n): np.asarray(rep.bias, np.float64) for n, rep in replies.items() if ok[co.peer(n)]}
    bad = sorted(p for p, good in ok.items() if not good)
    if not got:
        _warn(co, f"round {s.round}: bias settle got no usable reply ({len(errors)} errors, {len(bad)} unusable); "
                  "the bias stays as aggregated")
        return s, ""
    med = np.median(np.stack(list(got.values())), 0)  # [L, E]
    disagree = sorted(p for p, b in got.items() if float(np.abs(b - med).max()) > DISAGREE_TOL)
    for party in sorted(set(disagree + bad) - co.settle_warned):
        co.settle_warned.add(party)
        _warn(co, f"round {s.round}: party {party}'s settled routing bias is unusable or disagrees with the median "
                  f"of {len(got)} parties (another device or precision, or a wrong report); the median is used")
    settled = {k: torch.from_numpy(row.astype(np.float32)) for k, row in zip(keys, med, strict=True)}
    moved = float(np.abs(med - current).max())
    co.metrics.append({"event": "settle", "round": s.round, "phase_label": co.phase_label, "parties": len(got),
                       "disagreeing": len(set(disagree + bad)), "moved": moved})
    return s.with_weights(settled), ""


def _warn(co: RunContext, text: str) -> None:
    co.say(f"WARNING: {text}", wrapped=True)
    co.record.append("warnings", text)
    co.metrics.append({"event": "routing_warning", "round": co.s.round, "kind": "settle", "detail": text})
