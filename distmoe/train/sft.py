"""The local SFT loop: task loss + aux-loss-coef * aux + anchor-kl-coef * anchor KL, plus the retention
terms of ``train/retention.py`` when a ``Retention`` context is given (per-task anchor KL, output distillation,
expert protection, router-only warm-up), and, with ``routing.balance`` "bias", the routing-bias update after
each step (``distmoe.model.balance``).

Task loss is next-token cross-entropy on the answer tokens only (labels are -100 on prompt and
padding). Stability guards (``train/stability.py``): optional gradient winsorisation (``train.winsorize``),
gradient-norm clipping; a step whose loss or gradient is NaN/Inf is skipped (no optimizer update) and
counted, with the names of the parameters whose gradient was non-finite (``SFTResult.nonfinite``).

Must not: load data files or talk to the wire; it receives encoded examples and returns numbers.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from distmoe.config import RoutingConfig, TrainConfig
from distmoe.data.template import batch_iterator, collate
from distmoe.model.balance import BalanceTracker
from distmoe.model.device import base_dtype, device_of, to_device
from distmoe.model.router import forward_with_router
from distmoe.routing.losses import anchor_kl, aux_load_balance_loss
from distmoe.routing.retention import task_anchor_kl
from distmoe.train.optim import build_optimizer
from distmoe.train.public_balance import PublicBalance
from distmoe.train.retention import (
    ProtectedUpdate,
    Retention,
    distill_loss,
    drop_non_router_grads,
    expert_slice_masks,
    frozen_masks,
    reference_logits,
    router_params,
)
from distmoe.train.stability import NonFinite, guard_gradients


@dataclass
class SFTResult:
    steps: int
    skipped_steps: int
    num_examples: int
    losses: list[float] = field(default_factory=list)  # total loss per applied step
    task_losses: list[float] = field(default_factory=list)
    aux_losses: list[float] = field(default_factory=list)
    anchor_kls: list[float] = field(default_factory=list)
    distills: list[float] = field(default_factory=list)
    public_balances: list[float] = field(default_factory=list)  # L_pub per applied step (routing.public-balance)
    router_only_steps: int = 0
    time_s: float = 0.0
    nonfinite: NonFinite = field(default_factory=NonFinite)  # what the skipped steps' gradients were

    def summary(self) -> dict[str, float]:
        mean = lambda xs: float(sum(xs) / len(xs)) if xs else float("nan")  # noqa: E731
        return {"loss": mean(self.losses), "task_loss": mean(self.task_losses),
                "aux_loss": mean(self.aux_losses), "anchor_kl": mean(self.anchor_kls),
                "public_balance": mean(self.public_balances),
                "loss_first": self.task_losses[0] if self.task_losses else float("nan"),
                "loss_last": self.task_losses[-1] if self.task_losses else float("nan"),
                "steps": self.steps, "skipped_steps": self.skipped_steps,
                "num_examples": self.num_examples, "time_s": self.time_s}


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[B, S, V] logits, [B, S] labels (-100 = ignore) -> mean next-token CE over supervised tokens.

    The labels are shifted (position t is scored against label t+1, the last position against -100), not the
    logits: slicing ``logits[:, :-1]`` would copy the ``[B, S, V]`` logits and their gradient every step."""
    next_labels = F.pad(labels[:, 1:], (0, 1), value=-100)  # [B, S]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), next_labels.reshape(-1),  # [B*S, V]
                           ignore_index=-100)


