"""A supported family's own routing rule applied to router logits: the routing distribution distmoe's statistics,
anchor and losses use, the experts the router chooses and the weights it gives them (``Routing``, resolved from a
model by ``routing_of``).

Two kinds of router (``families.RouterRule.scores``), with logits ``z`` ``[N, E]`` of ``N`` token rows, ``k``
experts per token and ``b`` ``[E]`` the bias that only chooses:

softmax (Qwen3-MoE, Mixtral, OLMoE, GPT-OSS, DeepSeek-V2, ...), ``b`` = distmoe's routing bias (zero without)::

    p = softmax(z)                                        routing distribution       [N, E]
    I = topk(z + b, k)                                    the choice                 [N, k]
    s = p[I]  (/ sum_j p[I_j] when norm) * scale          the weights                [N, k]

sigmoid with group-limited top-k (DeepSeek-AI, "DeepSeek-V3 Technical Report", https://arxiv.org/abs/2412.19437,
§2.1.2 eqs. 12-16 and the sequence-wise balance loss eqs. 17-20, the group limit as transformers implements the
paper's node-limited routing; GLM-4.5's ``glm4_moe`` has the same router),
``b`` = the checkpoint's own ``e_score_correction_bias`` (the auxiliary-loss-free bias of Wang, Gao, Zhao, Sun,
Dai, https://arxiv.org/abs/2408.15664), ``G = n_group`` groups of ``E/G`` experts, ``topk_group`` groups kept::

    a   = sigmoid(z)                                      affinities                 [N, E]
    p   = a / sum_e a_e                                   routing distribution       [N, E]
    c   = a + b                                           choice scores              [N, E]
    g_j = sum of the top-2 of c in group j                group scores               [N, G]
    I   = topk(c outside the topk(g, topk_group) groups = -inf, k)    the choice     [N, k]
    s   = a[I]  (/ (sum_j a[I_j] + 1e-20) when norm) * routed_scaling_factor          [N, k]

``p`` is the paper's normalised affinity ``s'_{i,t} = s_{i,t} / sum_j s_{j,t}`` (eq. 19), the distribution its
balance loss averages: the one distribution over the ``E`` experts the router defines. The routing distribution is
carried as routing logits ``r`` with ``softmax(r) = p``: ``r = z`` for a softmax router, ``r = log sigmoid(z)`` for a
sigmoid one (``softmax(log a) = a / sum a``), so the code written on ``softmax(r)`` (router statistics, anchor KL,
aux loss, probe) holds unchanged; ``forward_with_router`` returns them.

``dropped`` experts (``prune-k``) have ``c = -inf``: never chosen, exactly the family's own router with their
correction bias at ``-inf`` (so a group whose best two include a dropped expert scores ``-inf`` too).

Must not: hold state, install hooks (``balance.py``, ``rl/``), or read anything of a model but its config and its
routers' correction bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distmoe.model.families import ModelError, router_rule, topk_weighting

CORRECTION_BIAS = "e_score_correction_bias"  # a sigmoid router's own choice bias (a buffer in the checkpoint)


@dataclass(frozen=True)
class Routing:
    """A model's routing rule (module docstring): its kind, top-k, weighting and groups."""

    sigmoid: bool
    top_k: int
    norm: bool
    scale: float
    n_group: int = 1
    topk_group: int = 1

    def routing_logits(self, z: torch.Tensor) -> torch.Tensor:
        """``[N, E]`` router logits -> routing logits ``r`` with ``softmax(r) = p``, float32, differentiable."""
        return F.logsigmoid(z.float()) if self.sigmoid else z  # [N, E]

    def affinity(self, z: torch.Tensor) -> torch.Tensor:
        """``[N, E]`` -> the scores the weights are taken from: ``sigmoid(z)`` or ``softmax(z)``, float32."""
        return torch.sigmoid(z.float()) if self.sigmoid else torch.softmax(z, dim=-1, dtype=torch.float)

    def choice_scores(self, z: torch.Tensor, bias: torch.Tensor | None = None, dropped: torch.Tensor | None = None,
                      *, from_routing_logits: bool = False) -> torch.Tensor:
        """``[N, E]`` scores whose top-k is the router's choice (``-inf``: never chosen). ``z`` are router logits,
        or routing logits with ``from_routing_logits`` (``a = exp(r)`` for a sigmoid router)."""
        if self.sigmoid:
            c = z.float().exp() if from_routing_logits else torch.sigmoid(z.float())  # [N, E] affinities a
        else:
            c = z.float()  # [N, E] a softmax's top-k is its logits' top-k
        if bias is not None:
            c = c + bias.detach().to(c.device, torch.float32)  # [N, E]
        if dropped is not None and dropped.numel():
            c = c.index_fill(-1, dropped.to(c.device), float("-inf"))
        if self.sigmoid and self.n_group > 1:
            n, e = c.shape
            grouped = c.view(n, self.n_group, e // self.n_group)  # [N, G, E/G]
            g = grouped.topk(min(2, e // self.n_group), dim=-1).values.sum(-1)  # [N, G]
            keep = torch.topk(g, self.topk_group, dim=-1).indices  # [N, topk_group]
            mask = torch.zeros_like(g, dtype=torch.bool).scatter_(1, keep, True)  # [N, G]
            c = c.masked_fill(~mask.repeat_interleave(e // self.n_group, dim=1), float("-inf"))
        return c

    def choose(self, z: torch.Tensor, bias: torch.Tensor | None = None,
               dropped: torch.Tensor | None = None) -> torch.Tensor:
        """``[N, E]`` router logits -> ``[N, k]`` chosen experts, in descending choice score."""
        return torch.topk(self.choice_scores(z, bias, dropped), self.top_k, dim=-1).indices  # [N, k]

    def weights(self, z: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The weights ``[N, k]`` (float32) of experts ``idx`` ``[N, k]`` under logits ``z`` ``[N, E]``, as the
        family's router computes them for its own choice. Differentiable in ``z``."""
        w = self.affinity(z).gather(-1, idx)  # [N, k]
        if self.norm:
            w = w / (w.sum(dim=-1, keepdim=True) + (1e-20 if self.sigmoid else 0.0))
        return w * self.scale if self.scale != 1.0 else w

    def check_pruned(self, dropped: torch.Tensor, num_experts: int) -> None:
        """``ValueError`` unless every allowed choice of groups still holds ``k`` live experts after ``dropped``."""
        if not (self.sigmoid and self.n_group > 1):
            worst = num_experts - int(dropped.numel())
        else:
            per = num_experts // self.n_group
            live = [per - int(((dropped >= j * per) & (dropped < (j + 1) * per)).sum()) for j in range(self.n_group)]
            usable = sorted(n for n in live if n >= min(2, per))  # a group with a dropped expert in its best two: -inf
            worst = sum(usable[:self.topk_group]) if len(usable) >= self.topk_group else 0
        if worst < self.top_k:
            raise ValueError(f"pruning experts {sorted(dropped.tolist())} leaves {worst} live experts in some "
                             f"choice of {self.topk_group} of the {self.n_group} expert groups, fewer than "
                             f"top_k = {self.top_k}")


def routing_of(model: nn.Module) -> Routing:
    """The routing rule of a model of a supported family (``ModelError`` for any other)."""
    rule = router_rule(model)
    cfg = model.config
    norm, scale = topk_weighting(model)
    sigmoid = rule.scores == "sigmoid"
    n_group = int(getattr(cfg, "n_group", 1) or 1) if sigmoid else 1
    topk_group = int(getattr(cfg, "topk_group", 1) or 1) if sigmoid else 1
    return Routing(sigmoid=sigmoid, top_k=int(cfg.num_experts_per_tok), norm=norm, scale=scale, n_group=n_group,
                   topk_group=topk_group)


def is_sigmoid(model: nn.Module) -> bool:
    """Whether ``model``'s router is a sigmoid one (False for a family distmoe does not know)."""
    try:
        return router_rule(model).scores == "sigmoid"
    except ModelError:
        return False


def choice_bias(router: nn.Module, sigmoid: bool, balance_bias: str) -> torch.Tensor | None:
    """The ``[E]`` bias a router adds to its choice scores: a sigmoid router's ``e_score_correction_bias``, a softmax
    router's routing bias ``balance_bias`` when installed, else None."""
    return getattr(router, CORRECTION_BIAS if sigmoid else balance_bias, None)
