"""The ``eval`` phase: held-out accuracy and loss of every task trained so far, and retention.

Retention of an earlier task ``t`` is ``acc/t now / acc/t before the current task started`` (the
baseline kept when the task began), reported for the aggregate and, in the plaintext baseline, per party.

Must not: import ``flwr``, or see one party's figures under secure aggregation.
"""

from __future__ import annotations

import math

from distmoe.coordinator.aggregator import Skip
from distmoe.wire.schema import EVAL_ROUTING_KEYS, EvalInstruction


def configure(co, phase) -> EvalInstruction:
    s = co.s
    tasks = tuple(s.trained_tasks) or co.cfg.schedule.tasks
    return EvalInstruction(round=s.round, tasks=tasks, new_task=s.current_task or "",
                           weights=co.np_weights(s.weights), base_hash=co.tspec.base_hash,
                           ref_weights=co.np_weights(s.ref_weights) if s.ref_weights is not None else None,
                           anchor=s.anchor.probs if s.anchor is not None else None,
                           anchor_version=s.anchor.meta.version if s.anchor is not None else 0)


def aggregate(co, index, phase, instr: EvalInstruction) -> str:
    s = co.s
    out = co.aggregator.evaluation(instr, instr.tasks)
    if isinstance(out, Skip):
        return co.round_failed(out.text, failed=out.failed)
    per_party, agg = out.per_party, out.per_party["all"]
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
        co.metrics.append({"event": "eval", "round": s.round, "phase_label": "eval", "party": party,
                           "anchor_version": instr.anchor_version, **m})
    s.last_eval = {p: {k: v for k, v in m.items() if isinstance(v, float)} for p, m in per_party.items()}
    accs = ", ".join(f"{t} {agg.get(f'acc/{t}', math.nan):.2f}" for t in instr.tasks)
    extra = [f"{k} {agg[k]:.3f}" for k in EVAL_ROUTING_KEYS if math.isfinite(agg.get(k, math.nan))]
    ret = [f"retention {t} {agg[f'retention/{t}']:.2f}" for t in earlier if f"retention/{t}" in agg]
    return f"{out.parties}/{out.nodes} parties | acc: {accs} | " + " | ".join(extra + ret)