def sft_loss(model: nn.Module, batch: dict[str, torch.Tensor], routing: RoutingConfig,
             num_experts: int, top_k: int, anchor: torch.Tensor | None, retention: Retention | None = None
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """Total loss of one batch and its parts."""
    out = forward_with_router(model, batch["input_ids"], batch["attention_mask"])
    task = causal_lm_loss(out.logits, batch["labels"])
    parts = {"task_loss": float(task.detach())}
    total = router_terms(task, out.router_logits, batch["attention_mask"], routing, num_experts, top_k, anchor, parts)
    r = retention
    if r is not None and r.task_anchors is not None and r.task_anchor_reduce != "off" and routing.anchor_kl_coef > 0:
        kl = task_anchor_kl(out.router_logits, batch["attention_mask"], r.task_anchors, routing.anchor_granularity,
                            r.task_anchor_reduce)
        total = total + routing.anchor_kl_coef * kl
        parts["anchor_kl"] = parts.get("anchor_kl", 0.0) + float(kl.detach())
    if r is not None and r.ref_state is not None and r.distill_weight > 0:
        d = distill_loss(out.logits, reference_logits(model, r.ref_state, batch), batch["attention_mask"],
                         r.distill_temperature)
        total = total + r.distill_weight * d
        parts["distill"] = float(d.detach())
    return total, parts


def router_terms(total: torch.Tensor, router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor,
                 routing: RoutingConfig, num_experts: int, top_k: int, anchor: torch.Tensor | None,
                 parts: dict[str, float]) -> torch.Tensor:
    """``total`` plus the router's regularisers of one batch, the same in every loop that trains the router (SFT,
    DPO): the aux load-balance loss (when the balance mode uses it) and the anchor KL (when an anchor is given),
    each times its coefficient (``routing/losses.py``), added in that order; their values go into ``parts``
    (``aux_loss``, ``anchor_kl``)."""
    if routing.aux_loss_coef > 0 and routing.balance.aux:
        aux = aux_load_balance_loss(router_logits, num_experts, top_k, attention_mask, routing.aux_loss_scope)
        total = total + routing.aux_loss_coef * aux
        parts["aux_loss"] = float(aux.detach())
    if anchor is not None and routing.anchor_kl_coef > 0:
        kl = anchor_kl(router_logits, attention_mask, anchor, routing.anchor_granularity)
        total = total + routing.anchor_kl_coef * kl
        parts["anchor_kl"] = float(kl.detach())
    return total


def micro_slices(n: int, size: int) -> list[slice]:
    """One step's ``n`` items cut into micro-batches of ``size`` (``train.micro-batch-size``; 0 or >= n: one), the
    cut every loop that accumulates gradients uses (SFT, DPO)."""
    size = size if 0 < size < n else n
    return [slice(i, i + size) for i in range(0, n, size)]


def _micro_batches(raw: list, size: int, pad_id: int, device: torch.device) -> list[tuple[dict, float]]:
    """Split one step's sequences into micro-batches, each with its share of the step's supervised tokens."""
    batches = [to_device(collate(raw[sl], pad_id), device) for sl in micro_slices(len(raw), size)]
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    total = sum(counts)
    return [(b, (c / total) if total else 1.0 / len(batches)) for b, c in zip(batches, counts, strict=True)]


def set_checkpointing(model: nn.Module, on: bool) -> None:
    """Turn gradient (activation) checkpointing on or off; a cached model keeps the setting between calls."""
    if on != getattr(model, "_distmoe_checkpointing", False):
        # transformers 5 renamed gradient_checkpointing_* to activation_checkpointing_* (the old names warn)
        new_api = hasattr(model, "activation_checkpointing_enable")
        if on and new_api:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif on:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif new_api:
            model.activation_checkpointing_disable()
        else:
            model.gradient_checkpointing_disable()
        model._distmoe_checkpointing = on


def train_sft(model: nn.Module, encoded: list[tuple[list[int], list[int]]], pad_id: int,
              train: TrainConfig, routing: RoutingConfig, num_experts: int, top_k: int,
              anchor: torch.Tensor | None, seed: int, retention: Retention | None = None,
              public: PublicBalance | None = None) -> SFTResult:
    """Run ``train.local_steps`` optimizer steps on ``encoded`` (input_ids, labels) pairs.

    Each step of ``train.batch-size`` sequences runs as micro-batches of ``train.micro-batch-size``
    with gradient accumulation. Each micro-batch's loss is weighted by its share of the step's
    supervised tokens, so the task-loss gradient equals the whole batch's exactly; the aux loss and
    the anchor KL, which are not sums over tokens, are averaged over micro-batches with the same
    weights (equal to the whole batch's when there is one micro-batch). On a model whose base is
    stored below float32 the forwards run under autocast (``model/device.py``); float16 adds a
    gradient scaler. With ``public`` (``train/public_balance.py``) each step adds the router-only gradient of the
    public balance loss after the micro-batches, before clipping.
    """
    if not encoded:
        raise ValueError("train_sft: no training examples")
    torch.manual_seed(seed)
    device = device_of(model)
    set_checkpointing(model, train.gradient_checkpointing)
    model.train()
    opt, sched = build_optimizer(model, train)
    scaler = torch.amp.GradScaler(device.type, enabled=base_dtype(model) == torch.float16)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if anchor is not None:
        anchor = anchor.to(device)
    r = retention
    if r is not None:
        if r.task_anchors is not None:
            r.task_anchors = r.task_anchors.to(device)
        if r.ref_state is not None:
            r.ref_state = {k: v.to(device) for k, v in r.ref_state.items()}
    masks = (expert_slice_masks(model, r.protected, r.protect_lr_scale)
             if r is not None and r.protected is not None and bool(r.protected.any()) else [])
    frozen = ([(p, m.to(p.device)) for p, m in frozen_masks(model, r.frozen)]
              if r is not None and r.frozen is not None and bool(r.frozen.any()) else [])
    masks += frozen  # applied after the protection's (the multipliers compose)
    protect = ProtectedUpdate(masks) if masks else None
    warm_router = router_params(model) if r is not None and r.router_warmup_steps > 0 else None
    res = SFTResult(steps=0, skipped_steps=0, num_examples=len(encoded))
    t0 = time.perf_counter()
    bias_on_public = routing.balance_source == "public"
    if bias_on_public and public is None:
        raise ValueError("routing.balance-source = \"public\" needs the public balance batches (PublicBalance)")
    # a no-op without routing.balance "bias"
    with BalanceTracker(model, routing.balance_rate, routing.balance_count) as balance:
        for it, raw in enumerate(batch_iterator(encoded, train.batch_size, train.local_steps, seed)):
            opt.zero_grad(set_to_none=True)
            loss_value, parts_sum, finite = 0.0, {}, True
            for batch, weight in _micro_batches(raw, train.micro_batch_size, pad_id, device):
                balance.start_forward()
                loss, parts = sft_loss(model, batch, routing, num_experts, top_k, anchor, r)
                if not bias_on_public:
                    balance.count(batch["attention_mask"])
                if not math.isfinite(float(loss.detach())):
                    finite = False
                    break
                scaler.scale(loss * weight).backward()
                loss_value += float(loss.detach()) * weight
                for k, v in parts.items():
                    parts_sum[k] = parts_sum.get(k, 0.0) + v * weight
            if not finite:
                res.skipped_steps += 1
                res.nonfinite.add(["<loss>"])
                balance.discard()
                opt.zero_grad(set_to_none=True)
                continue
            if warm_router is not None and r.task_step_offset + it < r.router_warmup_steps:
                drop_non_router_grads(model, warm_router)  # router-only warm-up step
                res.router_only_steps += 1
            scaler.unscale_(opt)
            if public is not None:  # router weights only; unscaled, as the gradients now are
                balance.start_forward()
                parts_sum["public_balance"] = public.add_grads()
                if bias_on_public:  # the bias counts the public batch's choices (routing.balance-source)
                    balance.count(public.mask)
            for p, m in frozen:  # frozen after an expansion: no gradient, so the clip norm is the trained slices'
                if p.grad is not None:
                    p.grad.mul_(m.to(p.grad.dtype))
            # the pre-clip total norm is NaN/Inf iff some gradient is: skip the step, naming those tensors
            _, bad = guard_gradients(named, train.grad_clip, train.winsorize)
            if bad is not None:
                res.skipped_steps += 1
                res.nonfinite.add(bad)
                balance.discard()
                scaler.update()  # float16: lowers the loss scale; otherwise a no-op
                opt.zero_grad(set_to_none=True)
                continue
            if protect is not None:
                protect.before()
            scaler.step(opt)
            if protect is not None:
                protect.after()
            scaler.update()
            sched.step()
            balance.step()
            res.steps += 1
            res.losses.append(loss_value)
            res.task_losses.append(parts_sum["task_loss"])
            if "aux_loss" in parts_sum:
                res.aux_losses.append(parts_sum["aux_loss"])
            if "anchor_kl" in parts_sum:
                res.anchor_kls.append(parts_sum["anchor_kl"])
            if "distill" in parts_sum:
                res.distills.append(parts_sum["distill"])
            if "public_balance" in parts_sum:
                res.public_balances.append(parts_sum["public_balance"])
    model.eval()
    res.time_s = time.perf_counter() - t0
    return res
