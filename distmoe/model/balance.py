"""Auxiliary-loss-free load balancing: a per-expert routing bias used for the top-k choice only
(Wang, Gao, Zhao, Sun, Dai, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts",
2024, https://arxiv.org/abs/2408.15664; the bias of DeepSeek-V3's router).

With router logits ``z: [N, E]`` of ``N`` token rows, the bias ``b: [E]`` of that MoE layer and ``k`` experts per
token::

    I   = topk(z + b, k)                 [N, k]   (the bias only chooses the experts)
    s   = softmax(z)[I]                  [N, k]   (renormalised over the k chosen with norm_topk_prob,
                                                   times the family's scale: ``build.topk_weighting``)
    c_e = sum over valid tokens of [e in I_t]      [E]   after each optimizer step, per layer
          (``routing.balance-count = "first"``: [e = I_t,1], the first choice only)
    b_e <- b_e + u * sign(mean_e(c) - c_e)         [E]

so an expert chosen less than the mean becomes more likely to be chosen; the gating weights ``s`` and
every gradient are those of the plain router (the bias is neither in the loss nor in ``s``). The paper
adds the bias to DeepSeek's sigmoid affinities; for a softmax router distmoe adds it to the logits
(``topk(z + b) = topk(softmax(z) * exp(b))``, a multiplicative correction of the probabilities). Measured on
the tiny model (``bench/retain.py``), a bias on the probabilities themselves barely moved the load of a
peaked router (held-out top-k load CV 0.45-0.8 after 200 steps at u = 0.05), on the logits it did (0.26-0.32).

Where the bias lives: a ``[E]`` float32 ``nn.Parameter`` named ``<router>.balance_bias`` on every router,
with ``requires_grad`` (so it is one of the trainable tensors that travel) but never a gradient (it
enters only the non-differentiable top-k), so the optimizer, gradient clipping and weight decay skip it;
``update_bias`` moves it by the rule above. It therefore travels and aggregates exactly like the
weights: each party updates its copy during local training, and FedAvg of the deltas makes the global
bias the (secure) mean of the parties' biases, inside the same clipped, masked (and, with client-level
DP, noised) update; a party sends no separate load count. Its change over a round is bounded by
``u * local-steps`` per entry. It is also saved in every checkpoint (``trainable.safetensors``).

A sigmoid router (DeepSeek-V3, GLM-4.5: ``router_rule.py``) already has this bias: the checkpoint's own
``e_score_correction_bias`` ``[E]``, added to its sigmoid affinities for the group-limited choice only, which is
exactly where the paper puts it. For these families the routing bias *is* that tensor: ``install_bias`` turns the
router's buffer into a float32 ``nn.Parameter`` of the same name (its value the checkpoint's, not zero) and adds no
hook, since the router's own forward already chooses with it; the same sign rule moves it. A checkpoint of such a
run therefore holds the trained bias under the checkpoint's own name, and ``distmoe export`` needs no
``--drop-routing-bias``: ``from_pretrained`` loads it back into the router's buffer.

Owns: installing the bias and its forward hook on every router of a model, the per-step load count
(``BalanceTracker``) and the bias update; the selection scores the routing metrics use.

Must not: compute losses, read config files or talk to the wire.
"""

from __future__ import annotations

import torch
from torch import nn

from distmoe.config import BALANCE_COUNTS, SETTLE_SCHEDULES
from distmoe.model.families import router_modules, topk_weighting
from distmoe.model.router_rule import CORRECTION_BIAS, choice_bias, is_sigmoid, routing_of

BIAS_NAME = "balance_bias"  # a softmax router's routing bias (a sigmoid router's is CORRECTION_BIAS)
BIAS_NAMES = (BIAS_NAME, CORRECTION_BIAS)  # the last name part of a routing-bias tensor, whichever the family


def bias_name(model: nn.Module) -> str:
    """The attribute of every router of ``model`` that holds its routing bias (installed or not)."""
    return CORRECTION_BIAS if is_sigmoid(model) else BIAS_NAME


def has_bias(model: nn.Module) -> bool:
    routers = router_modules(model)
    name = bias_name(model)
    return bool(routers) and all(isinstance(getattr(m, name, None), nn.Parameter) for _, m in routers)


def biases(model: nn.Module) -> list[torch.Tensor]:
    """Each MoE layer's bias ``[E]``, in layer order (empty when none is installed)."""
    name = bias_name(model)
    return [getattr(m, name) for _, m in router_modules(model)] if has_bias(model) else []


def install_bias(model: nn.Module) -> None:
    """Add a zero bias ``[E]`` and the choosing hook to every router of ``model``; on a sigmoid router, turn its own
    ``e_score_correction_bias`` into the trained bias instead (module docstring). Idempotent."""
    routers = router_modules(model)
    if not routers:
        raise ValueError("routing.balance = \"bias\": the model has no top-k router modules")
    if has_bias(model):
        return
    if is_sigmoid(model):
        for _, mod in routers:
            own = mod._buffers.pop(CORRECTION_BIAS, None)
            if own is None:
                raise ValueError(f"routing.balance = \"bias\": router {type(mod).__name__} has no "
                                 f"{CORRECTION_BIAS} buffer")
            mod.register_parameter(CORRECTION_BIAS, nn.Parameter(own.detach().to(torch.float32)))
        return
    norm, scale = topk_weighting(model)
    for _, mod in routers:
        e = int(getattr(mod, "num_experts", 0) or mod.weight.shape[0])
        mod.register_parameter(BIAS_NAME, nn.Parameter(torch.zeros(e, dtype=torch.float32,
                                                                   device=mod.weight.device)))
        mod.register_forward_hook(_choose_with_bias(norm, scale), prepend=True)


