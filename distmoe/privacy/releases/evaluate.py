"""The ``eval`` release: one party's per-task evaluation sums (correct, loss, count per task) with its distributed
Skellam noise share, masked into one secure sum; no routing metric is released.

Owns, for both sides:
- the spec (``spec``, over ``distmoe.privacy.metric_noise.EvalSpec``: ``3T`` integer sums, their bounds and noise,
  for ``n`` parties and threshold ``t``; the one place both sides build it);
- the party's encoding (``encode``: the sums of its per-example scores, charged at ``t`` survivors before its
  share is drawn);
- the coordinator's opening (``prepare``): the DP event at ``n_active`` survivors, the bound check
  (``EvalSpec.problem``), the decoding to accuracy and loss per task with each figure's noise scale
  (``with_noise_scale``), the ledger entry's DP facts, and the noise scale ``run.json`` records
  (``privacy.eval_noise_sd``).

Must not: import torch or ``flwr``, or see one party's figures on the coordinator's side (only the sum).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from distmoe.config import PrivacyConfig
from distmoe.privacy.accountant import PrivacyEvent
from distmoe.privacy.metric_noise import EvalSpec
from distmoe.privacy.releases.base import EvalSum, Opened, Prepared, ServerFacts, Skip

UNCHANGED = "no evaluation"


# ------------------------------------------------------------------------------------------------------ both sides
def spec(p: PrivacyConfig, examples_max: int, tasks: tuple[str, ...], n_parties: int, threshold: int) -> EvalSpec:
    """The calibration of one evaluation release (over-provisioned for ``n - t`` dropouts), checked to fit Z_2^64.
    ``p``: the run's (or party's own) ``PrivacyConfig``; ``examples_max``: ``data.max-eval-examples`` (the layout
    length, 3 per task, does not depend on it or on the noise)."""
    out = EvalSpec(tuple(tasks), p.metric_noise_multiplier, n_parties, n_parties - threshold, examples_max,
                   p.metric_loss_bound)
    out.check_fits_ring64()
    return out


# ---------------------------------------------------------------------------------------------- the party's side
def encode(spec: EvalSpec, scores, charge: Callable[[PrivacyEvent], float], t: int, rnd: int,
           budget: float) -> tuple[np.ndarray, dict, bool]:
    """``(vector [3T] uint64 with the Skellam share, the ledger's DP facts, contributed)``: per-example sums of
    each task, charged at ``t`` survivors before anything is sent."""
    sums = spec.sums(scores)  # [3T] int64
    eps = charge(spec.event(t, f"eval round {rnd}"))
    vec = spec.share(sums)  # [3T] uint64
    contributed = bool(sums[2::3].sum() > 0)  # evaluated any held-out sequence (count slots, before noise)
    return vec, {**spec.dp_params(t), "epsilon": eps, "budget": budget}, contributed


# ---------------------------------------------------------------------------------------- the coordinator's side
def prepare(f: ServerFacts, kind: str, release: str, instr: object) -> Prepared:
    tasks = tuple(instr.tasks)
    sp = spec(f.privacy, f.max_eval_examples, tasks, f.n, f.t)

    def event_at(n_active: int) -> PrivacyEvent:
        return sp.event(n_active, f"eval round {f.rnd}")

    def open_(res) -> Opened:
        problem = sp.problem(res.total, len(res.included))
        dp, info = sp.dp_params(res.n_active), {"tasks": list(tasks)}
        if problem is not None:
            return Opened(Skip(f"aggregate rejected ({problem}): {UNCHANGED}"), dp, problem, info)
        sd = sp.aggregate_sigma(f.n) / sp.scale  # noise of each sum, in examples (full roster)
        return Opened(EvalSum({"all": with_noise_scale(sp, sp.decode(res.total), res.n_active)},
                              len(res.included), f.n), dp, None, info, privacy={"eval_noise_sd": sd})

    return Prepared(sp.length, 64, event_at, open_)


def with_noise_scale(spec, decoded: dict[str, float], n_active: int) -> dict[str, float]:
    """``decoded`` plus each figure's noise scale (one standard deviation, first-order in the noisy sums):
    ``acc_sd/<t>`` and ``loss_sd/<t>``. Each of a task's three sums carries Skellam noise of ``sigma`` ring
    units, i.e. ``sigma / s`` examples; a ratio ``r = a / n`` of two noisy sums then has
    ``sd(r) ~= (sigma / s) * sqrt(1 + r^2) / n`` (the loss in units of its bound ``B``)."""
    sd = spec.aggregate_sigma(n_active) / spec.scale
    out = dict(decoded)
    for t in spec.tasks:
        n = decoded.get(f"n/{t}", 0.0)
        acc, loss = decoded.get(f"acc/{t}", math.nan), decoded.get(f"loss/{t}", math.nan)
        ok = n >= 0.5 and math.isfinite(acc)
        out[f"acc_sd/{t}"] = sd * math.sqrt(1 + acc * acc) / n if ok else math.nan
        r = loss / spec.loss_bound if math.isfinite(loss) else 0.0
        out[f"loss_sd/{t}"] = spec.loss_bound * sd * math.sqrt(1 + r * r) / n if ok else math.nan
    return out
