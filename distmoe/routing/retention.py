"""Retention terms that read only per-task anchors: the per-task anchor KL and the protected-expert set.

Both are driven by the per-task anchors ``A: [T, L, E]``, one row-normalised anchor per earlier task
(built by the coordinator from that task's DP-noised, securely aggregated router statistics, the
``stats:<task>`` phase; ``routing/anchor.py``): nothing else of another party is read.

Per-task anchor KL ("finer-grained anchors", DistMoE): the anchor KL of ``routing/losses.py`` taken
against each earlier task's anchor ``A_j`` separately, then combined with weights ``w_j``::

    L_task-anchor = sum_j w_j * L_anchor(A_j)       w_j = 1 (sum) or 1/T (mean)              []

so a new task is pulled towards every earlier task's routing, not towards the latest statistics only
(which, after a task sequence a, b, c, mix b's routing into c's anchor and forget a's).

Protected experts (expert protection, in the spirit of the expert freezing of Lifelong-MoE, Chen et al.
2023, https://arxiv.org/abs/2305.12281, with the anchors as the measure of which experts a task uses)::

    P[l, e] = max_j A[j, l, e] > m                                                          [L, E] bool

with ``m = retention.protect-mass``: an expert that carries more than ``m`` of some earlier task's routing
mass at layer ``l``. ``train/retention.py`` scales those experts' updates.

Must not: hold state, read config beyond the scalars passed in, or touch parameters.
"""

from __future__ import annotations

import torch

from distmoe.routing.losses import anchor_kl


def check_task_anchors(anchors: torch.Tensor, layers: int, experts: int) -> None:
    """``anchors`` is ``[T, L, E]`` with ``T >= 1``, finite, non-negative; else ``ValueError`` naming the shape."""
    if anchors.dim() != 3 or anchors.shape[0] < 1 or tuple(anchors.shape[1:]) != (layers, experts):
        raise ValueError(f"per-task anchors have shape {tuple(anchors.shape)}, expected [T >= 1, {layers}, {experts}]")
    if not torch.isfinite(anchors).all() or (anchors < 0).any():
        raise ValueError("per-task anchors contain NaN, Inf or negative entries")


def task_anchor_kl(router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None,
                   anchors: torch.Tensor, granularity: str = "batch", reduce: str = "mean") -> torch.Tensor:
    """``sum_j w_j KL(A_j || routing)`` over the anchors ``[T, L, E]``; ``reduce``: ``sum`` or ``mean``."""
    if reduce not in ("sum", "mean"):
        raise ValueError(f"unknown per-task anchor reduction {reduce!r} (sum, mean)")
    kls = [anchor_kl(router_logits, attention_mask, anchors[j], granularity) for j in range(anchors.shape[0])]
    total = torch.stack(kls).sum()  # []
    return total / len(kls) if reduce == "mean" else total


def protected_experts(anchors: torch.Tensor, mass: float) -> torch.Tensor:
    """``[L, E]`` bool: experts whose routing mass in some earlier task's anchor exceeds ``mass``."""
    if not 0 < mass <= 1:
        raise ValueError(f"protect mass must be in (0, 1], got {mass}")
    return (anchors.to(torch.float32).amax(0) > mass)  # [L, E]
