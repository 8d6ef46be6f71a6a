"""The ``rl`` phase: local GRPO at every party (IcePop-corrected, ``docs/algorithms.md``), then the
aggregated update, exactly like an SFT update.

Must not: import ``flwr``, or see one party's update.
"""

from __future__ import annotations

import math

from distmoe.config import Phase
from distmoe.coordinator.aggregator import SumRequest, UpdateSum
from distmoe.coordinator.context import RunContext
from distmoe.coordinator.phases.base import PhaseStep
from distmoe.coordinator.phases.update import apply_update, contributors, released
from distmoe.coordinator.state import RoundState
from distmoe.wire.schema import RlInstruction


class Rl(PhaseStep):
    kind = "rl"
    updates_model = True

    def begin(self, co: RunContext, phase: Phase) -> RoundState:
        return co.s.mark_trained(phase.task)  # rl tunes the task, it begins no stage

    def configure(self, co: RunContext, phase: Phase) -> RlInstruction:
        s = co.s
        return RlInstruction(round=s.round, task=phase.task, weights=co.np_weights(s.weights),
                             base_hash=co.tspec.base_hash, seed=co.cfg.run.seed * 100_003 + s.round)

    def request(self, co: RunContext, index: int, phase: Phase, instr: RlInstruction) -> SumRequest:
        cfg = co.cfg
        return SumRequest("update", "rl", "rl-update", phase.label(),
                          co.event("rl", index, phase, engine=cfg.rl.engine, correction=cfg.rl.correction))

    def aggregate(self, co: RunContext, index: int, phase: Phase, instr: RlInstruction, out: UpdateSum
                  ) -> tuple[RoundState, str]:
        return apply_update(co, out, self.request(co, index, phase, instr).event), self.line(out)

    @staticmethod
    def line(out: UpdateSum) -> str:
        """The round's progress line of an applied update."""
        agg = out.metrics
        if out.uniform:  # a secure release: the RL slots' means over the contributors, and the skipped-update sum
            skipped = agg.get("skipped_steps", math.nan)  # the secure sum's one stability count (no update noise)
            shown = {**agg, "masked_frac": agg.get("masked_frac_low", math.nan) + agg.get("masked_frac_high", math.nan)}
            nz = out.noise
            noise = {**nz, **({"masked_frac": math.hypot(nz["masked_frac_low"], nz["masked_frac_high"])}
                              if "masked_frac_low" in nz else {})}
            return (contributors(out) + " | "
                    + released(shown, noise, (("reward", "reward", ".3f"), ("logp_diff_mean", "|dlogp|", ".4f"),
                                              ("masked_frac", "masked", ".4f"), ("k3", "K3", ".2e")))
                    + (f" | skipped NaN/Inf updates {int(skipped)}" if math.isfinite(skipped) and skipped > 0 else ""))
        return (f"{out.parties}/{out.nodes} parties | reward {agg['reward_first']:.3f} -> {agg['reward_last']:.3f} "
                f"| |dlogp| mean {agg['logp_diff_mean']:.4f} max {agg['logp_diff_max']:.3f} | masked "
                f"{agg['masked_frac_low'] + agg['masked_frac_high']:.4f} | K3 {agg['k3']:.2e}")
