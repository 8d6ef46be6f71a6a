"""Router statistics: per-layer sums of per-sequence mean router distributions, ``[L, E]``.

Each sequence contributes, per MoE layer, the mean of its valid tokens' softmax routing
distributions (a row on the simplex), so every row of the sum equals the number of sequences and
a sequence's contribution has L2 norm <= sqrt(L): the quantity the privacy plane noises. The
anchor is the row-normalised aggregate. With ``z_l: [B*S, E]`` per MoE layer and ``m: [B, S]``::

    m_{x,l} = sum_t m_{x,t} softmax(z_{l,x,t}) / sum_t m_{x,t}        [B, L, E]   (per sequence x)
    S       = sum_x m_x                                               [L, E]      (every row sums to N_seq)

(``docs/algorithms.md``, "Router statistics and the anchor"; the DP release: ``docs/privacy.md`` §4.1).

Must not: train, or send anything (the caller hands the array to the wire codec).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from distmoe.model.device import device_of
from distmoe.model.router import forward_with_router


def per_sequence_mean_routing(router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor
                              ) -> torch.Tensor:
    """L x [B*S, E] logits, [B, S] mask -> [B, L, E] per-sequence mean distributions."""
    b, s = attention_mask.shape
    m = attention_mask.to(torch.float32)  # [B, S]
    count = m.sum(1).clamp_min(1.0)  # [B]
    rows = []
    for z in router_logits:
        p = torch.softmax(z.float(), dim=-1).reshape(b, s, -1)  # [B, S, E]
        rows.append((p * m[..., None]).sum(1) / count[:, None])  # [B, E]
    return torch.stack(rows, 1)  # [B, L, E]


@torch.no_grad()
def per_sequence_stats(model: nn.Module, batches: Iterable[dict[str, torch.Tensor]]) -> np.ndarray:
    """``[N, L, E]`` float64 per-sequence mean routing of every sequence with a valid token (eval mode,
    no gradients): what the DP release encodes sequence by sequence (``distmoe.privacy.dp``)."""
    was_training = model.training
    model.eval()
    rows: list[torch.Tensor] = []
    try:
        with torch.no_grad():
            for batch in batches:
                mask = batch["attention_mask"].to(device_of(model))  # [B, S]
                out = forward_with_router(model, batch["input_ids"], mask)
                per_seq = per_sequence_mean_routing(out.router_logits, mask)  # [B, L, E]
                rows.append(per_seq[mask.sum(1) > 0].double().cpu())
    finally:
        model.train(was_training)
    if not rows:
        raise ValueError("per_sequence_stats: no batches")
    return torch.cat(rows).numpy()


@torch.no_grad()
def router_stats(model: nn.Module, batches: Iterable[dict[str, torch.Tensor]]) -> tuple[np.ndarray, int]:
    """Sum over sequences of per-sequence mean routing: ``([L, E] float64, num_sequences)``.

    The model is put in eval mode; no gradients. Sequences with no valid token are skipped.
    """
    was_training = model.training
    model.eval()
    total: torch.Tensor | None = None
    n = 0
    try:
        for batch in batches:
            mask = batch["attention_mask"].to(device_of(model))  # [B, S]
            out = forward_with_router(model, batch["input_ids"], mask)
            per_seq = per_sequence_mean_routing(out.router_logits, mask)  # [B, L, E]
            keep = mask.sum(1) > 0  # [B]
            s = per_seq[keep].sum(0).double().cpu()  # [L, E]
            total = s if total is None else total + s
            n += int(keep.sum())
    finally:
        model.train(was_training)
    if total is None:
        raise ValueError("router_stats: no sequences")
    return total.numpy(), n
