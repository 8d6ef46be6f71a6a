"""Public balance: keeps the routers' first-choice load even on a public prompt mixture while a party trains
on its own task (``routing.public-balance-coef``).

Why: the aux loss and the routing bias see only the tokens a party trains on, so they balance that task's
routing; families no party is training drift (the probe's ``strings`` prompts read a load CV of 0.8-1.0 after
training ``lookup`` then ``arith`` even from a base balanced on all three: ``docs/results.md``, Balanced
experts). Balancing the routers on public prompts, the way the probe measures them, acts on that mixture.

Each local step adds to the **router weights' gradient only** the gradient of the per-layer Switch
load-balance loss (Fedus, Zoph, Shazeer 2021, https://arxiv.org/abs/2101.03961; ``routing.losses``) with
``k = 1`` (the first choice: the load the probe's load CV counts) on the next batch of public prompts::

    p_{l,t}   = softmax(z_{l,t})                     public prompt token t, MoE layer l      [E]
    f_{l,e}   = 1/N sum_t [e = argmax_e' p_{l,t,e'}]                                          [L, E]
    P_{l,e}   = 1/N sum_t p_{l,t,e}                                                           [L, E]
    L_pub     = 1/L sum_l E sum_e f_{l,e} P_{l,e}                 (1 when balanced)            []
    g_router += c * dL_pub/d(router weights)                      c = routing.public-balance-coef

Experts, attention and embeddings get no gradient from it (``torch.autograd.grad`` with the router weights
as the only inputs), so it cannot trade task accuracy for balance through the representation; it moves only
which expert a token goes to. The gradient joins the step's before clipping, so the clip and the optimizer
treat it like the task's.

The public set: ``routing.public-balance-path`` (a JSONL file of ``{"prompt": ...}`` lines at every party, as
``routing.probe-path``), else 96 prompts of the public synthetic families for each of ``routing.public-balance-styles``
generator indices no party and not the probe has (``routing.probe.balance_set_prompts``), from ``run.seed``: the
generators vary with the index, so the set spans every variant of the families, while the probe that measures the
load CV is a draw of its own index. Batches of ``routing.public-balance-batch`` prompts cycle over it.

With ``routing.balance-source = "public"`` the routing bias (``model/balance.py``) counts this batch's expert
choices instead of the party's training batch, so the bias too balances the public mixture (``coef`` may then be
0: the public batch is only routed, not differentiated).

**Settling** (``settle_bias``; ``routing.balance-settle-steps = K``, run by ``distmoe.party.settle`` on each
aggregated global model, the coordinator keeping the median: ``distmoe.coordinator.phases.settle``): ``K``
bias-only updates on public batches, with the weights held still (eval mode, no gradient) and a smaller rate
``u_s = routing.balance-settle-rate``, fit the bias to the weights the federation holds::

    for i = 0 .. K-1:  c = first-choice counts of the next public batch    [L, E]
                       b_e <- b_e + u_i * sign(mean_e(c) - c_e)
    u_i = u_s (schedule "constant")   or   u_s * (1 - i/K) (schedule "linear", model.balance.settle_rates)

A constant u leaves the bias jittering by about u around its fixed point, batch to batch; a decaying u averages
that jitter out, as a decaying step size does for SGD.

Privacy: only public prompts and the global weights are read; nothing new leaves the party (the effect travels
inside the weight update like any gradient). Cost: one forward and a router-only backward of a small public
batch per step.

Owns: the public balance batches, the router-only gradient and the settle updates. Must not: read party data,
step the optimizer or talk to the wire.
"""

from __future__ import annotations

import torch
from torch import nn

from distmoe.data.template import chat_ids, collate_prompts
from distmoe.model.build import describe
from distmoe.model.router import forward_with_router
from distmoe.model.trainable import grouped_parameters
from distmoe.routing.losses import aux_load_balance_loss
from distmoe.routing.probe import balance_set_prompts, read_probe_file


