"""The keys of local reinforcement learning and preference tuning: sections ``rl`` (GRPO with IcePop, the
inference simulator, routing replay) and ``dpo``.

Owns: these sections' declarations, the registries' names they choose from (a test keeps them equal to the
registries in :mod:`distmoe.rl`), and the grammar of an engine profile (``bf16+prune-1``).

Must not: import anything of distmoe outside this package.
"""

from __future__ import annotations

import re

from distmoe.config.keys import ConfigError, Section, key, section

POLICY_LOSSES = ("grpo", "reinforce")  # distmoe/rl/losses.py registry (a test keeps them equal)
REWARDS = ("exact_match", "numeric", "format", "task")  # distmoe/rl/rewards.py registry
CORRECTIONS = {"icepop": "mask", "tis": "truncate", "none": "none"}
ENGINE_PARTS = ("exact", "bf16", "int8-dynamic", "int8-weight-only")
ENGINE_PART_RE = re.compile(r"prune-[1-9]\d*|int[2-8](g[1-9]\d*)?-experts")  # the parameterised parts


def _engine_part_ok(part: str) -> bool:
    return part in ENGINE_PARTS or ENGINE_PART_RE.fullmatch(part) is not None
DPO_REFERENCES = ("phase", "round")


@section("rl")
class RLConfig(Section):
    """Local GRPO (``distmoe.rl.grpo.run_grpo`` takes this section as it is)."""

    steps: int = key(6, "GRPO steps per `rl` round at each party", lo=1, hi=100000)
    prompts_per_step: int = key(8, "prompts per GRPO step", lo=1, hi=100000)
    group_size: int = key(4, "samples per prompt (G, group-relative advantages)", lo=2, hi=1024)
    max_new_tokens: int = key(8, "rollout length", lo=1, hi=100000)
    temperature: float = key(1.0, "sampling temperature (applied identically in the trainer)", lo=0.0, hi=100.0,
                             lo_open=True)
    lr: float = key(1e-4, "AdamW learning rate of the RL updates (every parameter group)", lo=0.0, hi=1.0,
                    lo_open=True)
    ppo_epochs: int = key(1, "passes over each rollout batch", lo=1, hi=100000)
    minibatches: int = key(2, "updates per pass", lo=1, hi=100000,
                           allowed="1..`rl.prompts-per-step` x `rl.group-size`")
    clip_eps: float = key(0.2, "PPO clip of the train/train ratio (symmetric)", lo=0.0, hi=0.99, lo_open=True)
    kl_coef: float = key(0.0, "k3 KL to the policy at the start of the round", lo=0.0, hi=100.0)
    policy_loss: str = key("grpo", "the policy-loss registry entry", choices=POLICY_LOSSES)
    correction: str = key("icepop", "train/inference mismatch correction: `icepop` masks, `tis` truncates",
                          choices=tuple(CORRECTIONS))
    correction_level: str = key("token", "where the ratio k is computed (`sequence`: geometric mean)",
                                choices=("token", "sequence"))
    icepop_low: float = key(0.5, "IcePop keeps tokens with low <= k <= high", lo=0.0, hi=1.0)
    icepop_high: float = key(5.0, "IcePop upper bound of k (also the TIS truncation)", lo=1.0, hi=1e6)
    engine: str = key("bf16", "the rollout engine's numerics",
                      allowed="`exact`, `bf16`, `int8-dynamic`, `int8-weight-only`, `int<b>-experts`, "
                              "`int<b>g<n>-experts`, `prune-<k>`, joined with `+`")
    reward: str = key("task", "verifiable reward", choices=REWARDS)
    simulator: bool = key(False, "use the ICEPOP seed's inference simulator's δ̂ for the mismatch weights (falls "
                          "back to the recompute when it degrades)", experimental=True)
    simulator_recalibrate_every: int = key(5, "GRPO steps between calibrations", lo=1, experimental=True)
    simulator_bound: float = key(0.5, "tokens with abs δ̂ above this are masked", lo=0.0, lo_open=True,
                                 experimental=True)
    simulator_buffer_tokens: int = key(16384, "calibration tokens the simulator keeps across steps (bounded FIFO of "
                                       "calibration batches and trained-on batches; 0: only the latest calibration)",
                                       lo=0, hi=10_000_000, experimental=True)
    simulator_heldout_frac: float = key(0.05, "share of the party's prompts held out of training (stratified over "
                                        "short/medium/long prompts) on which the simulator's error is measured",
                                        lo=0.0, hi=0.5, experimental=True)
    simulator_incremental: bool = key(True, "between full fits, refit the error MLP's last layer (ridge) on the "
                                      "buffer after every step", experimental=True)
    simulator_error_shift: float = key(0.5, "full recalibration when the held-out mean abs(δ̂ - δ) exceeds its value "
                                       "after the last full fit by this relative amount (on the held-out "
                                       "rollouts drawn at that fit, re-scored each step)", lo=0.0, lo_open=True,
                                       experimental=True)
    simulator_route_shift: float = key(0.1, "full recalibration when the policy's expert usage (mean over MoE layers "
                                       "of the total-variation distance, on the last full fit's calibration "
                                       "tokens) moved this far from the last full fit",
                                       lo=0.0, hi=1.0, lo_open=True, experimental=True)
    simulator_clip: bool = key(False, "clip δ̂ to ±`rl.simulator-bound` (the seed's form) instead of masking the "
                               "tokens beyond it (the default)", experimental=True)
    simulator_lb_coef: float = key(0.01, "coefficient of the load-balance loss on the simulated routing "
                                   "`z_train + o`, added on the steps where the simulator is used (not on fallback "
                                   "steps); `0.01` = `routing.aux-loss-coef`'s default", lo=0.0, hi=100.0,
                                   experimental=True)
    reuse_logprobs: bool = key(True, "on-policy reuse: the first PPO minibatch's own forward (at theta_old) gives its "
                               "rows' `logp_old` (detached) instead of a separate no-grad pass; only the other rows "
                               "are recomputed (none with one epoch and `rl.minibatches = 1`); off automatically with "
                               "`rl.simulator`, `rl.routing-replay` or an active dropout")
    routing_replay: bool = key(False, "routing replay: the trainer's forwards use the experts the engine's routers "
                               "chose during generation, weighted by the trainer's own router; combines with every "
                               "`rl.correction`, not with `rl.simulator`")

    @property
    def mode(self) -> str:
        """The mismatch-weight mode of ``distmoe.rl.losses.mismatch_weights``."""
        return CORRECTIONS[self.correction]

    def check(self) -> None:
        rollouts = self.prompts_per_step * self.group_size
        if self.minibatches > rollouts:
            raise ConfigError(f"config key 'rl.minibatches': value {self.minibatches} exceeds "
                              f"rl.prompts-per-step x rl.group-size = {rollouts}")
        for part in self.engine.split("+"):
            if not _engine_part_ok(part):
                raise ConfigError(f"config key 'rl.engine': value {self.engine!r}: {part!r} is not one of "
                                  f"{', '.join(ENGINE_PARTS)}, int<b>-experts (b in 2..8), prune-<k> (parts combine "
                                  "with '+', e.g. 'bf16+prune-1')")
        if self.routing_replay and self.simulator:
            raise ConfigError("config key 'rl.routing-replay': value true cannot be combined with rl.simulator = "
                              "true (two alternative mitigations of the routing gap: replay removes the gap the "
                              "simulator models; choose one)")


