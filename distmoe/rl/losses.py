"""Policy losses for local RL: IcePop / TIS mismatch weights and the GRPO / REINFORCE surrogates.

Owns: the per-token train/inference mismatch weights ``M(k)`` with their diagnostics, a registry of policy
losses sharing one signature, and the masked-token entropy helper.
Must not: run models, sample, compute rewards or advantages (see ``advantages.py``), step optimisers, or import
flwr. Weights are always detached: no gradient ever flows into ``logp_train_old`` or ``logp_infer``.

Papers: IcePop (Ring-1T, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model",
https://arxiv.org/abs/2510.18855); TIS (Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training", https://fengyao.notion.site/off-policy-rl); the GRPO surrogate (Shao et al., "DeepSeekMath",
https://arxiv.org/abs/2402.03300) with PPO clipping (Schulman et al., https://arxiv.org/abs/1707.06347); the k3
KL estimator (Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html).

Formulas, with ``B`` sequences, ``T`` response tokens, all inputs ``[B, T]`` (``mask`` 1 on valid tokens)::

    log k   = clamp(logp_train_old - logp_infer, -20, 20)                    [B, T]   (sequence level: its
                                                                                       mean over valid tokens)
    M(k)    = k if low <= k <= high else 0   (IcePop, mode="mask")           [B, T]   detached
            = min(k, high)                   (TIS, mode="truncate")
            = 1                              (mode="none")
    r       = exp(clamp(logp_new - logp_old, -20, 20))                       [B, T]
    l_grpo  = -M(k) * min(r A, clip(r, 1 - eps, 1 + eps_high) A)            [B, T]   (A: [B] broadcast)
    l_rf    = -M(k) * r A                                                    [B, T]   (reinforce)
    kl_k3   = exp(d) - 1 - d,  d = clamp(logp_ref - logp_new, -20, 20)       [B, T]   (when ref_logp is given)
    loss    = mean over sequences with a valid token of
              sum_t mask * (l + kl_coef * kl_k3) / sum_t mask                []

Conventions (``docs/algorithms.md``, "GRPO" and "The mismatch ratio and its corrections"):

* ``k = pi_train(theta_old) / pi_infer(theta_old)``, i.e. ``log k = logp_train_old - logp_infer`` (this sign;
  verl's ``token_k1`` is the negative of it, which is why its asymmetric bounds differ).
* ``r = pi_train(theta) / pi_train(theta_old) = exp(logp_new - logp_old)``; clipping acts on ``r`` only.
* The per-sequence normaliser counts **all** valid tokens (``mask == 1``), including those IcePop zeroes
  (as in the paper and AReaL; verl removes them, which inflates per-token gradients).
* Padding (``mask == 0``) never contributes to a loss, a weight or a statistic, whatever values it holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch

LOG_CLAMP = 20.0  # |log-ratio| cap before exp: exp(20) ~ 4.9e8 stays finite in fp32/bf16

Level = Literal["token", "sequence"]
Mode = Literal["mask", "truncate", "none"]
PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, float]]]


def _valid(mask: torch.Tensor) -> torch.Tensor:
    """Mask as bool, whatever dtype it comes in."""
    return mask.bool() if mask.dtype != torch.bool else mask


def mismatch_weights(
    logp_train_old: torch.Tensor,
    logp_infer: torch.Tensor,
    mask: torch.Tensor,
    level: Level = "token",
    mode: Mode = "mask",
    low: float = 0.5,
    high: float = 5.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Detached train/inference mismatch weights ``w`` ``[B, T]`` and their statistics.

    ``k = exp(clamp(logp_train_old - logp_infer, -20, 20))`` per token. At ``level="sequence"`` each sequence
    uses the geometric mean of its tokens' ``k`` (``exp`` of the mean log-ratio over its valid tokens) on every
    one of its tokens, so a sequence is kept or masked whole.

    * ``mode="mask"`` (IcePop): ``w = k`` if ``low <= k <= high`` (both bounds inclusive), else 0.
    * ``mode="truncate"`` (TIS): ``w = min(k, high)``; ``low`` is **not** used: TIS keeps low-``k`` tokens
      with their small weight.
    * ``mode="none"``: ``w = 1`` (plain GRPO; the statistics are still computed).

    Padding gets ``w = 0``. Statistics count valid tokens only (0.0 when there are none):

    * ``icepop/masked_frac_low`` / ``_high``: share of valid tokens whose (level) ``k < low`` / ``k > high``;
      ``icepop/masked_frac`` their sum; ``icepop/seq_with_masked_token_frac``: share of sequences with a valid
      token that have at least one such token. In ``mode="mask"`` these are exactly what is masked; in the
      other modes they report what IcePop would mask.
    * ``mismatch/logp_abs_diff_mean`` / ``_max``: mean / max ``|logp_train_old - logp_infer|`` (unclamped).
    * ``mismatch/kl_k3``: ``mean(k - 1 - log k)`` with token-level ``k``; ``mismatch/kl_k1``: ``mean(-log k)``;
      ``mismatch/k_mean``: mean token-level ``k``; ``mismatch/num_valid_tokens``.
    """
    if logp_train_old.shape != logp_infer.shape or logp_train_old.shape != mask.shape or logp_infer.dim() != 2:
        raise ValueError(
            f"expected equal [B, T] shapes, got {tuple(logp_train_old.shape)}, {tuple(logp_infer.shape)}, "
            f"{tuple(mask.shape)}"
        )
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    if mode not in ("mask", "truncate", "none"):
        raise ValueError(f"mode must be 'mask', 'truncate' or 'none', got {mode!r}")
    if not 0.0 <= low <= high:
        raise ValueError(f"need 0 <= low <= high, got low={low}, high={high}")

    with torch.no_grad():
        valid = _valid(mask)  # [B, T] bool
        dtype = torch.promote_types(logp_train_old.dtype, torch.float32)
        zero = torch.zeros((), dtype=dtype, device=logp_train_old.device)  # []
        delta = torch.where(valid, logp_train_old.detach().to(dtype) - logp_infer.detach().to(dtype), zero)  # [B, T]
        log_k_tok = delta.clamp(-LOG_CLAMP, LOG_CLAMP)  # [B, T], 0 at padding
        k_tok = torch.exp(log_k_tok)  # [B, T]

        n_tok = valid.sum(dim=1)  # [B]
        if level == "sequence":
            mean_log_k = log_k_tok.sum(dim=1) / n_tok.clamp(min=1).to(dtype)  # [B]
            k = torch.exp(mean_log_k).unsqueeze(1).expand_as(k_tok)  # [B, T] one value per row
        else:
            k = k_tok  # [B, T]

        below = valid & (k < low)  # [B, T] bool
        above = valid & (k > high)  # [B, T] bool
        if mode == "mask":
            w = torch.where(below | above, zero, k)  # [B, T]
        elif mode == "truncate":
            w = k.clamp(max=high)  # [B, T]
        else:
            w = torch.ones_like(k)  # [B, T]
        w = torch.where(valid, w, zero).detach()  # [B, T]

        n_valid = int(n_tok.sum())
        stats: dict[str, float] = {"mismatch/num_valid_tokens": float(n_valid)}
        if n_valid == 0:
            for key in ("icepop/masked_frac_low", "icepop/masked_frac_high", "icepop/masked_frac",
                        "icepop/seq_with_masked_token_frac", "mismatch/logp_abs_diff_mean",
                        "mismatch/logp_abs_diff_max", "mismatch/kl_k3", "mismatch/kl_k1", "mismatch/k_mean"):
                stats[key] = 0.0
            return w, stats
        n_low, n_high = int(below.sum()), int(above.sum())
        has_tok = n_tok > 0  # [B] bool
        seq_hit = (below | above).any(dim=1) & has_tok  # [B] bool
        abs_delta = delta.abs()[valid]  # [N]
        k3 = (k_tok - 1.0 - log_k_tok)[valid]  # [N]
        stats.update({
            "icepop/masked_frac_low": n_low / n_valid,
            "icepop/masked_frac_high": n_high / n_valid,
            "icepop/masked_frac": (n_low + n_high) / n_valid,
            "icepop/seq_with_masked_token_frac": float(seq_hit.sum()) / float(has_tok.sum()),
            "mismatch/logp_abs_diff_mean": float(abs_delta.mean()),
            "mismatch/logp_abs_diff_max": float(abs_delta.max()),
            "mismatch/kl_k3": float(k3.mean()),
            "mismatch/kl_k1": float((-log_k_tok[valid]).mean()),
            "mismatch/k_mean": float(k_tok[valid].mean()),
        })
    return w, stats


