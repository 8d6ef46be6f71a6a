"""The ``rl`` phase: local GRPO at every party (IcePop-corrected, ``docs/algorithms.md``), then the
aggregated update, exactly like an SFT update.

Must not: import ``flwr``, or see one party's update.
"""

from __future__ import annotations

from distmoe.coordinator.phases.update import apply_update
from distmoe.wire.schema import RlInstruction, rl_metric_keys


def configure(co, phase) -> RlInstruction:
    s = co.s
    s.mark_trained(phase.task)
    return RlInstruction(round=s.round, task=phase.task, weights=co.np_weights(s.weights),
                         base_hash=co.tspec.base_hash, seed=co.cfg.run.seed * 100_003 + s.round)


def aggregate(co, index, phase, instr: RlInstruction) -> str:
    cfg = co.cfg
    event = co.event("rl", index, phase, engine=cfg.rl.engine, correction=cfg.rl.correction)
    keys = rl_metric_keys(co.mspec.num_moe_layers, cfg.rl.simulator)
    out = apply_update(co, co.aggregator.updates(instr, "rl", "rl-update", keys, event), event)
    if isinstance(out, str):
        return out
    if cfg.privacy.secure and cfg.privacy.update_noise_multiplier > 0:
        return f"{out.parties}/{out.nodes} parties | RL metrics withheld (client-level DP on updates)"
    agg = out.metrics
    return (f"{out.parties}/{out.nodes} parties | reward {agg['reward_first']:.3f} -> {agg['reward_last']:.3f} "
            f"| |dlogp| mean {agg['logp_diff_mean']:.4f} max {agg['logp_diff_max']:.3f} | masked "
            f"{agg['masked_frac_low'] + agg['masked_frac_high']:.4f} | K3 {agg['k3']:.2e}")
