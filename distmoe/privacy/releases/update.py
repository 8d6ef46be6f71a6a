"""The ``model-update`` / ``rl-update`` release: one party's clipped model update with its training-metric slots
(``distmoe.privacy.train_metrics``), masked into one secure sum.

Owns, for both sides:
- the layout (``layout``): the public ``UpdateLayout`` of the trainable shapes for ``n`` parties, clip ``C``,
  ring ``Z_2^bits``, with the objective's metric slots in its last words;
- the party's encoding (``encode``: the update clipped and fixed-point encoded, uniform weight 1, the skipped-step
  count, each metric clipped to its public bound) and its client-level Gaussian noise (``add_noise``: charged at
  ``t`` survivors before anything is drawn; ``distmoe.privacy.update_noise``);
- the coordinator's opening (``prepare``): the DP event at ``n_active`` survivors, the decoding to the mean update
  over the securely counted contributors, the bound checks on the decoded sum (``distmoe.aggregate.aggregate_problem``:
  a sum no honest set of parties can produce is rejected and not applied; the skipped-step count within
  ``[0, included x SKIPPED_MAX]``; every metric slot within its bound) and the ledger entry's DP facts.

Must not: import torch or ``flwr``, or see one party's update on the coordinator's side (only the sum).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from distmoe.aggregate import aggregate_problem
from distmoe.privacy import train_metrics as TM
from distmoe.privacy.accountant import PrivacyEvent
from distmoe.privacy.releases.base import Opened, Prepared, ServerFacts, Skip, UpdateSum
from distmoe.privacy.update_noise import add_update_noise, update_dp_facts, update_event
from distmoe.privacy.vectors import SKIPPED_MAX, UpdateLayout

UNCHANGED = "model unchanged"


def layout(p, shapes, n: int, t: int, z_u: float, objective: str) -> tuple[UpdateLayout, tuple]:
    """The release's public layout and metric slots (``p``: the run's ``PrivacyConfig``; ``objective``: ``sft``,
    ``dpo`` or ``rl``)."""
    base = UpdateLayout.build(shapes, n, p.update_clip, private=z_u > 0, noise_multiplier=z_u, threshold=t,
                              ring=p.ring_bits)
    return TM.release_layout(base, objective, p.metric_loss_bound, p.update_metric_share)


# ---------------------------------------------------------------------------------------------- the party's side
def encode(lay: UpdateLayout, slots, delta: Mapping[str, np.ndarray], num_examples: int,
           metrics: Mapping[str, float]) -> tuple[np.ndarray, dict, dict, bool]:
    """``(vector [D], encoding facts, the released metric values, contributed)``: the update clipped and encoded,
    the skipped-step count, the metric slots (each figure clipped to its bound)."""
    vec, facts = lay.encode(delta, num_examples)
    skipped = metrics.get("skipped_steps", 0.0)  # NaN for a party without data for the task
    vec = lay.count_skipped(vec, int(skipped) if skipped == skipped else 0, inplace=True)
    contributed = num_examples > 0  # any of this party's examples went into the update
    sent = TM.encode_into(vec, lay, slots, metrics, contributed)
    return vec, facts, sent, contributed


def add_noise(lay: UpdateLayout, vec: np.ndarray, z_u: float, n: int, t: int, charge: Callable[[PrivacyEvent], float],
              rnd: int, budget: float) -> tuple[np.ndarray, dict]:
    """Client-level DP: charge ``z_u`` at ``t`` survivors (per sequence ``z_u / 2``), then add this party's
    Gaussian share; ``(noised vector, the ledger's DP facts)``."""
    if not lay.private:
        raise ValueError("update noise requested on a non-private layout (weights would leave exact)")
    eps = charge(update_event(z_u, t, t, f"model-update round {rnd}"))
    vec = add_update_noise(vec, lay, z_u, t)
    return vec, {**update_dp_facts(lay, z_u, n, t), "epsilon": eps, "budget": budget}


# ---------------------------------------------------------------------------------------- the coordinator's side
def prepare(f: ServerFacts, kind: str, release: str, instr: object) -> Prepared:
    """The coordinator's view of this round's update release: its length and ring, the DP event at ``n_active``
    survivors (None without update noise), and ``open(secure_sum) -> Opened``."""
    p, n, t, z_u = f.privacy, f.n, f.t, f.plan.update_noise_multiplier
    lay, slots = layout(p, f.shapes, n, t, z_u, TM.objective_of(kind, getattr(instr, "objective", None)))

    def event_at(n_active: int) -> PrivacyEvent:  # n_active >= t survivors, per sequence (z_u/2 at t)
        return update_event(z_u, n_active, t, f"{release} round {f.rnd}")

    def open_(res) -> Opened:
        avg, weight = lay.decode(res.total)
        problem = aggregate_problem(lay, avg, weight, len(res.included), z_u, t)
        skipped = lay.decode_skipped(res.total)  # the one stability count (None with update noise)
        if problem is None and skipped is not None and not 0 <= skipped <= len(res.included) * SKIPPED_MAX:
            problem = f"skipped-step count {skipped:.6g} outside [0, {len(res.included)} x {SKIPPED_MAX}]"
        sigma = TM.noise_std(lay, z_u, res.n_active, t)  # the update noise on each metric word (0 without)
        means, stds, slot_problem = TM.decode(res.total, lay, slots, res.contributors, len(res.included), sigma)
        problem = problem or slot_problem  # a slot no honest contributors can produce: the sum is not applied
        dp = update_dp_facts(lay, z_u, n, t, res.n_active) if z_u > 0 else None
        info = dict(weight_sum=weight, frac_bits=lay.frac_bits, ring_bits=lay.bits, contributors=res.contributors,
                    metric_slots=[[s.key, s.lo, s.hi] for s in slots])
        if problem is not None:
            return Opened(Skip(f"aggregate rejected ({problem}): {UNCHANGED}"), dp, problem, info)
        if avg is None:
            return Opened(Skip(f"{len(res.included)} parties, total weight 0 (no data for task {instr.task!r}): "
                               f"{UNCHANGED}", failed=False), dp, None, info)
        metrics = {} if skipped is None else {"skipped_steps": skipped}
        metrics.update(means)  # the training-metric slots: means over the contributors (noised with update noise)
        return Opened(UpdateSum(avg, metrics, int(round(weight)), len(res.included), n, noise=stds,
                                          uniform=True), dp, None, info)

    return Prepared(lay.length, lay.bits, event_at if z_u > 0 else None, open_)