class PublicBalanceError(ValueError):
    """The public balance cannot run (no trainable router, an unusable prompt file); the message says which."""


def balance_prompts(seed: int, path: str = "", styles: int = 12) -> tuple[str, ...]:
    """The public balance prompts: the file at ``path`` when given, else the default synthetic set of ``styles``
    generator indices (``routing.public-balance-styles``; ``routing.probe.balance_set_prompts``)."""
    if path:
        try:
            return read_probe_file(path)
        except ValueError as exc:
            raise PublicBalanceError(f"routing.public-balance-path: {exc}") from None
    return balance_set_prompts(seed, styles)


class PublicBalance:
    """Adds ``coef * dL_pub/d(router)`` to the router gradients, one public batch per call."""

    def __init__(self, model: nn.Module, tok, prompts: tuple[str, ...], coef: float, batch: int, max_len: int):
        if coef < 0:
            raise PublicBalanceError(f"routing.public-balance-coef = {coef}: must be >= 0")
        self.model, self.coef = model, coef
        self.params = [p for p in grouped_parameters(model)["router"] if p.requires_grad]
        self.mask: torch.Tensor | None = None  # [B, S] of the last public batch (for the bias count)
        if coef > 0 and not self.params:
            raise PublicBalanceError("routing.public-balance-coef > 0 needs trainable router weights "
                                     "(model.trainable keeps every router frozen)")
        spec = describe(model)
        self.num_experts = spec.num_experts
        ids = [chat_ids(tok, [{"role": "user", "content": p}], add_generation_prompt=True)[-max_len:]
               for p in prompts]
        ids = [x for x in ids if x]
        if not ids:
            raise PublicBalanceError("the public balance prompts encode to no tokens")
        size = max(1, min(batch, len(ids)))
        self.batches = [collate_prompts(ids[i:i + size], tok.pad_token_id) for i in range(0, len(ids), size)]
        self.next = 0

    def _next_batch(self) -> dict[str, torch.Tensor]:
        b = self.batches[self.next % len(self.batches)]
        self.next += 1
        self.mask = b["attention_mask"]
        return b

    def route(self) -> None:
        """One public batch through the model without gradients (its choices are counted by the forward hooks of
        a ``BalanceTracker``; ``mask`` is set for the count): the settle updates' forward."""
        b = self._next_batch()
        with torch.no_grad():
            forward_with_router(self.model, b["input_ids"], b["attention_mask"])

    def add_grads(self) -> float:
        """One public batch: add the router-only gradient of ``coef * L_pub`` to ``.grad`` (with ``coef = 0`` only
        the forward, for a bias that counts the public batch: ``routing.balance-source``); returns ``L_pub``."""
        b = self._next_batch()
        with torch.set_grad_enabled(self.coef > 0):
            out = forward_with_router(self.model, b["input_ids"], b["attention_mask"])
            loss = aux_load_balance_loss(out.router_logits, self.num_experts, 1, b["attention_mask"].to(
                out.router_logits[0].device), "layer")
        if self.coef == 0:
            return float(loss.detach())
        grads = torch.autograd.grad(self.coef * loss, self.params, allow_unused=True)
        for p, g in zip(self.params, grads, strict=True):
            if g is None:  # the routing bias: it only chooses, it has no gradient
                continue
            if p.grad is None:
                p.grad = g.detach().to(p.dtype)
            else:
                p.grad.add_(g.to(p.grad.dtype))
        return float(loss.detach())


def settle_bias(model: nn.Module, public: PublicBalance, tracker, rates: list[float]) -> None:
    """One bias-only update per entry of ``rates`` (its u) on the next public batches, weights held still (module
    docstring, Settling). ``tracker``: a ``model.balance.BalanceTracker`` (its hooks count the choices)."""
    was_training = model.training
    model.eval()
    try:
        for u in rates:
            tracker.rate = u
            tracker.start_forward()
            public.route()
            tracker.count(public.mask)
            tracker.step()
    finally:
        model.train(was_training)
