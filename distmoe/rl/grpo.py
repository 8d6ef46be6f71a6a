"""The local GRPO loop at one party: rollouts from the inference engine, IcePop / TIS mismatch correction,
PPO-clipped updates of the policy (``docs/algorithms.md``, "Local RL: GRPO with IcePop").

Papers: GRPO from Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
Models", https://arxiv.org/abs/2402.03300 (PPO clipping: https://arxiv.org/abs/1707.06347); the mismatch
correction from IcePop (Ring-1T, https://arxiv.org/abs/2510.18855), see ``losses.py``. The objective one step
minimises, with ``P = prompts_per_step`` prompts, ``G = group_size`` samples each, ``N = P*G`` rollouts of at most
``T = max_new_tokens`` response tokens (``mask: [N, T]``)::

    R          rewards of the engine's samples                                        [N]
    A          group_advantages(R, G): (R - mean_group) / (std_group + 1e-6)           [N]   (0 for equal rewards)
    logp_old   log pi_train(y | theta_old), recomputed once per batch, no grad        [N, T]
               (first minibatch's rows: stopgrad(logp_new) of its own forward, rl.reuse-logprobs)
    logp_infer log pi_infer(y | theta_old), from the engine's generation scores       [N, T]
    w          mismatch_weights(logp_old, logp_infer): IcePop / TIS / 1, detached      [N, T]
    L(theta)   = -1/N sum_i 1/|y_i| sum_t w_it min(r_it A_i, clip(r_it, 1-eps, 1+eps_high) A_i)
                 + kl_coef * 1/N sum_i 1/|y_i| sum_t k3(pi_theta || pi_ref)_it           []
    r_it       = pi_train(y_it | theta) / pi_train(y_it | theta_old)                   [N, T]

``|y_i|`` counts every valid response token, masked ones included; ``L`` is minimised on ``minibatches`` slices of
the ``N`` rollouts, ``ppo_epochs`` times per step.

Owns: ``run_grpo`` (the loop) and ``GRPOResult`` (per-step metrics and the per-round summary); one step's policy
update is ``ppo.py``, the simulator's refits and trust ``sim_step.py``. Its config is the
run's ``rl`` section, ``distmoe.config.RLConfig``, as parsed and validated there (no second config class here).
One step is:

1. ``engine.sync(policy)`` (the engine is built once with ``cfg.engine``; ``prune-k`` profiles measure expert
   usage on calibration batches made from the party's own examples, re-measured at every sync);
2. sample ``prompts_per_step`` prompts (seeded) and ``group_size`` rollouts each **from the engine**
   (``logp_infer = log pi_infer(theta_old)``), rewards of the engine's samples, group advantages;
3. recompute ``logp_old = log pi_train(theta_old)`` once per batch, no grad, eval mode; the mismatch weights
   ``mismatch_weights(logp_old, logp_infer)`` once per batch (detached). With on-policy reuse
   (``rl.reuse-logprobs``, on by default; ``reuse_valid`` says where it applies) the first minibatch's rows are
   not recomputed: its update forward runs at theta_old, so ``logp_old := logp_new.detach()`` on those rows (as
   verl does when the mini-batch is the whole batch), the other rows are recomputed before any update, and the
   weights are taken once that forward has completed ``logp_old``; with one epoch and one minibatch there is no
   separate pass at all;
   With ``cfg.simulator`` (off by default; off is bit-for-bit the path above) the inference simulator
   (``simulator.py``) is calibrated at step 0 and every ``simulator_recalibrate_every`` steps on fresh engine
   rollouts, and in between when its error on the held-out prompts (``simulator_heldout_frac`` of the prompts,
   stratified by length, never trained on) or the policy's expert usage shifts (``simulate_step``); the
   calibration tokens accumulate in a bounded buffer and the MLP's last layer is refitted after every step;
   ``delta_hat`` comes from the same theta_old pass, and unless the simulator is degraded (held-out
   calibration or this batch's R^2 / AUROC below the minimum: fallback, counted) the loss uses
   ``logp_old = logp_infer + delta_hat`` and the weights ``exp(delta_hat)`` masked beyond ``simulator_bound``
   (per token, or per sequence from the mean ``delta_hat`` at ``correction_level="sequence"``), and adds
   ``simulator_lb_coef x`` the load-balance loss on the simulated routing to every update of that step;
   With ``cfg.routing_replay`` (off by default) the rollouts record the engine's routes and every training-side
   forward of the step (the theta_old recompute, every update, the reference) replays them (``replay.py``);
4. ``ppo_epochs x minibatches`` updates (train mode) with the registered policy loss (``minibatch_loss``), gradient
   clipping (after optional winsorisation, ``train/stability.py``); an update whose loss or gradient norm is
   NaN/Inf is skipped (no optimizer step) and counted, naming the tensors whose gradient was non-finite.

Must not: read files, talk to the wire, or import Flower. The policy is in train mode only during the
updates (eval mode for generation, recompute and diagnostics) and is left in eval mode.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from distmoe.config import RLConfig, TrainConfig
from distmoe.data.formats import Example
from distmoe.data.template import IGNORE_INDEX, collate, encode_fitting, encode_prompt
from distmoe.rl.advantages import group_advantages
from distmoe.rl.engine_view import share_copy
from distmoe.rl.engines import InferenceEngine, parse_profile
from distmoe.rl.losses import get_policy_loss, mismatch_weights
from distmoe.rl.ppo import (  # noqa: F401  (lb_mask, minibatch_loss, reuse_valid: re-exported for callers)
    OldPolicy,
    UpdateTally,
    lb_mask,
    logprobs_and_logits,
    masked_mean,
    minibatch_loss,
    ppo_update,
    replay_override_frac,
    reuse_valid,
    subset,
    token_entropy,
)
from distmoe.rl.rewards import compute_rewards
from distmoe.rl.rollout import Rollouts, generate_rollouts, routing_disagreement, train_logprobs
from distmoe.rl.sim_step import SimState, simulate_step
from distmoe.rl.simulator import InferenceSimulator, capture, heldout_split
from distmoe.train.optim import build_optimizer
from distmoe.train.stability import NonFinite

CALIBRATION_EXAMPLES = 64  # examples (full conversations) used to measure expert usage for prune-k


# The inference simulator's fit settings (InferenceSimulator keywords; not run-config keys, fixed for runs).
SIMULATOR_FIT: dict[str, float] = {"hidden": 32, "fit_steps": 300, "r2_min": 0.1, "auroc_min": 0.5}


def optimizer_config(cfg: RLConfig, grad_clip: float) -> TrainConfig:
    """The ``TrainConfig`` that ``build_optimizer`` gets: one AdamW at ``rl.lr`` for every group (experts, router,
    rest), no weight decay, no warm-up."""
    return TrainConfig(lr=cfg.lr, lr_experts=cfg.lr, lr_router=cfg.lr, weight_decay=0.0, warmup_steps=0,
                       grad_clip=grad_clip)


@dataclass
class GRPOBatch:
    """The last step's batch, kept for inspection (tests, debugging): everything the updates used."""

    rollouts: Rollouts
    rewards: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]
    logp_old: torch.Tensor  # [N, T] log pi_train(theta_old)
    weights: torch.Tensor  # [N, T] detached mismatch weights (0 on padding)
    prompt_ids: list[int]  # indices into the prompts passed to run_grpo
    delta_hat: torch.Tensor | None = None  # [N, T] simulator prediction (simulator on)
    logp_old_used: torch.Tensor | None = None  # [N, T] the logp_old the loss used (simulator on)


