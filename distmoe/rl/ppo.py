"""One GRPO step's policy update: the theta_old figures of the step's rollouts, and ``ppo_epochs x minibatches``
PPO-clipped updates with the registered policy loss (Schulman et al., "Proximal Policy Optimization Algorithms",
https://arxiv.org/abs/1707.06347; the objective and its shapes: ``grpo.py``).

Owns: the train-side log-probs and entropies of rollouts, on-policy reuse (the first minibatch's own forward at
theta_old completes ``logp_old``), the loss of one minibatch (``minibatch_loss``: the policy loss, the KL to the
reference, the load-balance term on simulated routing), and the update loop with its gradient guards (a non-finite
loss or gradient skips that update, naming the tensors).

Must not: sample rollouts, read files or talk to the wire; it leaves the model in eval mode with no gradients held.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from distmoe.config import RLConfig
from distmoe.rl.losses import mismatch_weights
from distmoe.rl.replay import ReplayStats, replay_routes
from distmoe.rl.rollout import Rollouts, train_logprobs
from distmoe.rl.simulator import InferenceSimulator
from distmoe.train.stability import NonFinite, guard_gradients


def subset(ro: Rollouts, idx: torch.Tensor) -> Rollouts:
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


def logprobs_and_logits(model: nn.Module, ro: Rollouts,
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


def masked_mean(x: torch.Tensor, sel: torch.Tensor) -> float:
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


@dataclass
class UpdateTally:
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
class OldPolicy:
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


def ppo_update(model: nn.Module, opt, sched, params, ro, loss_fn, old: OldPolicy, adv: torch.Tensor,
                ref_logp: torch.Tensor | None, lb_sim, cfg: RLConfig,
                gen: torch.Generator, grad_clip: float, winsorize: float = 0.0) -> UpdateTally:
    """``cfg.ppo_epochs`` passes over ``cfg.minibatches`` shuffled minibatches of the step's rollouts
    (``old.logp``, ``old.weights``: ``[N, T]``; ``adv``: ``[N]``); a non-finite loss or gradient norm skips that
    minibatch's update (the tensors behind a non-finite gradient are named in ``nonfinite``); ``params`` are the
    trainable ``(name, parameter)`` pairs, winsorised at ``winsorize`` (``train/stability.py``) before the clip.
    With ``old.pending`` the first minibatch's forward completes ``old`` (on-policy reuse). The model is left in
    eval mode with no gradients held."""
    out = UpdateTally()
    chunks = max(1, cfg.minibatches)
    model.train()
    try:
        for epoch in range(cfg.ppo_epochs):
            order = old.order if (epoch == 0 and old.order is not None) else torch.randperm(ro.num_rollouts,
                                                                                             generator=gen)
            for idx in torch.tensor_split(order, chunks):
                if idx.numel() == 0:
                    continue
                sub = subset(ro, idx)
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