@section("dpo")
class DPOConfig(Section):
    """Local DPO in `dpo` phases (``distmoe.rl.dpo``; the optimiser, clipping and micro-batches are `train.*`'s)."""

    beta: float = key(0.1, "DPO β: the strength of the implicit KL to the reference", lo=0.0, hi=100.0, lo_open=True)
    steps: int = key(20, "optimizer steps per `dpo` round at each party", lo=1, hi=100000)
    pairs_per_step: int = key(8, "preference pairs per step", lo=1, hi=4096)
    reference: str = key("phase", "the reference model: `phase` = the global model at the start of the `dpo` phase "
                         "(sent with later rounds' instructions), `round` = the global model each round as received",
                         choices=DPO_REFERENCES)
    reference_engine: str = key("", "who computes the reference log-probs: `\"\"` = the trainer (exact); an "
                                "inference engine profile (as `rl.engine`) = that engine, with pairs IcePop-masked "
                                "where a token's "
                                "trainer/engine reference ratio leaves [`rl.icepop-low`, `rl.icepop-high`] "
                                "(`docs/algorithms.md`, DPO)",
                                allowed="`\"\"`, or `exact`, `bf16`, `int8-dynamic`, `int8-weight-only`, "
                                        "`int<b>-experts`, `prune-<k>` joined with `+`")

    def check(self) -> None:
        for part in (self.reference_engine.split("+") if self.reference_engine else ()):
            if not _engine_part_ok(part):
                raise ConfigError(f"config key 'dpo.reference-engine': value {self.reference_engine!r}: {part!r} is "
                                  f"not one of {', '.join(ENGINE_PARTS)}, int<b>-experts, prune-<k> (parts combine "
                                  "with '+', e.g. 'bf16+prune-1'), or \"\" for the trainer")