@dataclass
class GRPOResult:
    steps: list[dict[str, float]] = field(default_factory=list)  # one metric dict per GRPO step
    skipped_steps: int = 0  # optimizer updates skipped for a NaN/Inf loss or gradient
    updates: int = 0  # optimizer updates applied
    sim_fallbacks: int = 0  # steps where the simulator was degraded and the recompute path was used
    sim_trusted: int = 0  # steps whose update used the simulator's delta_hat (= steps - sim_fallbacks)
    sim_recal_triggered: int = 0  # full fits triggered by a held-out error or routing shift (not by the schedule)
    sim_heldout: list[int] = field(default_factory=list)  # indices of the held-out prompts (never trained on)
    time_s: float = 0.0
    last_batch: GRPOBatch | None = None
    nonfinite: NonFinite = field(default_factory=NonFinite)  # the skipped updates' non-finite gradients, by name

    def summary(self) -> dict[str, float]:
        """Per-round summary: the mean of every per-step metric (NaN-skipping), plus first/last reward."""
        keys: list[str] = []
        for m in self.steps:
            keys.extend(k for k in m if k not in keys)
        out: dict[str, float] = {}
        for k in keys:
            vals = [m[k] for m in self.steps if k in m and not math.isnan(m[k])]
            out[k] = float(sum(vals) / len(vals)) if vals else math.nan
        if self.steps:
            out["reward_first"] = self.steps[0]["reward"]
            out["reward_last"] = self.steps[-1]["reward"]
            out["logp_diff_max"] = max(m["logp_diff_max"] for m in self.steps)
        out.update({"steps": float(len(self.steps)), "updates": float(self.updates),
                    "skipped_steps": float(self.skipped_steps), "time_s": self.time_s,
                    "time_per_step_s": self.time_s / max(len(self.steps), 1)})
        if any("sim_fallback" in m for m in self.steps):
            out["sim_fallbacks"] = float(self.sim_fallbacks)
            out["sim_trusted_steps"] = float(self.sim_trusted)
            out["sim_recal_triggered_steps"] = float(self.sim_recal_triggered)
        return out


