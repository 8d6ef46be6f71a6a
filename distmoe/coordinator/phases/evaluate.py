"""The ``eval`` phase: held-out accuracy and loss of every task trained so far, and retention.

Retention of an earlier task ``t`` is ``acc/t now / acc/t before the current task started`` (the
baseline kept when the task began), reported for the aggregate and, in the plaintext baseline, per party;
undefined when the earlier accuracy is within its noise scale of 0 (``acc_sd/t``, secure aggregation), since a ratio
to noise says nothing: ``retention/t`` is then ``null`` in ``metrics.jsonl`` and the round line and the report say
``n/a (earlier accuracy within noise)`` (``report.progress.RETENTION_NA``). Where the accuracy now is within its
noise of 0, so is the retention: it reads ``≈ 0 (within noise)``. Noised accuracies print with their noise scale.

Must not: import ``flwr``, or see one party's figures under secure aggregation.
"""

from __future__ import annotations

import math
from dataclasses import replace

from distmoe.config import Phase
from distmoe.coordinator.aggregator import EvalSum, SumRequest
from distmoe.coordinator.context import RunContext
from distmoe.coordinator.phases.base import PhaseStep
from distmoe.coordinator.state import RoundState
from distmoe.report.progress import RETENTION_NA, noisy, within_noise
from distmoe.wire.schema import EVAL_ROUTING_KEYS, EvalInstruction

NOISE_KEYS = ("acc_sd/", "loss_sd/")  # in memory (progress line, retention); not metrics.jsonl keys


class Evaluate(PhaseStep):
    kind = "eval"

    def configure(self, co: RunContext, phase: Phase) -> EvalInstruction:
        """Under secure aggregation a party releases only its per-example scores of ``weights``
        (``party.work.eval_scores``), so the reference model and the anchor, which only the plaintext routing
        figures use, are not sent: the reference model would be a second copy of the model on the wire."""
        s = co.s
        tasks = tuple(s.trained_tasks) or co.cfg.schedule.tasks
        routing = not co.cfg.privacy.secure  # the routing figures against the reference and the anchor
        return EvalInstruction(round=s.round, tasks=tasks, new_task=s.current_task or "",
                               weights=co.np_weights(s.weights), base_hash=co.tspec.base_hash,
                               ref_weights=(co.np_weights(s.ref_weights) if routing and s.ref_weights is not None
                                            else None),
                               anchor=s.anchor.probs if routing and s.anchor is not None else None,
                               anchor_version=s.anchor.meta.version if s.anchor is not None else 0)

    def request(self, co: RunContext, index: int, phase: Phase, instr: EvalInstruction) -> SumRequest:
        return SumRequest("eval", "eval", "eval", "eval")

    def aggregate(self, co: RunContext, index: int, phase: Phase, instr: EvalInstruction, out: EvalSum
                  ) -> tuple[RoundState, str]:
        s = co.s
        per_party = {p: dict(m) for p, m in out.per_party.items()}  # the retention figures added to a copy
        agg = per_party["all"]
        earlier = [t for t in s.trained_tasks if t != s.current_task]
        for party, m in per_party.items():
            before = s.baseline.get(party, {})
            for t in earlier:
                acc, sd = before.get(f"acc/{t}", math.nan), before.get(f"acc_sd/{t}", math.nan)
                r = retention(acc, sd, m.get(f"acc/{t}", math.nan))
                if r is not None or (math.isfinite(acc) and within_noise(acc, sd)):
                    m[f"retention/{t}"] = r  # None: undefined, the earlier accuracy was noise (RETENTION_NA)
            if s.current_task:
                m["new_task"] = s.current_task
                m["new_task_loss"] = m.get(f"loss/{s.current_task}", math.nan)
            co.metrics.append({"event": "eval", "round": s.round, "phase_label": "eval", "party": party,  # noise
                               "anchor_version": instr.anchor_version,  # scales: run.json privacy.eval_noise_sd
                               **{k: v for k, v in m.items() if not k.startswith(NOISE_KEYS)}})
        last_eval = {p: {k: v for k, v in m.items() if isinstance(v, float)} for p, m in per_party.items()}
        accs = ", ".join(f"{t} {noisy(agg.get(f'acc/{t}', math.nan), agg.get(f'acc_sd/{t}', math.nan))}"
                         for t in instr.tasks)
        extra = [f"{k} {agg[k]:.3f}" for k in EVAL_ROUTING_KEYS if math.isfinite(agg.get(k, math.nan))]
        ret = [f"retention {t} {_retention_text(agg, t)}" for t in earlier if f"retention/{t}" in agg]
        return replace(s, last_eval=last_eval), " | ".join([f"{out.parties}/{out.nodes} parties", f"acc: {accs}",
                                                            *extra, *ret])


def _retention_text(agg: dict, t: str) -> str:
    """The round line's retention of ``t``: ``RETENTION_NA`` when undefined (the earlier accuracy was noise),
    ``≈ 0 (within noise)`` when the accuracy now is within its noise of 0, else the ratio."""
    r = agg[f"retention/{t}"]
    if r is None:
        return RETENTION_NA
    return "≈ 0 (within noise)" if within_noise(agg.get(f"acc/{t}", math.nan), agg.get(f"acc_sd/{t}", math.nan)) \
        else f"{r:.2f}"


def retention(before: float, before_sd: float, now: float) -> float | None:
    """``now / before``; None (undefined) when either is missing, ``before`` is 0, or ``before`` is within its
    noise scale ``before_sd`` of 0 (a ratio to noise says nothing)."""
    if not (math.isfinite(before) and math.isfinite(now)) or before <= 0 or within_noise(before, before_sd):
        return None
    return now / before