# ---------------------------------------------------------------------------------------------------------
# Policy losses: one signature, a registry, a lookup.

POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator adding a loss with the common signature to ``POLICY_LOSSES`` under ``name``."""

    def deco(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return deco


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered loss ``name``; ``ValueError`` listing the valid names otherwise."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; valid names: {', '.join(sorted(POLICY_LOSSES))}") from None


def _prepare(logp_new, logp_old, advantages, mask, weights, ref_logp):
    """Shape checks, padding neutralised *before* any arithmetic (so NaN/inf padding cannot leak into grads)."""
    if logp_new.dim() != 2 or logp_new.shape != logp_old.shape or logp_new.shape != mask.shape:
        raise ValueError(
            f"expected equal [B, T] shapes, got {tuple(logp_new.shape)}, {tuple(logp_old.shape)}, {tuple(mask.shape)}"
        )
    if weights.shape != logp_new.shape:
        raise ValueError(f"weights shape {tuple(weights.shape)} != {tuple(logp_new.shape)}")
    if ref_logp is not None and ref_logp.shape != logp_new.shape:
        raise ValueError(f"ref_logp shape {tuple(ref_logp.shape)} != {tuple(logp_new.shape)}")
    valid = _valid(mask)  # [B, T] bool
    if advantages.dim() == 1:
        if advantages.shape[0] != logp_new.shape[0]:
            raise ValueError(f"advantages shape {tuple(advantages.shape)} does not match batch {logp_new.shape[0]}")
        adv = advantages.detach().unsqueeze(1).expand_as(logp_new)  # [B, T]
    elif advantages.shape == logp_new.shape:
        adv = advantages.detach()  # [B, T]
    else:
        raise ValueError(f"advantages must be [B] or [B, T], got {tuple(advantages.shape)}")
    zero = torch.zeros((), dtype=logp_new.dtype, device=logp_new.device)  # []
    new = torch.where(valid, logp_new, zero)  # [B, T], padding grads are exactly 0
    old = torch.where(valid, logp_old.detach(), zero)  # [B, T]
    adv = torch.where(valid, adv.to(logp_new.dtype), zero)  # [B, T]
    w = torch.where(valid, weights.detach().to(logp_new.dtype), zero)  # [B, T]
    ref = None if ref_logp is None else torch.where(valid, ref_logp.detach().to(logp_new.dtype), zero)  # [B, T]
    return valid, new, old, adv, w, ref


def _reduce(per_token: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over each sequence's valid tokens (all of them, IcePop-masked included), then over sequences.

    Sequences without a valid token are left out of the outer mean; no valid token at all gives 0.
    """
    n_tok = valid.sum(dim=1)  # [B]
    per_seq = (per_token * valid).sum(dim=1) / n_tok.clamp(min=1).to(per_token.dtype)  # [B]
    has_tok = n_tok > 0  # [B] bool
    return (per_seq * has_tok).sum() / has_tok.sum().clamp(min=1).to(per_token.dtype)  # []


