"""Routing losses: the aux load-balance loss (with the attention mask) and the router-anchor KL.

Shapes: ``router_logits`` is a tuple of ``L`` tensors ``z_l: [N, E]`` (one per MoE layer, ``N = B*S`` token
rows, padding included), ``attention_mask: [B, S]`` (``m_t``, flattened to ``[N]``), ``anchor: [L, E]``
(rows ``a_l`` on the simplex). ``p_{l,t} = softmax(z_{l,t})``, ``N_v = sum_t m_t`` valid tokens.

Aux load-balance loss (Switch Transformer: Fedus, Zoph, Shazeer, "Switch Transformers: Scaling to Trillion
Parameter Models with Simple and Efficient Sparsity", https://arxiv.org/abs/2101.03961; balancing losses
for top-k gating go back to Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated
Mixture-of-Experts Layer", https://arxiv.org/abs/1701.06538). ``scope = "layer"`` (the default,
``routing.aux-loss-scope``) is the paper's: one loss per MoE layer, averaged over layers::

    f_{l,e} = 1/N_v sum_t m_t [e in topk(p_{l,t}, k)]              [L, E], sum_e f_{l,e} = k
    P_{l,e} = 1/N_v sum_t m_t p_{l,t,e}                            [L, E]
    L_aux   = 1/L sum_l E * sum_e f_{l,e} * P_{l,e}                []  (balanced routing gives k, not 1)

``scope = "pooled"`` is transformers' ``load_balancing_loss_func`` (called as is): it sums ``f`` and ``P`` over
layers before the product, ``E * sum_e (1/L sum_l f_{l,e}) (1/L sum_l P_{l,e})``, so expert ``e`` of layer 0 and
expert ``e`` of layer 1 count as one expert, and layers whose imbalances fall on different experts cancel
(transformers issue #28255). Why distmoe computes the per-layer form itself rather than calling the library:
transformers has no per-layer variant, and the pooled one leaves the load CV at 1.5 even at 100× the coefficient
(``docs/results.md``, the aux loss per MoE layer).

Anchor KL (DistMoE): ``KL(a_l || p)`` per MoE layer ``l``, averaged over layers, where ``a_l`` is
the global anchor's routing distribution (a row of ``[L, E]``) and ``p`` is the current routing:
- ``token``: each valid token's softmax distribution, as in the DistMoE seed (mean over tokens);
- ``batch``: the mask-weighted batch-mean distribution (constrains aggregate utilisation).
Padding tokens never contribute. The anchor is a constant (no gradient); the gradient reaches the
router through ``p``. With ``a_l`` clamped at ``1e-8`` and renormalised::

    token:  L_anchor = 1/L sum_l 1/N_v sum_t m_t sum_e a_{l,e} (log a_{l,e} - log p_{l,t,e})     []
    batch:  pbar_l   = sum_t m_t p_{l,t} / N_v                                                    [E]
            L_anchor = 1/L sum_l sum_e a_{l,e} (log a_{l,e} - log max(pbar_{l,e}, 1e-8))          []

Why ``batch`` is the default and what ``token`` costs: ``docs/algorithms.md`` (Anchor KL).

Must not: hold state or read config beyond the scalars passed in.
"""

from __future__ import annotations

import torch

EPS = 1e-8


def _flat_mask(attention_mask: torch.Tensor | None, n: int, device) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones(n, device=device)
    return attention_mask.reshape(-1).to(torch.float32)  # [B*S]


def aux_load_balance_loss(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                          attention_mask: torch.Tensor | None, scope: str = "layer") -> torch.Tensor:
    """Switch-Transformer load-balance loss (balanced value = top_k): per layer and averaged (``layer``), or
    transformers' pooled-over-layers form (``pooled``)."""
    if scope == "pooled":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        return load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)
    if scope != "layer":
        raise ValueError(f"unknown aux-loss scope {scope!r} (layer, pooled)")
    mask = _flat_mask(attention_mask, router_logits[0].shape[0], router_logits[0].device)  # [N]
    denom = mask.sum().clamp_min(1.0)
    total = router_logits[0].new_zeros((), dtype=torch.float32)
    for z in router_logits:
        p = torch.softmax(z.float(), dim=-1)  # [N, E]
        chosen = torch.zeros_like(p).scatter_(-1, p.topk(top_k, dim=-1).indices, 1.0)  # [N, E], k ones per row
        f = (chosen * mask[:, None]).sum(0) / denom  # [E], sums to k (no gradient: a count)
        big_p = (p * mask[:, None]).sum(0) / denom  # [E]
        total = total + num_experts * (f * big_p).sum()
    return total / len(router_logits)


def anchor_kl(router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None,
              anchor: torch.Tensor, granularity: str = "batch") -> torch.Tensor:
    """Mean over layers of KL(anchor_l || routing_l); ``anchor`` is ``[L, E]`` rows on the simplex."""
    if len(router_logits) != anchor.shape[0]:
        raise ValueError(f"anchor has {anchor.shape[0]} layers but the model has {len(router_logits)}")
    a = anchor.to(torch.float32).clamp_min(EPS)  # [L, E]
    a = a / a.sum(-1, keepdim=True)
    log_a = a.log()
    mask = _flat_mask(attention_mask, router_logits[0].shape[0], router_logits[0].device)  # [N]
    denom = mask.sum().clamp_min(1.0)
    total = router_logits[0].new_zeros((), dtype=torch.float32)
    for li, z in enumerate(router_logits):
        logp = torch.log_softmax(z.float(), dim=-1)  # [N, E]
        if granularity == "token":
            # KL(a || p_t) = sum_e a_e (log a_e - log p_t,e), averaged over valid tokens
            kl_t = (a[li] * (log_a[li] - logp)).sum(-1)  # [N]
            total = total + (kl_t * mask).sum() / denom
        elif granularity == "batch":
            p_bar = (logp.exp() * mask[:, None]).sum(0) / denom  # [E]
            total = total + (a[li] * (log_a[li] - p_bar.clamp_min(EPS).log())).sum()
        else:
            raise ValueError(f"unknown anchor granularity {granularity!r} (batch, token)")
    return total / len(router_logits)
