"""The ``sft`` phase: local supervised tuning at every party, then the aggregated update.

``configure`` starts a new task when the phase's task changes (the model and evaluation before it are
kept for retention; with ``retention.expand-experts`` a task not trained before first grows the model,
``coordinator/expand.py``) and sends the global weights with the router anchor when one exists and
``routing.anchor-kl-coef`` > 0 (the party's loss is then task loss + aux load balance + anchor KL:
``docs/algorithms.md``), and the retention fields (``coordinator/retention.py``). ``aggregate`` adds the
aggregated update to the global model.

Must not: import ``flwr``, or see one party's update.
"""

from __future__ import annotations

import math

from distmoe.coordinator import expand
from distmoe.coordinator.phases.update import apply_update, released
from distmoe.coordinator.retention import anchor_version, sends_latest_anchor, sft_fields
from distmoe.wire.schema import SftInstruction


def configure(co, phase) -> SftInstruction:
    s, cfg = co.s, co.cfg
    if phase.task != s.current_task:
        if expand.due(co, phase.task):  # retention.expand-experts: a new task grows the model first
            co.say(f"round {s.round}: " + expand.expand(co, phase.task))
        s.begin_task(phase.task)
    use_anchor = s.anchor is not None and cfg.routing.anchor_kl_coef > 0 and sends_latest_anchor(co)
    return SftInstruction(round=s.round, task=phase.task, weights=co.np_weights(s.weights),
                          base_hash=co.tspec.base_hash, seed=cfg.run.seed * 100_003 + s.round,
                          anchor=s.anchor.probs if use_anchor else None,
                          anchor_version=anchor_version(co, phase.task, use_anchor), **sft_fields(co, phase))


def aggregate(co, index, phase, instr: SftInstruction) -> str:
    event = co.event("train", index, phase, anchor_version=instr.anchor_version)
    out = apply_update(co, co.aggregator.updates(instr, "sft", "model-update", event), event)
    if isinstance(out, str):
        return out
    agg = out.metrics
    kl = (f", anchor KL {agg['anchor_kl']:.4f}" if instr.anchor is not None
          and math.isfinite(agg.get("anchor_kl", math.nan)) else "")
    if co.cfg.privacy.secure:  # the training-metric slots' means over the contributors, and the skipped-step sum
        skipped = agg.get("skipped_steps", math.nan)  # the secure sum's one stability count (no update noise)
        return (contributors(out) + " | "
                + released(agg, out.noise, (("task_loss", "task loss", ".3f"), ("dpo_margin", "margin", ".3f"),
                                 ("dpo_acc", "pref. acc", ".3f")))
                + (f" | skipped NaN/Inf steps {int(skipped)}" if math.isfinite(skipped) and skipped > 0 else ""))
    return (f"{out.parties}/{out.nodes} parties | task loss {agg['loss_first']:.3f} -> "
            f"{agg['loss_last']:.3f}{kl} | skipped steps {int(agg['skipped_steps'])}")


def contributors(out) -> str:
    """``3/3 parties``, or ``3/3 parties, 2 with data`` when not every answering party contributed."""
    text = f"{out.parties}/{out.nodes} parties"
    return text if out.num_examples == out.parties else f"{text}, {out.num_examples} with data"