def _finish(pg_per_token, valid, new, adv, ratio, ref, kl_coef, clipped):
    """Add the optional k3 KL to the reference, reduce, and build the metrics."""
    metrics: dict[str, float] = {}
    per_token = pg_per_token  # [B, T]
    if ref is not None:
        log_ref_ratio = (ref - new).clamp(-LOG_CLAMP, LOG_CLAMP)  # [B, T] log(pi_ref / pi_theta)
        kl = torch.exp(log_ref_ratio) - 1.0 - log_ref_ratio  # [B, T] k3 estimate of KL(pi_theta || pi_ref)
        if kl_coef != 0.0:
            per_token = per_token + kl_coef * kl  # [B, T]
        metrics["ppo/kl_ref"] = float(_masked_mean(kl.detach(), valid))
    loss = _reduce(per_token, valid)  # []
    with torch.no_grad():
        metrics.update({
            "ppo/clipfrac": float(_masked_mean(clipped.to(ratio.dtype), valid)),
            "ppo/ratio_mean": float(_masked_mean(ratio.detach(), valid)),
            "ppo/adv_abs_mean": float(_reduce(adv.abs(), valid)),  # per-sequence mean |A|, then over sequences
            "ppo/loss": float(loss.detach()),
        })
    return loss, metrics


