"""Router capture: the routing logits of every MoE layer for a forward pass, and the top-k
assignments recomputed from them.

Transformers returns one ``[B*S, E]`` router-logit tensor per MoE layer with
``output_router_logits=True`` (padding rows included). ``forward_with_router`` returns them as routing logits
``r`` whose softmax is the routing distribution the statistics, the anchor and the losses use
(``router_rule.py``): the logits themselves for a softmax router, ``log sigmoid(z)`` for a sigmoid one
(DeepSeek-V3's normalised affinities). The top-k indices are not returned; for a softmax router without a
bias they are ``topk`` of the logits (``topk_experts``), otherwise ``Routing.choose``. ``RouterRecorder`` uses
forward hooks on the router modules instead (the raw logits), which also works inside ``generate``.

Must not: compute losses (``routing/losses.py``) or statistics (``routing/stats.py``).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
from torch import nn

from distmoe.model.build import router_modules
from distmoe.model.device import autocast_for, device_of
from distmoe.model.router_rule import is_sigmoid, routing_of


@dataclass
class RouterOutput:
    logits: torch.Tensor  # [B, S, V] LM logits
    router_logits: tuple[torch.Tensor, ...]  # L x [B*S, E] routing logits: softmax(r) is the routing distribution

    def stacked(self) -> torch.Tensor:
        return torch.stack(self.router_logits, 0)  # [L, B*S, E]


def forward_with_router(model: nn.Module, input_ids: torch.Tensor,
                        attention_mask: torch.Tensor) -> RouterOutput:
    """One forward pass returning LM logits and per-layer routing logits (module docstring), on the model's device
    (the inputs are moved there) and under autocast when its base is stored below float32."""
    dev = device_of(model)
    with autocast_for(model):
        out = model(input_ids=input_ids.to(dev), attention_mask=attention_mask.to(dev), output_router_logits=True,
                    use_cache=False)
    rl = out.router_logits
    if rl is None or len(rl) == 0:
        raise RuntimeError("the model returned no router logits (is it a Mixture-of-Experts model?)")
    if is_sigmoid(model):  # log sigmoid(z): softmax of it is the normalised affinities
        rl = [routing_of(model).routing_logits(z) for z in rl]
    return RouterOutput(logits=out.logits, router_logits=tuple(rl))


def topk_experts(router_logits: torch.Tensor, k: int) -> torch.Tensor:
    """[N, E] logits -> [N, k] expert indices, as the router chooses them."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [N, E]
    return torch.topk(probs, k, dim=-1).indices  # [N, k]


class RouterHooks(abc.ABC):
    """Forward hooks on every router module for the duration of a ``with`` block (they also fire inside
    ``generate``); subclasses say what to keep from each router's output in ``_record``."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._handles: list = []

    @abc.abstractmethod
    def _record(self, layer: int, out) -> None:
        """Keep what this recorder needs of router ``layer``'s forward output ``out``."""

    def __enter__(self):
        for li, (_, mod) in enumerate(router_modules(self.model)):
            self._handles.append(mod.register_forward_hook(lambda _mod, _inp, out, li=li: self._record(li, out)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class RouterRecorder(RouterHooks):
    """Records each router's logits (``[tokens, E]`` float per call and layer)."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.calls: dict[int, list[torch.Tensor]] = {}

    def _record(self, layer: int, out) -> None:
        logits = out[0] if isinstance(out, tuple) else out
        self.calls.setdefault(layer, []).append(logits.detach().float())  # [tokens, E]
