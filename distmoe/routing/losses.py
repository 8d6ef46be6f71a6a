"""Routing losses: the aux load-balance loss (with the attention mask) and the router-anchor KL.

Shapes: ``router_logits`` is a tuple of ``L`` tensors ``z_l: [N, E]`` (one per MoE layer, ``N = B*S`` token
rows, padding included), ``attention_mask: [B, S]`` (``m_t``, flattened to ``[N]``), ``anchor: [L, E]``
(rows ``a_l`` on the simplex). ``p_{l,t} = softmax(z_{l,t})``, ``N_v = sum_t m_t`` valid tokens.

Aux load-balance loss (Switch Transformer: Fedus, Zoph, Shazeer, "Switch Transformers: Scaling to Trillion
Parameter Models with Simple and Efficient Sparsity", https://arxiv.org/abs/2101.03961; balancing losses
for top-k gating go back to Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated
Mixture-of-Experts Layer", https://arxiv.org/abs/1701.06538), computed by transformers'
``load_balancing_loss_func``, pooled over layers and valid tokens::

    f_e   = 1/(L N_v) sum_l sum_t m_t [e in topk(p_{l,t}, k)]      [E], sum_e f_e = k
    P_e   = 1/(L N_v) sum_l sum_t m_t p_{l,t,e}                    [E]
    L_aux = E * sum_e f_e * P_e                                    []  (balanced routing gives k, not 1)

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
                          attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Switch-Transformer load-balance loss, as transformers computes it (balanced value = top_k)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    return load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)


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
