"""The inference simulator inside the GRPO loop: when it is refitted, whether a step trusts it, and what the step
reports about it (``docs/algorithms.md``, "The ICEPOP seed's inference simulator"; the simulator itself:
``simulator.py``).

Owns: the run's simulator state (the training and held-out prompt pools, the error after the last full fit),
the refit triggers (schedule, held-out error shift, expert-usage shift), the fallback decision, and the step's
simulated ``logp_old`` and mismatch weights.

Must not: update the policy, read files or talk to the wire.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch
from torch import nn

from distmoe.config import RLConfig
from distmoe.rl.rollout import Rollouts, engine_model, generate_rollouts, train_logprobs
from distmoe.rl.simulator import InferenceSimulator, compare, simulated_weights


@dataclass
class SimState:
    """The simulator of a run and what decides when it is refitted and trusted."""

    sim: InferenceSimulator
    gen: torch.Generator  # calibration prompts (the step's `gen` is untouched)
    train_pool: list[int]  # prompt indices the run trains and calibrates on
    held: list[int]  # held-out prompt indices (never trained on): the simulator's error is measured there
    ref_err: float = math.nan  # held-out mean |delta_hat - delta| right after the last full fit
    held_ro: Rollouts | None = None  # the held-out rollouts drawn at the last full fit, re-scored every step


def simulate_step(st: SimState, step: int, cfg: RLConfig, model: nn.Module, engine, tokenizer, prompt_ids: list, ro,
              tf_old, logp_old: torch.Tensor, seed: int):
    """The simulator's view of this step, ``(delta_hat [N, T], simulated logp_old [N, T], simulated weights
    [N, T], metrics)``. A full fit (calibration rollouts from the training prompts, into the bounded buffer) runs
    every ``rl.simulator-recalibrate-every`` steps, and in between when the held-out error grew by more than
    ``rl.simulator-error-shift`` (relative) or the policy's expert usage moved more than
    ``rl.simulator-route-shift`` (TV distance) since the last fit. The step is trusted (``sim_trusted`` 1.0,
    ``sim_fallback`` 0.0) only when the calibration, the held-out prompts and this batch's metrics mode all pass.
    Afterwards the batch joins the buffer and, with ``rl.simulator-incremental``, the MLP's last layer is refitted
    for the next step."""
    sim = st.sim
    mask = ro.response_mask  # [N, T]

    def heldout(draw: bool) -> dict[str, float]:
        """The metrics mode on the held-out rollouts: drawn from the engine at a full fit (``draw``), and between
        fits the same tokens again, re-scored by the current engine and evaluated under the current policy, so
        that the error trigger sees the policy's drift and not a fresh sample's (mirrors ``route_shift``)."""
        if not st.held:
            return {}
        if draw or st.held_ro is None:
            st.held_ro = generate_rollouts(engine, tokenizer, [prompt_ids[i] for i in st.held[:cfg.prompts_per_step]],
                                           cfg.group_size, cfg.max_new_tokens, cfg.temperature,
                                           seed=seed * 100_003 + 70_001 + step)
        # the engine's teacher-forced log-probs of those tokens, at its current weights: at the fit and after it
        # the same scoring, so err_shift compares like with like   [N, T]
        ro_h = replace(st.held_ro, logp_infer=train_logprobs(engine_model(engine), st.held_ro))
        return sim.evaluate(model, ro_h)

    full = step % cfg.simulator_recalibrate_every == 0 or not sim.calibrated
    triggered, held_m, t_cal, shift, err_shift = 0.0, {}, 0.0, math.nan, math.nan
    if not full:
        shift = sim.route_shift(model)  # on the last fit's own tokens: the policy's drift only
        held_m = heldout(draw=False)
        err_shift = held_m["abs_err"] / st.ref_err - 1.0 if held_m and st.ref_err > 0 else math.nan
        if shift > cfg.simulator_route_shift or err_shift > cfg.simulator_error_shift:
            full, triggered = True, 1.0
    if full:
        t_cal = time.perf_counter()
        pick = torch.randperm(len(st.train_pool), generator=st.gen)[:cfg.prompts_per_step].tolist()
        ro_cal = generate_rollouts(engine, tokenizer, [prompt_ids[st.train_pool[i]] for i in pick], cfg.group_size,
                                   cfg.max_new_tokens, cfg.temperature, seed=seed * 100_003 + 50_021 + step)
        sim.calibrate(model, engine, ro_cal)
        held_m = heldout(draw=True)
        st.ref_err = held_m.get("abs_err", math.nan)
        t_cal = time.perf_counter() - t_cal
    cal_m = sim.last_metrics
    t_pred = time.perf_counter()
    delta_hat = sim.predict(model, ro, captured=tf_old)  # [N, T] detached, theta_old only
    t_pred = time.perf_counter() - t_pred
    cmp = compare(delta_hat, logp_old - ro.logp_infer, mask, sim.r2_min, sim.auroc_min)
    fallback = bool(cal_m["degraded"]) or bool(cmp["degraded"]) or bool(held_m.get("degraded", 0.0))
    sim_logp_old, sim_w, sstats = simulated_weights(ro.logp_infer, delta_hat, mask, cfg.simulator_bound,
                                                    cfg.correction_level, clip=cfg.simulator_clip)
    metrics = {"sim_r2": cmp["r2"], "sim_auroc": cmp["auroc"], "sim_abs_err": cmp["abs_err"],
               "sim_cal_r2": cal_m["r2"], "sim_cal_auroc": cal_m["auroc"], "sim_fallback": float(fallback),
               "sim_trusted": float(not fallback), "sim_full_fit": float(full), "sim_recal_triggered": triggered,
               "sim_heldout_r2": held_m.get("r2", math.nan), "sim_heldout_auroc": held_m.get("auroc", math.nan),
               "sim_heldout_abs_err": held_m.get("abs_err", math.nan),
               "sim_route_shift": shift, "sim_err_shift": err_shift,  # what the triggers saw (NaN: scheduled fit)
               "sim_masked_frac": sstats["sim/masked_frac"], "sim_clipped_frac": sstats["sim/clipped_frac"],
               "sim_calibrate_s": t_cal, "sim_predict_s": t_pred}
    if sim.observe(tf_old, ro) and cfg.simulator_incremental:
        metrics["sim_refit_mse"] = sim.refit_last()["mse_after"]
    metrics["sim_buffer_tokens"] = float(sim.buffered_tokens)
    return delta_hat, sim_logp_old, sim_w, metrics
