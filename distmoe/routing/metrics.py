"""Routing metrics for evaluation: routing KL to the anchor, expert-load coefficient of variation
(std/mean of top-1 loads; < 0.2 is healthy), top-1 consistency against a reference model.

All functions take router logits of valid tokens only (``select_valid``) and return plain floats
averaged over MoE layers.

Must not: run models (the caller does the forward passes).
"""

from __future__ import annotations

import torch

EPS = 1e-8


def select_valid(router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor
                 ) -> list[torch.Tensor]:
    keep = attention_mask.reshape(-1).bool()  # [B*S]
    return [z[keep].float() for z in router_logits]  # L x [N, E]


def load_cv(top1_counts: torch.Tensor) -> float:
    """[L, E] top-1 counts -> mean over layers of std/mean (population std)."""
    c = top1_counts.to(torch.float64)
    mean = c.mean(-1).clamp_min(EPS)
    return float((c.std(-1, unbiased=False) / mean).mean())


def top1_counts(valid_logits: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    return torch.stack([torch.bincount(z.argmax(-1), minlength=num_experts) for z in valid_logits])


def kl_to_anchor(mean_routing: torch.Tensor, anchor: torch.Tensor) -> float:
    """[L, E] routing distribution vs [L, E] anchor: mean over layers of KL(anchor || routing)."""
    a = anchor.to(torch.float64).clamp_min(EPS)
    a = a / a.sum(-1, keepdim=True)
    p = mean_routing.to(torch.float64).clamp_min(EPS)
    p = p / p.sum(-1, keepdim=True)
    return float((a * (a.log() - p.log())).sum(-1).mean())


def top1_agreement(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[int, int]:
    """(agreeing (token, layer) pairs, total pairs) between two models' valid router logits."""
    agree = sum(int((x.argmax(-1) == y.argmax(-1)).sum()) for x, y in zip(a, b, strict=True))
    total = sum(int(x.shape[0]) for x in a)
    return agree, total