def _encode(tokenizer, prompts: list[Example], max_prompt_len: int):
    ids = [encode_prompt(tokenizer, ex, max_prompt_len) for ex in prompts]
    texts = [ex.prompt_messages[-1]["content"] if ex.prompt_messages else "" for ex in prompts]
    return ids, texts


def build_engine(model: nn.Module, tokenizer, prompts: list[Example], cfg: RLConfig,
                 max_prompt_len: int = 256) -> InferenceEngine:
    """The inference engine of ``cfg.engine``; prune profiles get calibration batches from the first
    ``CALIBRATION_EXAMPLES`` of ``prompts``, those whose answer fits (``encode_fitting``: left out, never refused,
    so the reply does not tell the longest answer's length); with none fitting, their prompts alone."""
    calibration = None
    if parse_profile(cfg.engine)["prune"]:
        max_len = max(max_prompt_len, int(getattr(model.config, "max_position_embeddings", 0) or 0))
        _, encoded, _ = encode_fitting(tokenizer, prompts[:CALIBRATION_EXAMPLES], max_len)
        encoded = encoded or [
            (ids, [IGNORE_INDEX] * len(ids))
            for ids in (encode_prompt(tokenizer, ex, max_len) for ex in prompts[:CALIBRATION_EXAMPLES])]
        calibration = [collate(encoded, tokenizer.pad_token_id)]
    return InferenceEngine(model, cfg.engine, temperature=cfg.temperature, calibration=calibration)


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else math.nan


def _step_metrics(rewards: torch.Tensor, mstats: Mapping[str, float], weights: torch.Tensor, mask: torch.Tensor,
                  upd: UpdateTally, ent: float, t_rec: float, routes: list[float]) -> dict[str, float]:
    """One step's metrics (``rewards``: ``[N]``; ``weights``, ``mask``: ``[N, T]``); names in ``docs/algorithms.md``."""
    mean = _mean
    valid_w = weights[mask]
    metrics: dict[str, float] = {
        "reward": float(rewards.mean()),
        "reward_std": float(rewards.std(correction=0)),
        "masked_frac_low": mstats["icepop/masked_frac_low"],
        "masked_frac_high": mstats["icepop/masked_frac_high"],
        "masked_frac": mstats["icepop/masked_frac"],
        "seq_masked_frac": mstats["icepop/seq_with_masked_token_frac"],
        "logp_diff_mean": mstats["mismatch/logp_abs_diff_mean"],
        "logp_diff_max": mstats["mismatch/logp_abs_diff_max"],
        "k3": mstats["mismatch/kl_k3"],
        "k_mean": mstats["mismatch/k_mean"],
        "weight_mean": float(valid_w.mean()) if valid_w.numel() else 0.0,
        "weights_all_one": float(bool(valid_w.numel()) and bool((valid_w == 1).all())),
        "clip_frac": mean(upd.clip_fracs),
        "loss": mean(upd.losses),
        "grad_norm": mean(upd.grad_norms),
        "masked_entropy": ent,
        "response_len": float(mask.sum(1).float().mean()),
        "num_tokens": float(mask.sum()),
        "updates": float(upd.applied),
        "skipped_steps": float(upd.skipped),
        "recompute_s": t_rec,
    }
    if upd.kl_refs:
        metrics["kl_ref"] = mean(upd.kl_refs)
    for li, d in enumerate(routes):
        metrics[f"route_disagree_l{li}"] = d
    return metrics


def _draw(n: int, k: int, gen: torch.Generator) -> list[int]:
    """``k`` of ``range(n)``: without replacement when ``n >= k``, else with (never a size-dependent refusal)."""
    return (torch.randperm(n, generator=gen)[:k] if n >= k else torch.randint(n, (k,), generator=gen)).tolist()


