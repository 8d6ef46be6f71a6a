"""What the inference simulator reads and what it is judged by: the teacher-forced capture of the training model's
internals, the simulated mismatch weights and load-balance loss, the fit metrics (R^2, AUROC, ``compare``), the
stratified held-out split and the experts' usage (the simulator itself: ``simulator.py``).

Owns: these functions of tensors, each with its shapes; ``OFFSET_CLAMP`` (an expert the engine prunes shows up as
-30) and ``FEATURE_CLAMP``.

Must not: fit anything, update the policy or the engine, sample, or import Flower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from distmoe.model.build import router_modules
from distmoe.rl.rollout import Rollouts, train_logprobs

OFFSET_CLAMP = 30.0
FEATURE_CLAMP = 10.0


@dataclass
class TeacherForced:
    """One teacher-forced pass over a rollout batch, sliced to the positions that predict response tokens."""

    logp: torch.Tensor  # [N, T] float32 log pi(response token) (0 on padding)
    logits: torch.Tensor | None  # [N, T, V] float32 temperature-scaled LM logits (None when not captured)
    router: torch.Tensor  # [L, N, T, E] float32 router logits as the routing saw them (after any prune hook)


@torch.no_grad()
def capture(model: nn.Module, ro: Rollouts, lm_logits: bool = True) -> TeacherForced:
    """``train_logprobs`` of ``model`` on ``ro`` plus its LM logits and every router's logits (forward hooks,
    registered last, so a prune hook's ``-inf`` logits are what is recorded)."""
    routers = router_modules(model)
    if not routers:
        raise ValueError("capture: the model has no top-k router modules")
    got_r: dict[int, torch.Tensor] = {}
    got_h: list[torch.Tensor] = []
    handles = []
    for li, (_, mod) in enumerate(routers):
        def hook(_mod, _inp, out, li=li):
            got_r[li] = (out[0] if isinstance(out, tuple) else out).detach().float()  # [N*(P+T), E]
        handles.append(mod.register_forward_hook(hook))
    if lm_logits:
        handles.append(model.get_output_embeddings().register_forward_hook(
            lambda _m, _i, out: got_h.append(out.detach())))
    try:
        logp = train_logprobs(model, ro, grad=False).float()  # [N, T]
    finally:
        for h in handles:
            h.remove()
    n, s = ro.sequences.shape
    plen, t = ro.prompt_len, ro.response.shape[1]
    router = torch.stack([got_r[li].reshape(n, s, -1)[:, plen - 1:plen - 1 + t] for li in range(len(routers))])
    logits = None
    if lm_logits:
        logits = got_h[-1][:, plen - 1:plen - 1 + t].float() / ro.temperature  # [N, T, V]
    return TeacherForced(logp=logp, logits=logits, router=router)


def topk_sets(z: torch.Tensor, k: int) -> torch.Tensor:
    """[..., E] logits -> [..., k] sorted top-k expert indices (softmax order = logit order)."""
    return torch.sort(torch.topk(z, k, dim=-1).indices, dim=-1).values


