"""Routing replay (R3): the trainer replays the inference engine's recorded top-k experts
(Ma et al., "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers",
https://arxiv.org/abs/2510.11370; what it measurably removes: ``docs/algorithms.md``, "Routing replay").

With ``L`` MoE layers, ``N`` rollouts, ``S = P + T`` positions (prompt + response), ``k`` = top-k, ``E`` experts::

    I_infer = the engine's recorded experts, -1 where unrouted                 [L, N, S, k]
    z       = x W_r^T, the trainer's own router logits (with gradient)         [rows, E]
    s_j     = exp(z_{I_j}) / sum_m exp(z_{I_m})   (norm_topk_prob)             [rows, k]
            = softmax(z)[I_j]                      (without norm_topk_prob)
    MoE(x)  = sum_j s_j * Expert_{I_j}(x)

Owns: ``RouteRecorder`` (forward hooks on the engine's routers that record, during ``generate``, the
top-k expert indices each router actually used: one prefill call of ``N*P`` rows, then one decode call
of ``N`` rows per generated token), ``replay_weights`` (the train-side weights of replayed experts),
``replay_routes`` (a context manager that makes every router of the training model use the recorded
experts) and ``ReplayStats``.

Exact semantics of a replayed router (Qwen3-MoE ``TopKRouter``, which returns
``(logits, scores, indices)``):

* ``z = x W_r^T`` ``[rows, E]`` is the trainer's own router logit (computed as usual, with gradient);
* the experts are the recorded ones, ``I = I_infer`` ``[rows, k]`` (not ``topk(softmax(z))``);
* the weights are what the HF router computes for its top-k, with ``I`` substituted for its own
  choice: ``p = softmax(z)`` over all ``E`` experts (float32), ``s = p[I]``, and, when the router has
  ``norm_topk_prob`` (the default tiny model does), ``s = s / sum(s)``, i.e. the softmax of ``z``
  restricted to the replayed experts: ``s_j = exp(z_{I_j}) / sum_m exp(z_{I_m})``. Without
  ``norm_topk_prob`` the un-normalised ``p[I]`` is used, exactly as HF does for its own top-k. Other
  supported softmax families differ only in whether they renormalise and by a constant scale
  (``distmoe.model.families.topk_weighting``: Mixtral and GPT-OSS always renormalise, DeepSeek-V2 scales).
  A sigmoid router (DeepSeek-V3, GLM-4.5) weighs the replayed experts by its own rule: ``s = sigmoid(z)[I]``,
  renormalised over the ``k`` with ``norm_topk_prob``, times ``routed_scaling_factor``
  (``distmoe.model.router_rule.Routing.weights``); its group limit and correction bias only choose, so they do
  not enter the replayed weights.
* The gradient therefore flows to the router through ``s`` (and to the replayed experts), but never
  through the choice of experts: routing mismatch is removed at its source, while the router still
  learns how to weight the experts it was given.

A row the engine never routed (the last position of a sequence: its output predicts nothing) is
marked ``-1`` in the recording and keeps the trainer's own routing; such positions produce no
response log-prob, and under causal attention they influence none either.

Must not: change the engine or the policy's weights, sample, or compute losses.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from distmoe.model.build import router_modules
from distmoe.model.router import RouterHooks, topk_experts
from distmoe.model.router_rule import routing_of

UNRECORDED = -1


def _router_indices(out, top_k: int) -> torch.Tensor:
    """The expert indices a router call used: ``out[2]`` of a ``(logits, scores, indices)`` router."""
    if isinstance(out, tuple) and len(out) == 3:
        return out[2].detach()  # [rows, k]
    logits = out[0] if isinstance(out, tuple) else out
    return topk_experts(logits.detach(), top_k)  # [rows, k]


class RouteRecorder(RouterHooks):
    """Context manager recording each router call's expert indices on ``model`` (e.g. during ``generate``).

    Hooks are registered last, so they see the routes after any ``prune-k`` hook of the engine.
    ``assemble(n, prompt_len, seq_len)`` lays the calls out as ``[L, N, S, k]`` (``-1`` where unrouted).
    """

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.routers = router_modules(model)
        if not self.routers:
            raise ValueError("RouteRecorder: the model has no top-k router modules")
        self.top_k = int(model.config.num_experts_per_tok)
        self.calls: dict[int, list[torch.Tensor]] = {li: [] for li in range(len(self.routers))}

    def _record(self, layer: int, out) -> None:
        self.calls[layer].append(_router_indices(out, self.top_k).long())  # [rows, k]

    def assemble(self, n: int, prompt_len: int, seq_len: int) -> torch.Tensor:
        """``[L, N, S, k]`` long: the prefill call fills positions ``0..P-1``, decode call ``j >= 1`` fills
        position ``P + j - 1`` (the token sampled at step ``j - 1``, fed back); the rest stays ``-1``."""
        out = torch.full((len(self.routers), n, seq_len, self.top_k), UNRECORDED, dtype=torch.long)  # [L, N, S, k]
        for li, calls in self.calls.items():
            if not calls:
                raise RuntimeError("RouteRecorder: a router was never called during generation")
            if calls[0].shape[0] != n * prompt_len:
                raise RuntimeError(f"RouteRecorder: the first (prefill) call routed {calls[0].shape[0]} rows, "
                                   f"expected N*P = {n}*{prompt_len}")
            if prompt_len + len(calls) - 1 > seq_len:
                raise RuntimeError(f"RouteRecorder: {len(calls)} router calls for {seq_len - prompt_len} "
                                   "generated tokens")
            out[li, :, :prompt_len] = calls[0].reshape(n, prompt_len, -1)
            for j, c in enumerate(calls[1:], start=1):
                if c.shape[0] != n:
                    raise RuntimeError(f"RouteRecorder: decode call {j} routed {c.shape[0]} rows, expected N = {n}")
                out[li, :, prompt_len + j - 1] = c  # [N, k]
        return out


def replay_weights(router_logits: torch.Tensor, indices: torch.Tensor, norm_topk_prob: bool,
                   scale: float = 1.0) -> torch.Tensor:
    """Train-side weights ``[rows, k]`` of the replayed experts ``indices`` ``[rows, k]`` from the trainer's
    router logits ``[rows, E]``: ``softmax(z)[I]`` (float32), renormalised over the ``k`` replayed experts
    when ``norm_topk_prob`` (as the HF Qwen3-MoE router does for its own top-k), times ``scale`` (the
    family's ``routed_scaling_factor``; ``distmoe.model.families.topk_weighting``). Differentiable in ``z``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)  # [rows, E]
    w = probs.gather(-1, indices)  # [rows, k]
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)  # [rows, k]
    if scale != 1.0:
        w = w * scale
    return w.to(router_logits.dtype)