def _choose_with_bias(norm: bool, scale: float):
    def hook(mod, _inp, out):
        if not (isinstance(out, tuple) and len(out) == 3):
            raise TypeError("routing.balance = \"bias\" needs a router returning (logits, scores, indices)")
        logits, _scores, own = out  # [rows, E], [rows, k], [rows, k]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # [rows, E]
        bias = getattr(mod, BIAS_NAME).detach().to(probs.device, torch.float32)  # [E]
        idx = torch.topk(logits.float() + bias, own.shape[-1], dim=-1).indices  # [rows, k]
        w = probs.gather(-1, idx)  # [rows, k]
        if norm:
            w = w / w.sum(dim=-1, keepdim=True)
        if scale != 1.0:
            w = w * scale
        return logits, w.to(logits.dtype), idx

    return hook


def selection_scores(model: nn.Module, valid_logits: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per layer ``[N, E]`` scores whose top-k is the experts the router chooses, from the routing logits
    ``forward_with_router`` returns: ``z + b`` with the bias installed, else ``z`` itself (its top-k is the
    softmax's); for a sigmoid router its group-limited choice scores with its correction bias (``router_rule.py``:
    ``-inf`` outside the chosen groups)."""
    if is_sigmoid(model):
        rule = routing_of(model)
        bs = [choice_bias(m, True, BIAS_NAME) for _, m in router_modules(model)]
        return [rule.choice_scores(r, b, from_routing_logits=True) for r, b in zip(valid_logits, bs, strict=True)]
    bs = biases(model)
    if not bs:
        return valid_logits
    return [z.float() + b.detach().to(z.device, torch.float32) for z, b in zip(valid_logits, bs, strict=True)]


def settle_rates(steps: int, rate: float, schedule: str) -> list[float]:
    """The u of each of the ``steps`` settle updates (``routing.balance-settle-schedule``): ``constant`` ``rate``
    at each; ``linear`` ``rate * (1 - i / steps)`` at update ``i = 0 .. steps-1``. Their sum bounds how far a
    settle moves any bias entry."""
    if schedule not in SETTLE_SCHEDULES:
        raise ValueError(f"routing.balance-settle-schedule must be one of {', '.join(SETTLE_SCHEDULES)}, "
                         f"got {schedule!r}")
    if schedule == "linear":
        return [rate * (1.0 - i / steps) for i in range(steps)]
    return [rate] * steps


class BalanceTracker:
    """Counts, per MoE layer, how often each expert is chosen on valid tokens during local training, and
    applies the bias update after each optimizer step. A no-op on a model without the bias."""

    def __init__(self, model: nn.Module, rate: float, count: str = "topk"):
        if count not in BALANCE_COUNTS:
            raise ValueError(f"routing.balance-count must be one of {', '.join(BALANCE_COUNTS)}, got {count!r}")
        self.model = model
        self.rate = float(rate)
        self.first_only = count == "first"  # count each token's first choice only (its top-1 load)
        self.active = has_bias(model) and self.rate > 0
        self._rule = routing_of(model) if self.active and is_sigmoid(model) else None  # sorts a sigmoid's choice
        self._calls: dict[int, list[torch.Tensor]] = {}
        self.counts: torch.Tensor | None = None  # [L, E] since the last step
        self._handles: list = []

    def __enter__(self) -> BalanceTracker:
        if self.active:
            for li, (_, mod) in enumerate(router_modules(self.model)):
                self._handles.append(mod.register_forward_hook(
                    lambda m, _i, out, li=li: self._calls.setdefault(li, []).append(self._ranked(m, out))))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _ranked(self, mod: nn.Module, out) -> torch.Tensor:
        """``[rows, k]`` chosen experts in descending choice score (a sigmoid router returns them unsorted)."""
        idx = out[2].detach()  # [rows, k]
        if self._rule is None or not self.first_only:
            return idx
        c = self._rule.choice_scores(out[0].detach(), getattr(mod, CORRECTION_BIAS)).gather(-1, idx)  # [rows, k]
        return idx.gather(-1, c.argsort(-1, descending=True))

    def start_forward(self) -> None:
        """Forget router calls recorded since the last ``count`` (e.g. recomputed in a backward pass)."""
        self._calls.clear()

    def count(self, attention_mask: torch.Tensor) -> None:
        """Add the valid tokens' expert choices of the last forward (``attention_mask``: ``[B, S]``)."""
        if not self.active:
            return
        keep = attention_mask.reshape(-1).bool()  # [B*S]
        e = biases(self.model)[0].shape[0]
        rows = []
        for li in sorted(self._calls):
            idx = self._calls[li][0]  # [B*S, k] the first call of this forward, choices in descending score
            if self.first_only:
                idx = idx[:, :1]  # [B*S, 1] the first choice: argmax of z + b
            rows.append(torch.bincount(idx[keep.to(idx.device)].reshape(-1).cpu(), minlength=e))  # [E]
        c = torch.stack(rows).to(torch.float64)  # [L, E]
        self.counts = c if self.counts is None else self.counts + c
        self._calls.clear()

    def step(self) -> None:
        """``b_e += u * sign(mean(c) - c_e)`` per layer, then reset the counts."""
        if not self.active or self.counts is None:
            return
        c = self.counts  # [L, E]
        delta = torch.sign(c.mean(-1, keepdim=True) - c) * self.rate  # [L, E]
        with torch.no_grad():
            for b, d in zip(biases(self.model), delta, strict=True):
                b.add_(d.to(b.device, b.dtype))
        self.counts = None

    def discard(self) -> None:
        """A skipped step: its counts do not move the bias."""
        self.counts = None
        self._calls.clear()
