"""The ``rl`` phase: local GRPO at every party (IcePop-corrected, ``docs/algorithms.md``), then the
aggregated update, exactly like an SFT update.

Must not: import ``flwr``, or see one party's update.
"""

from __future__ import annotations

import math

from distmoe.coordinator.phases.sft import contributors
from distmoe.coordinator.phases.update import apply_update
from distmoe.wire.schema import RlInstruction


def configure(co, phase) -> RlInstruction:
    s = co.s
    s.mark_trained(phase.task)
    return RlInstruction(round=s.round, task=phase.task, weights=co.np_weights(s.weights),
                         base_hash=co.tspec.base_hash, seed=co.cfg.run.seed * 100_003 + s.round)


def aggregate(co, index, phase, instr: RlInstruction) -> str:
    cfg = co.cfg
    event = co.event("rl", index, phase, engine=cfg.rl.engine, correction=cfg.rl.correction)
    out = apply_update(co, co.aggregator.updates(instr, "rl", "rl-update", event), event)
    if isinstance(out, str):
        return out
    agg = out.metrics
    if co.cfg.privacy.secure:  # no RL metric but the skipped-update sum reaches the server
        skipped = agg.get("skipped_steps", math.nan)  # the secure sum's one stability count (no update noise)
        return (contributors(out) + (f" | skipped NaN/Inf updates {int(skipped)}"
                                     if math.isfinite(skipped) and skipped > 0 else ""))
    return (f"{out.parties}/{out.nodes} parties | reward {agg['reward_first']:.3f} -> {agg['reward_last']:.3f} "
            f"| |dlogp| mean {agg['logp_diff_mean']:.4f} max {agg['logp_diff_max']:.3f} | masked "
            f"{agg['masked_frac_low'] + agg['masked_frac_high']:.4f} | K3 {agg['k3']:.2e}")