@dataclass
class ReplayStats:
    """Per MoE layer, from the last forward under ``replay_routes``: which rows were replayed and where the
    replayed expert set differs from the trainer's own top-k (``[rows]`` bool each)."""

    replayed: dict[int, torch.Tensor] = field(default_factory=dict)
    overridden: dict[int, torch.Tensor] = field(default_factory=dict)


@contextmanager
def replay_routes(model: nn.Module, routes: torch.Tensor | None) -> Iterator[ReplayStats]:
    """Within the block, every router of ``model`` uses the recorded experts ``routes`` ``[L, N, S, k]`` for
    a forward over ``[N, S]`` tokens (rows ``n * S + s``), with ``replay_weights``. ``-1`` rows keep the
    model's own routing. ``routes=None``: no replay (a no-op context). Yields the ``ReplayStats``."""
    stats = ReplayStats()
    if routes is None:
        yield stats
        return
    routers = router_modules(model)
    if routes.dim() != 4 or routes.shape[0] != len(routers):
        raise ValueError(f"replay_routes: routes have shape {tuple(routes.shape)}, expected "
                         f"[L={len(routers)}, N, S, k]")
    top_k = int(model.config.num_experts_per_tok)
    if routes.shape[-1] != top_k:
        raise ValueError(f"replay_routes: routes record {routes.shape[-1]} experts per token, the model uses {top_k}")
    flat = routes.reshape(routes.shape[0], -1, top_k)  # [L, N*S, k]
    handles = []
    rule = routing_of(model)  # the family's own weighting of its top-k
    for li, (_, mod) in enumerate(routers):

        def hook(_mod, _inp, out, li=li):
            if not (isinstance(out, tuple) and len(out) == 3):
                raise TypeError("routing replay needs a router returning (logits, scores, indices) (Qwen3-MoE style)")
            logits, scores, own = out  # [rows, E], [rows, k], [rows, k]
            rec = flat[li].to(own.device)  # [rows, k]
            if rec.shape[0] != logits.shape[0]:
                raise ValueError(f"replay_routes: layer {li} routes {logits.shape[0]} rows, the recording has "
                                 f"{rec.shape[0]} (N*S of another batch?)")
            replayed = (rec >= 0).all(-1)  # [rows] bool
            idx = torch.where(replayed[:, None], rec, own)  # [rows, k]
            w = rule.weights(logits, idx).to(scores.dtype)  # [rows, k]
            w = torch.where(replayed[:, None], w, scores)  # [rows, k] unrecorded rows: the router's own weights
            stats.replayed[li] = replayed
            stats.overridden[li] = replayed & (torch.sort(idx, -1).values != torch.sort(own, -1).values).any(-1)
            return logits, w, idx

        handles.append(mod.register_forward_hook(hook))
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()
