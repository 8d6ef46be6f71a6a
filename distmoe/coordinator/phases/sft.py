"""The ``sft`` phase: local supervised tuning at every party, then the aggregated update.

``begin`` starts a new task when the phase's task changes (the model and evaluation before it are
kept for retention; with ``retention.expand-experts`` a task not trained before first grows the model,
``coordinator/expand.py``); ``configure`` sends the global weights with the router anchor when one exists and
``routing.anchor-kl-coef`` > 0 (the party's loss is then task loss + aux load balance + anchor KL:
``docs/algorithms.md``), and the retention fields (``coordinator/retention.py``). ``aggregate`` returns the round
state with the aggregated update added to the global model (``dpo`` shares it).

Must not: import ``flwr``, or see one party's update.
"""

from __future__ import annotations

import math
from dataclasses import replace

from distmoe.config import Phase
from distmoe.coordinator import expand
from distmoe.coordinator.aggregator import SumRequest, UpdateSum
from distmoe.coordinator.context import RunContext
from distmoe.coordinator.phases.base import PhaseStep
from distmoe.coordinator.phases.update import apply_update, contributors, released
from distmoe.coordinator.retention import anchor_version, sends_latest_anchor, sft_fields
from distmoe.coordinator.state import RoundState
from distmoe.wire.schema import SftInstruction


def grow_for(co: RunContext, task: str) -> RoundState:
    """``retention.expand-experts``: adopt the grown model (``coordinator/expand.py``) before ``task`` begins; the
    round state of the grown model."""
    e = expand.expand(co.cfg, co.model, co.s, task)
    co.model = e.model
    s = replace(co.s, weights=e.model.weights, anchor=e.anchor, task_anchors=e.task_anchors,
                expansions=[*co.s.expansions, e.record])
    co.metrics.append({"event": "expand", **e.record})
    co.record.update(model={**(co.record.get("model") or {}), "router_spec": co.mspec.router_spec(),
                            "trainable_numel": co.tspec.numel})
    co.say(f"round {co.s.round}: " + e.note)
    return s


class Sft(PhaseStep):
    kind = "sft"
    updates_model = True

    def begin(self, co: RunContext, phase: Phase) -> RoundState:
        s = co.s
        if phase.task == s.current_task:
            return s
        if expand.due(co.cfg, s, phase.task):  # retention.expand-experts: a new task grows the model first
            s = grow_for(co, phase.task)
        return s.begin_task(phase.task)

    def keeps_weights(self, co: RunContext, phase: Phase) -> bool:
        s = co.s
        return phase.task == s.current_task or not expand.due(co.cfg, s, phase.task)

    def configure(self, co: RunContext, phase: Phase) -> SftInstruction:
        s, cfg = co.s, co.cfg
        use_anchor = s.anchor is not None and cfg.routing.anchor_kl_coef > 0 and sends_latest_anchor(co)
        return SftInstruction(round=s.round, task=phase.task, weights=co.np_weights(s.weights),
                              base_hash=co.tspec.base_hash, seed=cfg.run.seed * 100_003 + s.round,
                              anchor=s.anchor.probs if use_anchor else None,
                              anchor_version=anchor_version(co, phase.task, use_anchor), **sft_fields(co, phase))

    def request(self, co: RunContext, index: int, phase: Phase, instr: SftInstruction) -> SumRequest:
        return SumRequest("update", "sft", "model-update", phase.label(),
                          co.event("train", index, phase, anchor_version=instr.anchor_version))

    def aggregate(self, co: RunContext, index: int, phase: Phase, instr: SftInstruction, out: UpdateSum
                  ) -> tuple[RoundState, str]:
        return apply_update(co, out, self.request(co, index, phase, instr).event), self.line(instr, out)

    @staticmethod
    def line(instr: SftInstruction, out: UpdateSum) -> str:
        """The round's progress line of an applied update."""
        agg = out.metrics
        kl = (f", anchor KL {agg['anchor_kl']:.4f}" if instr.anchor is not None
              and math.isfinite(agg.get("anchor_kl", math.nan)) else "")
        if out.uniform:  # a secure release: the metric slots' means over the contributors, and the skipped-step sum
            skipped = agg.get("skipped_steps", math.nan)  # the secure sum's one stability count (no update noise)
            return (contributors(out) + " | "
                    + released(agg, out.noise, (("task_loss", "task loss", ".3f"), ("dpo_margin", "margin", ".3f"),
                                                ("dpo_acc", "pref. acc", ".3f")))
                    + (f" | skipped NaN/Inf steps {int(skipped)}" if math.isfinite(skipped) and skipped > 0 else ""))
        return (f"{out.parties}/{out.nodes} parties | task loss {agg['loss_first']:.3f} -> "
                f"{agg['loss_last']:.3f}{kl} | skipped steps {int(agg['skipped_steps'])}")