def _masked_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` ``[B, T]`` over valid tokens; 0 when none."""
    n = valid.sum()  # []
    return (x * valid).sum() / n.clamp(min=1).to(x.dtype)  # []


def _ratio(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``exp(clamp(logp_new - logp_old, ±20))`` (beyond ±20 the ratio, and its gradient, saturate)."""
    return torch.exp((new - old).clamp(-LOG_CLAMP, LOG_CLAMP))  # [B, T]


@register_policy_loss("grpo")
def grpo_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clipped GRPO surrogate, mismatch-weighted, to *minimise*.

    Per token: ``-w * min(r*A, clip(r, 1-clip_eps, 1+clip_eps_high)*A)`` with ``r = exp(logp_new - logp_old)``,
    ``logp_old = log pi_train(theta_old)`` and ``w`` the detached weights from ``mismatch_weights``; plus
    ``kl_coef * k3(pi_theta || pi_ref)`` when ``ref_logp`` is given (not weighted by ``w``). Reduced as a
    per-sequence mean over all valid tokens, then a mean over sequences. ``advantages`` is ``[B]`` (or ``[B, T]``).
    ``ppo/clipfrac`` is the share of valid tokens where the clipped branch is active (zero gradient from ``r``).
    """
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    valid, new, old, adv, w, ref = _prepare(logp_new, logp_old, advantages, mask, weights, ref_logp)
    ratio = _ratio(new, old)  # [B, T]
    unclipped = ratio * adv  # [B, T]
    clipped_obj = ratio.clamp(1.0 - clip_eps, 1.0 + eps_high) * adv  # [B, T]
    surrogate = torch.minimum(unclipped, clipped_obj)  # [B, T]
    clip_active = (clipped_obj < unclipped) & valid  # [B, T] bool
    return _finish(-w * surrogate, valid, new, adv, ratio, ref, kl_coef, clip_active)


@register_policy_loss("reinforce")
def reinforce_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance-weighted REINFORCE, to *minimise*: per token ``-w * r * A`` (no ratio clipping).

    Same reduction, KL term and metrics as ``grpo``; ``clip_eps``/``clip_eps_high`` are accepted for the common
    signature and ignored, so ``ppo/clipfrac`` is 0. At ``r = 1`` its gradient is ``-w * A * grad logp_new``.
    """
    del clip_eps, clip_eps_high
    valid, new, old, adv, w, ref = _prepare(logp_new, logp_old, advantages, mask, weights, ref_logp)
    ratio = _ratio(new, old)  # [B, T]
    no_clip = torch.zeros_like(valid)  # [B, T] bool
    return _finish(-w * ratio * adv, valid, new, adv, ratio, ref, kl_coef, no_clip)


def masked_entropy(logits: torch.Tensor, token_mask: torch.Tensor) -> float:
    """Mean entropy (nats) of the next-token distributions at the tokens where ``token_mask`` is true.

    ``logits`` ``[B, T, V]``, ``token_mask`` ``[B, T]`` (for instance ``valid & (w == 0)`` for the entropy of the
    IcePop-masked tokens). NaN when the mask selects no token (undefined, not zero). No gradient.
    """
    if logits.dim() != 3 or logits.shape[:2] != token_mask.shape:
        raise ValueError(
            f"expected logits [B, T, V] and mask [B, T], got {tuple(logits.shape)}, {tuple(token_mask.shape)}"
        )
    sel = _valid(token_mask)  # [B, T] bool
    if not bool(sel.any()):
        return math.nan
    with torch.no_grad():
        logp = torch.log_softmax(logits[sel].float(), dim=-1)  # [N, V]
        ent = torch.special.entr(logp.exp()).sum(dim=-1)  # [N], 0 * log 0 taken as 0
        return float(ent.mean())