def run_grpo(model: nn.Module, tokenizer, prompts: list[Example], task: str, cfg: RLConfig,
             reference_model: nn.Module | None = None, *, seed: int = 0, max_prompt_len: int = 256,
             grad_clip: float = 1.0, simulator_fit: Mapping[str, float] | None = None,
             winsorize: float = 0.0) -> GRPOResult:
    """``cfg.steps`` GRPO steps on ``model`` (updated in place) with prompts from ``prompts``.

    ``cfg`` is the run's ``rl`` section as parsed; the party passes the rest: ``seed`` (sampling, minibatch
    order, simulator), ``max_prompt_len`` (``model.max-seq-len``), ``grad_clip`` (``train.grad-clip``),
    ``winsorize`` (``train.winsorize``, 0 = off);
    ``simulator_fit`` overrides entries of ``SIMULATOR_FIT``. Rewards use ``cfg.reward`` with the example's answer
    as the expected answer and its last prompt turn as the prompt text. With ``kl_coef > 0`` the k3 KL is taken to
    ``reference_model`` (default: the policy as passed in, a copy of its trainable tensors over the shared frozen
    base). Returns the per-step metrics and the
    counters; see ``GRPOResult.summary``.
    """
    if not prompts:
        raise ValueError("run_grpo: no prompts")
    loss_fn = get_policy_loss(cfg.policy_loss)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt, sched = build_optimizer(model, optimizer_config(cfg, grad_clip))
    if cfg.kl_coef > 0 and reference_model is None:  # the frozen base shared, only what trains is copied
        reference_model = share_copy(model, share=lambda t: not t.requires_grad)
    if reference_model is not None:
        reference_model.eval()
    prompt_ids, prompt_texts = _encode(tokenizer, prompts, max_prompt_len)
    answers = [ex.answer for ex in prompts]
    model.eval()
    engine = build_engine(model, tokenizer, prompts, cfg, max_prompt_len)  # synced at construction
    gen = torch.Generator().manual_seed(seed)
    reuse = reuse_valid(cfg, model)
    chunks = max(1, cfg.minibatches)
    sim = None
    pool = list(range(len(prompts)))  # the prompts the run trains on
    if cfg.simulator:
        held = heldout_split([len(ids) for ids in prompt_ids], cfg.simulator_heldout_frac, seed)
        pool = [i for i in pool if i not in set(held)] or pool  # 3 prompts: all held out, train on them too
        sim = InferenceSimulator.for_model(model, bound=cfg.simulator_bound, seed=seed,
                                           buffer_tokens=cfg.simulator_buffer_tokens,
                                           **{**SIMULATOR_FIT, **(simulator_fit or {})})
        sim_st = SimState(sim=sim, gen=torch.Generator().manual_seed(seed + 7919), train_pool=pool, held=held)
    res = GRPOResult(sim_heldout=held if cfg.simulator else [])
    t_all = time.perf_counter()
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        model.eval()
        if step > 0:
            engine.sync(model)
        chosen = [pool[j] for j in _draw(len(pool), cfg.prompts_per_step, gen)]  # P prompts, whatever len(pool)
        ro = generate_rollouts(engine, tokenizer, [prompt_ids[i] for i in chosen], cfg.group_size,
                               cfg.max_new_tokens, cfg.temperature, seed=seed * 100_003 + step,
                               record_routes=cfg.routing_replay)
        rows = [chosen[int(i)] for i in ro.prompt_index]
        rewards = torch.tensor(compute_rewards(cfg.reward, ro.texts, [answers[i] for i in rows], task,
                                               [prompt_texts[i] for i in rows]), dtype=torch.float32,
                               device=ro.sequences.device)  # [N]
        adv = group_advantages(rewards, cfg.group_size)  # [N]
        t_rec = time.perf_counter()
        replay_metrics: dict[str, float] = {}
        mask = ro.response_mask  # [N, T]
        reused = 0
        if sim is None and reuse:  # recompute only the rows outside the first minibatch
            order = torch.randperm(ro.num_rollouts, generator=gen)  # the first epoch's order, as ppo_update draws it
            first = torch.tensor_split(order, chunks)[0]
            rest = order[first.numel():]
            reused = int(first.numel())
            logp_old = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)  # [N, T]
            ent_tok = torch.zeros_like(logp_old)  # [N, T]
            if rest.numel():
                sub_rest = subset(ro, rest)
                lp, lg, _ = logprobs_and_logits(model, sub_rest)  # [n, T], [n, T, V]
                logp_old[rest], ent_tok[rest] = lp, token_entropy(lg, sub_rest.response_mask)
                del lg
        elif sim is None:
            order = None
            logp_old, logits_old, rstats = logprobs_and_logits(model, ro, cfg.routing_replay)  # [N, T], [N, T, V]
            ent_tok = token_entropy(logits_old, mask)  # [N, T]
            del logits_old
            if cfg.routing_replay:
                t_native = time.perf_counter()
                logp_native = train_logprobs(model, ro, grad=False)  # [N, T] the trainer's own routing
                vm = ro.response_mask
                replay_metrics = {
                    "replay_override_frac": replay_override_frac(rstats, ro),
                    "logp_diff_mean_native": float((logp_native - ro.logp_infer)[vm].abs().mean()) if vm.any()
                    else 0.0,
                    "replay_native_s": time.perf_counter() - t_native}
                del logp_native
        else:  # the same pass, with the router logits the simulator's features need
            order = None
            tf_old = capture(model, ro, lm_logits=True)
            logp_old = tf_old.logp  # [N, T]
            ent_tok = token_entropy(tf_old.logits, mask)  # [N, T]
        t_rec = time.perf_counter() - t_rec
        old = OldPolicy(logp=logp_old, ent_tok=ent_tok, ro=ro, cfg=cfg, order=order, pending=bool(reused))
        if not reused:
            old.weigh()
        measured = old
        sim_metrics: dict[str, float] = {}
        delta_hat = None
        logp_old_used = logp_old
        if sim is not None:
            delta_hat, sim_logp_old, sim_w, sim_metrics = simulate_step(sim_st, step, cfg, model, engine, tokenizer,
                                                                    prompt_ids, ro, tf_old, logp_old, seed)
            del tf_old
            if not sim_metrics["sim_fallback"]:
                logp_old_used = sim_logp_old
                old = OldPolicy(logp=sim_logp_old, ent_tok=ent_tok, ro=ro, cfg=cfg, weights=sim_w)
            res.sim_fallbacks += int(sim_metrics["sim_fallback"])
            res.sim_trusted += int(sim_metrics["sim_trusted"])
            res.sim_recal_triggered += int(sim_metrics["sim_recal_triggered"])
        ref_logp = None
        if reference_model is not None:
            ref_logp = train_logprobs(reference_model, ro, grad=False, replay=cfg.routing_replay)  # [N, T]
        routes = routing_disagreement(model, engine, ro)

        lb_sim = sim if (sim is not None and not sim_metrics.get("sim_fallback", 1.0)) else None  # trusted steps only
        upd = ppo_update(model, opt, sched, params, ro, loss_fn, old, adv, ref_logp, lb_sim, cfg, gen, grad_clip,
                          winsorize)
        weights, mstats = old.weights, measured.stats  # [N, T] complete now (filled by the first minibatch if reused)
        if cfg.mode == "mask":
            icepop_masked = mask & (weights == 0)  # [N, T]
        else:  # what IcePop would mask at these bounds
            w_mask, _ = mismatch_weights(logp_old, ro.logp_infer, mask, cfg.correction_level, "mask",
                                         cfg.icepop_low, cfg.icepop_high)
            icepop_masked = mask & (w_mask == 0)  # [N, T]
        ent = masked_mean(ent_tok, icepop_masked)
        res.skipped_steps += upd.skipped
        for name, count in upd.nonfinite.params.items():
            res.nonfinite.params[name] = res.nonfinite.params.get(name, 0) + count
        res.nonfinite.skipped += upd.nonfinite.skipped
        res.updates += upd.applied
        metrics = _step_metrics(rewards, mstats, weights, mask, upd, ent, t_rec, routes)
        metrics["logp_old_reused_frac"] = reused / max(ro.num_rollouts, 1)
        if sim is not None:
            metrics["sim_lb_loss"] = _mean(upd.lb_losses)  # NaN on fallback steps (no LB term) or with coef 0
        if cfg.routing_replay:
            metrics["replay"] = 1.0
            metrics.update(replay_metrics)
        metrics.update(sim_metrics)
        metrics["time_s"] = time.perf_counter() - t0
        res.steps.append(metrics)
        res.last_batch = GRPOBatch(rollouts=ro, rewards=rewards, advantages=adv, logp_old=logp_old,
                                   weights=weights, prompt_ids=chosen, delta_hat=delta_hat,
                                   logp_old_used=None if sim is None else logp_old_used)
    res.time_s = time.perf_counter() - t_all
    model.eval()
    return res
