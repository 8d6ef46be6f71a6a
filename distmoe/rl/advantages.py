"""Group-relative advantages for GRPO.

Paper: Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
https://arxiv.org/abs/2402.03300 (GRPO's outcome-supervised advantage); without the std division it is Dr. GRPO
(Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective", https://arxiv.org/abs/2503.20783).
With ``B`` prompts of ``G`` completions each, rewards ``R: [B, G]`` (or flat ``[B*G]``, groups contiguous)::

    mu_b  = 1/G sum_g R_bg                                   [B, 1]
    sd_b  = sqrt(1/G sum_g (R_bg - mu_b)^2)                  [B, 1]   (population std)
    A_bg  = (R_bg - mu_b) / (sd_b + eps)                     [B, G]   (R_bg - mu_b without std_normalise)
    A_bg  = 0 where all R_b. are equal                       returned flat as [B*G]

Owns: turning per-completion scalar rewards into per-completion advantages, group by group.
Must not: see log-probs, tokens or models; it never modifies its input and never needs gradients.
"""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, std_normalise: bool = True
) -> torch.Tensor:
    """GRPO advantages ``(r - mean_group) / (std_group + eps)``, flattened to ``[B*G]``.

    ``rewards`` is ``[B*G]`` (groups contiguous: completions ``g*G .. g*G+G-1`` share a prompt) or
    ``[B, G]``. ``std_group`` is the population standard deviation (``correction=0``, so a group of one is
    defined; TRL uses Bessel's correction, which only rescales). With ``std_normalise=False`` the result is
    ``r - mean_group`` (Dr. GRPO). A group whose rewards are all equal gets exactly 0 (not a rounding residue).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    r = torch.as_tensor(rewards).detach()
    if not torch.is_floating_point(r):
        r = r.to(torch.float32)
    if r.dim() == 2 and r.shape[1] != group_size:
        raise ValueError(f"rewards of shape {tuple(r.shape)} do not have group_size={group_size} columns")
    if r.dim() not in (1, 2) or r.numel() % group_size != 0:
        raise ValueError(f"rewards of shape {tuple(r.shape)} cannot be split into groups of {group_size}")
    g = r.reshape(-1, group_size)  # [B, G]
    mean = g.mean(dim=1, keepdim=True)  # [B, 1]
    adv = g - mean  # [B, G]
    if std_normalise:
        std = g.std(dim=1, keepdim=True, correction=0)  # [B, 1]
        adv = adv / (std + eps)  # [B, G]
    constant = (g.amax(dim=1, keepdim=True) == g.amin(dim=1, keepdim=True))  # [B, 1] bool
    adv = torch.where(constant, torch.zeros_like(adv), adv)  # [B, G]
    return adv.reshape(-1)  # [B*G]
