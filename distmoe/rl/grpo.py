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

Owns: ``run_grpo`` (the loop) and ``GRPOResult`` (per-step metrics and the per-round summary). Its config is the
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
   stratified by length, never trained on) or the policy's expert usage shifts (``_simulate``); the
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

import copy
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from distmoe.config import RLConfig, TrainConfig
from distmoe.data.formats import Example
from distmoe.data.template import collate, encode_example, encode_prompt
from distmoe.rl.advantages import group_advantages
from distmoe.rl.engines import InferenceEngine, parse_profile
from distmoe.rl.losses import get_policy_loss, mismatch_weights
from distmoe.rl.replay import ReplayStats, replay_routes
from distmoe.rl.rewards import compute_rewards
from distmoe.rl.rollout import Rollouts, engine_model, generate_rollouts, routing_disagreement, train_logprobs
from distmoe.rl.simulator import InferenceSimulator, capture, compare, heldout_split, simulated_weights
from distmoe.train.optim import build_optimizer
from distmoe.train.stability import NonFinite, guard_gradients

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


def _subset(ro: Rollouts, idx: torch.Tensor) -> Rollouts:
    """Rows ``idx`` of a rollout batch (same prompt length and temperature)."""
    routes = None if ro.engine_routes is None else ro.engine_routes[:, idx]  # [L, n, S, k]
    return replace(ro, sequences=ro.sequences[idx], attention_mask=ro.attention_mask[idx], response=ro.response[idx],
                   logp_infer=ro.logp_infer[idx], response_mask=ro.response_mask[idx],
                   texts=[ro.texts[i] for i in idx.tolist()], prompt_index=ro.prompt_index[idx],
                   engine_routes=routes)


def _response_logits(head_out: torch.Tensor, ro: Rollouts) -> torch.Tensor:
    """The LM head's output ``[N, P+T, V]`` -> the temperature-scaled logits that predict the response ``[N, T, V]``."""
    t = ro.response.shape[1]
    return head_out.detach()[:, ro.prompt_len - 1:ro.prompt_len - 1 + t].float() / ro.temperature


def _logprobs_and_logits(model: nn.Module, ro: Rollouts,
                         replay: bool = False) -> tuple[torch.Tensor, torch.Tensor, ReplayStats]:
    """``train_logprobs`` (no grad) plus the temperature-scaled response logits ``[N, T, V]`` of that same pass;
    with ``replay`` the pass replays the engine's routes, and the ``ReplayStats`` say where that changed them."""
    head = model.get_output_embeddings()
    got: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda _m, _i, out: got.append(out.detach()))
    try:
        with replay_routes(model, ro.engine_routes if replay else None) as rstats:
            logp = train_logprobs(model, ro, grad=False)  # [N, T]
    finally:
        handle.remove()
    return logp, _response_logits(got[-1], ro), rstats