def simulated_weights(logp_infer: torch.Tensor, delta_hat: torch.Tensor, mask: torch.Tensor,
                      bound: float = 0.5, level: str = "token",
                      clip: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """``(logp_old_sim, weights, stats)`` from a predicted ``delta_hat`` ``[N, T]`` (all detached).

    ``logp_old_sim = logp_infer + delta_hat`` per token (so the loss's ratio is
    ``exp(logp_new - logp_infer - delta_hat)``), at either level.

    * ``level="token"``: ``weights = exp(delta_hat)`` where ``|delta_hat| <= bound``, 0 beyond it (masked, not
      clipped).
    * ``level="sequence"``: each sequence uses the mean of ``delta_hat`` over its valid tokens,
      ``d_seq = mean_t delta_hat_t`` (so ``exp(d_seq)`` is the geometric mean of the per-token ``k_hat``, as
      ``losses.mismatch_weights`` does with the true ``k``), on every one of its tokens:
      ``exp(d_seq)`` if ``|d_seq| <= bound`` else 0, i.e. a sequence is kept or masked whole.

    With ``clip`` (the seed's form, off by default) ``delta_hat`` is first clamped to ``[-bound, bound]`` per
    token, so nothing is masked and the ratio uses the clamped value; ``stats["sim/clipped_frac"]`` is the share
    of valid tokens whose ``|delta_hat|`` exceeded the bound (0.0 without ``clip``).

    Padding gets weight 0. ``stats["sim/masked_frac"]``: share of valid tokens masked.
    """
    if bound <= 0 or not math.isfinite(bound):
        raise ValueError(f"bound must be a finite number > 0, got {bound}")
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    with torch.no_grad():
        valid = mask.bool()
        d = delta_hat.detach().float()
        d = torch.where(valid, d, torch.zeros_like(d))  # [N, T] padding values never count
        clipped = float((valid & (d.abs() > bound)).sum()) / max(int(valid.sum()), 1) if clip else 0.0
        if clip:
            d = d.clamp(-bound, bound)  # [N, T]
        if level == "sequence":
            n_tok = valid.sum(1).clamp(min=1).to(d.dtype)  # [N]
            d_lvl = (d.sum(1) / n_tok)[:, None].expand_as(d)  # [N, T] one value per row
        else:
            d_lvl = d  # [N, T]
        inside = (d_lvl.abs() <= bound) & valid  # [N, T]
        weights = torch.where(inside, torch.exp(d_lvl.clamp(-bound, bound)), torch.zeros_like(d))  # [N, T]
        logp_old_sim = torch.where(valid, logp_infer.detach().float() + d, torch.zeros_like(d))  # [N, T]
        n = int(valid.sum())
        masked = float((valid & ~inside).sum()) / max(n, 1)
    return logp_old_sim, weights, {"sim/masked_frac": masked, "sim/clipped_frac": clipped}


def lb_loss_simulated(router_logits_train, offset: torch.Tensor, mask: torch.Tensor | None, num_experts: int,
                      top_k: int) -> torch.Tensor:
    """Load-balance loss (transformers' ``load_balancing_loss_func``: ``E * sum_i f_i P_i`` pooled over layers)
    on the simulated routing ``z_train + o``: ``f`` from its top-k, ``P = softmax(z_train + o)``.

    ``router_logits_train``: L x ``[B*S, E]`` (a tuple, as ``out.router_logits``) or a ``[L, B*S, E]`` tensor;
    ``offset`` ``[L, E]`` is a constant (detached); gradients flow through ``z_train``. ``mask`` ``[B, S]``
    excludes padding (None: every row counts). With ``offset == 0`` it is the SFT aux loss with
    ``routing.aux-loss-scope = pooled`` (kept pooled so that the long-run simulator results stay reproducible).
    """
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    layers = list(router_logits_train)
    if offset.shape != (len(layers), num_experts):
        raise ValueError(f"offset has shape {tuple(offset.shape)}, expected ({len(layers)}, {num_experts})")
    off = offset.detach()
    sim = tuple(z + off[li].to(z.dtype) for li, z in enumerate(layers))
    return load_balancing_loss_func(sim, num_experts, top_k, mask)


def r2_score(pred: torch.Tensor, target: torch.Tensor) -> float:
    """Coefficient of determination of ``pred`` for ``target`` (1-D); NaN when ``target`` is constant."""
    y = target.double()
    sst = float(((y - y.mean()) ** 2).sum())
    if y.numel() < 2 or sst <= 0.0:
        return math.nan
    return 1.0 - float(((y - pred.double()) ** 2).sum()) / sst


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Rank-based AUROC (Mann-Whitney U, ties get average ranks); NaN without both classes."""
    s = scores.detach().double().cpu().numpy()
    y = labels.detach().bool().cpu().numpy()
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), dtype=np.float64)
    ranks[order] = np.arange(1, len(s) + 1, dtype=np.float64)
    _, inv, counts = np.unique(s, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=ranks)
    ranks = (sums / counts)[inv]  # average rank within each tie group
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def compare(delta_hat: torch.Tensor, delta: torch.Tensor, mask: torch.Tensor, r2_min: float = 0.1,
            auroc_min: float = 0.7, top_frac: float = 0.1) -> dict[str, float]:
    """The metrics mode: ``delta_hat`` vs the true recompute ``delta`` on valid tokens.

    ``r2``: R^2 of the signed delta; ``auroc``: AUROC of ``|delta_hat|`` for the tokens whose ``|delta|`` is in
    the top ``top_frac`` (at least one token); ``degraded``: 1.0 when ``r2 < r2_min`` or ``auroc < auroc_min``
    (or either is undefined), else 0.0; ``abs_err``: mean ``|delta_hat - delta|``.
    """
    valid = mask.bool()
    p, y = delta_hat[valid].float(), delta[valid].float()
    r2 = r2_score(p, y)
    n = int(y.numel())
    a = math.nan
    if n >= 2:
        n_top = max(1, int(math.ceil(top_frac * n)))
        labels = torch.zeros(n, dtype=torch.bool, device=y.device)
        labels[torch.argsort(y.abs(), descending=True, stable=True)[:n_top]] = True
        a = auroc(p.abs(), labels)
    ok = (not math.isnan(r2)) and (not math.isnan(a)) and r2 >= r2_min and a >= auroc_min
    return {"r2": r2, "auroc": a, "degraded": 0.0 if ok else 1.0,
            "abs_err": float((p - y).abs().mean()) if n else math.nan}


def heldout_split(lengths: list[int], frac: float, seed: int = 0) -> list[int]:
    """Indices of the held-out prompts: the prompts sorted by length are cut into three equal groups (short,
    medium, long) and ``max(1, round(frac * group size))`` are drawn (seeded) from each; ``[]`` when ``frac`` is 0
    or there are fewer than 3 prompts. Sorted."""
    if not 0.0 <= frac < 1.0:
        raise ValueError(f"heldout_split: frac must be in [0, 1), got {frac}")
    if frac == 0.0 or len(lengths) < 3:
        return []
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    g = torch.Generator().manual_seed(int(seed) + 104_729)
    out: list[int] = []
    for grp in np.array_split(np.asarray(order), 3):
        take = max(1, int(round(frac * len(grp))))
        pick = torch.randperm(len(grp), generator=g)[:take].tolist()
        out.extend(int(grp[j]) for j in pick)
    return sorted(out)


def expert_usage(router: torch.Tensor, mask: torch.Tensor | None, top_k: int) -> torch.Tensor:
    """``[L, N, T, E]`` router logits and a ``[N, T]`` mask (None: every token) -> ``[L, E]`` share of the top-k
    picks per expert over the valid tokens (each row sums to 1; uniform when there is no valid token)."""
    n_e = router.shape[-1]
    z = router.reshape(router.shape[0], -1, n_e) if mask is None else router[:, mask.bool()]  # [L, n, E]
    if z.shape[1] == 0:
        return torch.full((router.shape[0], n_e), 1.0 / n_e, device=router.device)
    picks = torch.topk(z, top_k, dim=-1).indices  # [L, n, k]
    counts = torch.zeros(z.shape[0], n_e, device=router.device).scatter_add_(
        1, picks.reshape(z.shape[0], -1), torch.ones(z.shape[0], picks[0].numel(), device=router.device))
    return counts / counts.sum(1, keepdim=True)