def token_entropy(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each valid token's next-token distribution ``[N, T]`` (0 elsewhere) from ``[N, T, V]``
    logits, as ``losses.masked_entropy`` computes it; kept instead of the logits so the masked mean can be taken
    once the weights are known."""
    out = torch.zeros(mask.shape, dtype=torch.float32, device=logits.device)  # [N, T]
    sel = mask.bool()
    if bool(sel.any()):
        with torch.no_grad():
            logp = torch.log_softmax(logits[sel].float(), dim=-1)  # [n, V]
            out[sel] = torch.special.entr(logp.exp()).sum(dim=-1)
    return out


def _masked_mean(x: torch.Tensor, sel: torch.Tensor) -> float:
    """Mean of ``x`` where ``sel`` (NaN when nothing is selected, as ``losses.masked_entropy``)."""
    return float(x[sel].mean()) if bool(sel.any()) else math.nan


def reuse_valid(cfg: RLConfig, model: nn.Module) -> bool:
    """Whether the first PPO minibatch's own forward may stand in for its rows' ``logp_old`` recompute.

    That forward runs at theta_old (no update yet) in train mode on the same rows, so it equals the no-grad
    eval-mode recompute unless train mode changes the forward (an active dropout), or the path needs a full
    theta_old pass of its own: the simulator (``delta_hat``'s features and the metrics mode need the whole
    batch's router and LM logits before any update) and routing replay (its diagnostics, the override share and
    the native-routing ``|dlogp|``, are measured on that pass). ``rl.reuse-logprobs = false`` turns it off."""
    if not cfg.reuse_logprobs or cfg.simulator or cfg.routing_replay:
        return False
    if float(getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0) > 0.0:
        return False
    return not any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


def replay_override_frac(rstats: ReplayStats, ro: Rollouts) -> float:
    """Share of (valid response token, MoE layer) pairs whose replayed expert set differs from the trainer's own
    top-k, at the positions whose outputs give the response log-probs (``P-1+t``); 0.0 without replay."""
    if not rstats.overridden:
        return 0.0
    n, s = ro.sequences.shape
    plen, t = ro.prompt_len, ro.response.shape[1]
    valid = ro.response_mask  # [N, T]
    fr = [float((o.reshape(n, s)[:, plen - 1:plen - 1 + t] & valid).sum()) / max(int(valid.sum()), 1)
          for o in rstats.overridden.values()]
    return float(sum(fr) / len(fr))


def lb_mask(ro: Rollouts) -> torch.Tensor:
    """``[N, P+T]`` long: valid prompt tokens and valid response tokens (not the padding after an eos)."""
    return torch.cat([ro.attention_mask[:, :ro.prompt_len], ro.response_mask.to(ro.attention_mask.dtype)], 1)


def minibatch_loss(model: nn.Module, sub: Rollouts, loss_fn, logp_old: torch.Tensor | None, adv: torch.Tensor,
                   weights: torch.Tensor | None, cfg: RLConfig, ref_logp: torch.Tensor | None = None,
                   sim: InferenceSimulator | None = None,
                   old_fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one PPO minibatch ``sub`` (``[n, T]`` tensors for its rows), with the graph:

    ``loss_fn(logp_new, logp_old, adv, mask, weights)`` with ``logp_new`` from the policy's forward (replaying
    the engine's routes when ``cfg.routing_replay``), plus ``cfg.simulator_lb_coef * lb_loss_simulated`` on that
    same forward's router logits when a simulator ``sim`` is passed (its offset table is a constant; the gradient
    reaches the router through ``z_train``). Metrics: the loss's, plus ``sim_lb_loss`` when ``sim`` is given.
    With ``old_fn`` (on-policy reuse, the forward is at theta_old) ``logp_old`` and ``weights`` are not passed
    but ``old_fn(logp_new.detach())`` returns them (``[n, T]`` each).
    """
    mask = sub.response_mask  # [n, T]
    want_lb = sim is not None and cfg.simulator_lb_coef > 0
    if want_lb:
        logp_new, router = train_logprobs(model, sub, grad=True, replay=cfg.routing_replay, router_logits=True)
    else:
        logp_new = train_logprobs(model, sub, grad=True, replay=cfg.routing_replay)  # [n, T]
    if old_fn is not None:
        logp_old, weights = old_fn(logp_new.detach())  # [n, T] each: this forward is pi_train(theta_old)
    if logp_old is None or weights is None:
        raise ValueError("minibatch_loss: pass logp_old and weights, or old_fn")
    loss, lm = loss_fn(logp_new, logp_old, adv, mask, weights, clip_eps=cfg.clip_eps,
                       ref_logp=ref_logp, kl_coef=cfg.kl_coef)
    if want_lb:
        lb = sim.lb_loss(router, lb_mask(sub))  # [] on the simulated routing of this forward
        loss = loss + cfg.simulator_lb_coef * lb
        lm = {**lm, "sim_lb_loss": float(lb.detach())}
    return loss, lm


def _encode(tokenizer, prompts: list[Example], max_prompt_len: int):
    ids = [encode_prompt(tokenizer, ex, max_prompt_len) for ex in prompts]
    texts = [ex.prompt_messages[-1]["content"] if ex.prompt_messages else "" for ex in prompts]
    return ids, texts


def build_engine(model: nn.Module, tokenizer, prompts: list[Example], cfg: RLConfig,
                 max_prompt_len: int = 256) -> InferenceEngine:
    """The inference engine of ``cfg.engine``; prune profiles get calibration batches from ``prompts``."""
    calibration = None
    if parse_profile(cfg.engine)["prune"]:
        max_len = max(max_prompt_len, int(getattr(model.config, "max_position_embeddings", 0) or 0))
        encoded = [encode_example(tokenizer, ex, max_len) for ex in prompts[:CALIBRATION_EXAMPLES]]
        calibration = [collate(encoded, tokenizer.pad_token_id)]
    return InferenceEngine(model, cfg.engine, temperature=cfg.temperature, calibration=calibration)


@dataclass
class _Update:
    """What one step's policy update did: counts and the per-minibatch figures."""

    skipped: int = 0
    applied: int = 0
    nonfinite: NonFinite = field(default_factory=NonFinite)
    losses: list[float] = field(default_factory=list)
    clip_fracs: list[float] = field(default_factory=list)
    kl_refs: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    lb_losses: list[float] = field(default_factory=list)


@dataclass
class _Old:
    """The step's theta_old figures. With on-policy reuse (``pending``) they are complete only after the first
    minibatch's forward: ``complete(idx, logp_first [n, T], logits_first [n, T, V])`` writes that minibatch's
    rows, then the weights are taken on the whole batch; ``order`` is the first epoch's minibatch order, drawn
    before the partial recompute (so the recomputed rows are exactly the others)."""

    logp: torch.Tensor  # [N, T] log pi_train(theta_old)
    ent_tok: torch.Tensor  # [N, T] per-token entropy of pi_train(theta_old) (0 on padding)
    ro: Rollouts
    cfg: RLConfig
    weights: torch.Tensor | None = None  # [N, T] detached mismatch weights (None while pending)
    stats: dict[str, float] = field(default_factory=dict)  # mismatch_weights' statistics
    order: torch.Tensor | None = None  # [N] the first epoch's order (reuse only)
    pending: bool = False

    def weigh(self) -> None:
        """``mismatch_weights`` of the complete ``logp`` against the engine's ``logp_infer``."""
        self.weights, st = mismatch_weights(self.logp, self.ro.logp_infer, self.ro.response_mask,
                                            self.cfg.correction_level, self.cfg.mode, self.cfg.icepop_low,
                                            self.cfg.icepop_high)
        self.stats.update(st)

    def complete(self, idx: torch.Tensor, logp_first: torch.Tensor, logits_first: torch.Tensor) -> None:
        """Rows ``idx`` from the first minibatch's forward at theta_old (``[n, T]``, ``[n, T, V]``), then weigh."""
        self.logp[idx] = logp_first.float()
        self.ent_tok[idx] = token_entropy(logits_first, self.ro.response_mask[idx])
        self.pending = False
        self.weigh()


def _ppo_update(model: nn.Module, opt, sched, params, ro, loss_fn, old: _Old, adv: torch.Tensor,
                ref_logp: torch.Tensor | None, lb_sim, cfg: RLConfig,
                gen: torch.Generator, grad_clip: float, winsorize: float = 0.0) -> _Update:
    """``cfg.ppo_epochs`` passes over ``cfg.minibatches`` shuffled minibatches of the step's rollouts
    (``old.logp``, ``old.weights``: ``[N, T]``; ``adv``: ``[N]``); a non-finite loss or gradient norm skips that
    minibatch's update (the tensors behind a non-finite gradient are named in ``nonfinite``); ``params`` are the
    trainable ``(name, parameter)`` pairs, winsorised at ``winsorize`` (``train/stability.py``) before the clip.
    With ``old.pending`` the first minibatch's forward completes ``old`` (on-policy reuse). The model is left in
    eval mode with no gradients held."""
    out = _Update()
    chunks = max(1, cfg.minibatches)
    model.train()
    try:
        for epoch in range(cfg.ppo_epochs):
            order = old.order if (epoch == 0 and old.order is not None) else torch.randperm(ro.num_rollouts,
                                                                                             generator=gen)
            for idx in torch.tensor_split(order, chunks):
                if idx.numel() == 0:
                    continue
                sub = _subset(ro, idx)
                ref = None if ref_logp is None else ref_logp[idx]
                if old.pending:  # the first minibatch at theta_old: its forward is the recompute
                    got: list[torch.Tensor] = []
                    hook = model.get_output_embeddings().register_forward_hook(
                        lambda _m, _i, o, got=got: got.append(o.detach()))

                    def old_fn(logp_first: torch.Tensor, idx=idx, sub=sub, got=got):
                        old.complete(idx, logp_first, _response_logits(got[-1], sub))
                        return old.logp[idx], old.weights[idx]
                    try:
                        loss, lm = minibatch_loss(model, sub, loss_fn, None, adv[idx], None, cfg, ref, lb_sim,
                                                  old_fn=old_fn)
                    finally:
                        hook.remove()
                        got.clear()
                else:
                    loss, lm = minibatch_loss(model, sub, loss_fn, old.logp[idx], adv[idx], old.weights[idx], cfg,
                                              ref, lb_sim)
                opt.zero_grad(set_to_none=True)
                if not math.isfinite(float(loss.detach())):
                    out.skipped += 1
                    out.nonfinite.add(["<loss>"])
                    continue
                loss.backward()
                grad_norm, bad = guard_gradients(params, grad_clip, winsorize)
                if bad is not None:  # a NaN/Inf gradient: discard it, naming the tensors
                    out.skipped += 1
                    out.nonfinite.add(bad)
                    opt.zero_grad(set_to_none=True)
                    continue
                opt.step()
                sched.step()
                out.applied += 1
                out.losses.append(float(loss.detach()))
                out.clip_fracs.append(lm.get("ppo/clipfrac", 0.0))
                out.grad_norms.append(float(grad_norm))
                if "ppo/kl_ref" in lm:
                    out.kl_refs.append(lm["ppo/kl_ref"])
                if "sim_lb_loss" in lm:
                    out.lb_losses.append(lm["sim_lb_loss"])
    finally:
        opt.zero_grad(set_to_none=True)
        model.eval()
    return out


@dataclass
class _SimState:
    """The simulator of a run and what decides when it is refitted and trusted."""

    sim: InferenceSimulator
    gen: torch.Generator  # calibration prompts (the step's `gen` is untouched)
    train_pool: list[int]  # prompt indices the run trains and calibrates on
    held: list[int]  # held-out prompt indices (never trained on): the simulator's error is measured there
    ref_err: float = math.nan  # held-out mean |delta_hat - delta| right after the last full fit
    held_ro: Rollouts | None = None  # the held-out rollouts drawn at the last full fit, re-scored every step


def _simulate(st: _SimState, step: int, cfg: RLConfig, model: nn.Module, engine, tokenizer, prompt_ids: list, ro,
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


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else math.nan


def _step_metrics(rewards: torch.Tensor, mstats: Mapping[str, float], weights: torch.Tensor, mask: torch.Tensor,
                  upd: _Update, ent: float, t_rec: float, routes: list[float]) -> dict[str, float]:
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
    ``reference_model`` (default: a frozen copy of the policy as passed in). Returns the per-step metrics and the
    counters; see ``GRPOResult.summary``.
    """
    if not prompts:
        raise ValueError("run_grpo: no prompts")
    loss_fn = get_policy_loss(cfg.policy_loss)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt, sched = build_optimizer(model, optimizer_config(cfg, grad_clip))
    if cfg.kl_coef > 0 and reference_model is None:
        reference_model = copy.deepcopy(model)
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
        pool = [i for i in pool if i not in set(held)] or pool  # all held out (< 6 prompts): train on them too
        sim = InferenceSimulator.for_model(model, bound=cfg.simulator_bound, seed=seed,
                                           buffer_tokens=cfg.simulator_buffer_tokens,
                                           **{**SIMULATOR_FIT, **(simulator_fit or {})})
        sim_st = _SimState(sim=sim, gen=torch.Generator().manual_seed(seed + 7919), train_pool=pool, held=held)
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
            order = torch.randperm(ro.num_rollouts, generator=gen)  # the first epoch's order, as _ppo_update draws it
            first = torch.tensor_split(order, chunks)[0]
            rest = order[first.numel():]
            reused = int(first.numel())
            logp_old = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)  # [N, T]
            ent_tok = torch.zeros_like(logp_old)  # [N, T]
            if rest.numel():
                sub_rest = _subset(ro, rest)
                lp, lg, _ = _logprobs_and_logits(model, sub_rest)  # [n, T], [n, T, V]
                logp_old[rest], ent_tok[rest] = lp, token_entropy(lg, sub_rest.response_mask)
                del lg
        elif sim is None:
            order = None
            logp_old, logits_old, rstats = _logprobs_and_logits(model, ro, cfg.routing_replay)  # [N, T], [N, T, V]
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
        old = _Old(logp=logp_old, ent_tok=ent_tok, ro=ro, cfg=cfg, order=order, pending=bool(reused))
        if not reused:
            old.weigh()
        measured = old
        sim_metrics: dict[str, float] = {}
        delta_hat = None
        logp_old_used = logp_old
        if sim is not None:
            delta_hat, sim_logp_old, sim_w, sim_metrics = _simulate(sim_st, step, cfg, model, engine, tokenizer,
                                                                    prompt_ids, ro, tf_old, logp_old, seed)
            del tf_old
            if not sim_metrics["sim_fallback"]:
                logp_old_used = sim_logp_old
                old = _Old(logp=sim_logp_old, ent_tok=ent_tok, ro=ro, cfg=cfg, weights=sim_w)
            res.sim_fallbacks += int(sim_metrics["sim_fallback"])
            res.sim_trusted += int(sim_metrics["sim_trusted"])
            res.sim_recal_triggered += int(sim_metrics["sim_recal_triggered"])
        ref_logp = None
        if reference_model is not None:
            ref_logp = train_logprobs(reference_model, ro, grad=False, replay=cfg.routing_replay)  # [N, T]
        routes = routing_disagreement(model, engine, ro)

        lb_sim = sim if (sim is not None and not sim_metrics.get("sim_fallback", 1.0)) else None  # trusted steps only
        upd = _ppo_update(model, opt, sched, params, ro, loss_fn, old, adv, ref_logp, lb_sim, cfg, gen, grad_clip,
                          winsorize)
        weights, mstats = old.weights, measured.stats  # [N, T] complete now (filled by the first minibatch if reused)
        if cfg.mode == "mask":
            icepop_masked = mask & (weights == 0)  # [N, T]
        else:  # what IcePop would mask at these bounds
            w_mask, _ = mismatch_weights(logp_old, ro.logp_infer, mask, cfg.correction_level, "mask",
                                         cfg.icepop_low, cfg.icepop_high)
            icepop_masked = mask & (w_mask == 0)  # [N, T]
        ent = _masked_mean(ent_tok, icepop_masked)
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
