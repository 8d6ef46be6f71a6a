"""The local SFT loop: task loss + aux-loss-coef * aux + anchor-kl-coef * anchor KL (and, with
``routing.balance`` "bias", the routing-bias update after each step: ``distmoe.model.balance``).

Task loss is next-token cross-entropy on the answer tokens only (labels are -100 on prompt and
padding). Stability guards: gradient-norm clipping; a step whose loss or gradient is NaN/Inf is
skipped (no optimizer update) and counted.

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
from distmoe.train.optim import build_optimizer


@dataclass
class SFTResult:
    steps: int
    skipped_steps: int
    num_examples: int
    losses: list[float] = field(default_factory=list)  # total loss per applied step
    task_losses: list[float] = field(default_factory=list)
    aux_losses: list[float] = field(default_factory=list)
    anchor_kls: list[float] = field(default_factory=list)
    time_s: float = 0.0

    def summary(self) -> dict[str, float]:
        mean = lambda xs: float(sum(xs) / len(xs)) if xs else float("nan")  # noqa: E731
        return {"loss": mean(self.losses), "task_loss": mean(self.task_losses),
                "aux_loss": mean(self.aux_losses), "anchor_kl": mean(self.anchor_kls),
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
             num_experts: int, top_k: int, anchor: torch.Tensor | None
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """Total loss of one batch and its parts."""
    out = forward_with_router(model, batch["input_ids"], batch["attention_mask"])
    task = causal_lm_loss(out.logits, batch["labels"])
    total = task
    parts = {"task_loss": float(task.detach())}
    if routing.aux_loss_coef > 0 and "aux" in routing.balance:
        aux = aux_load_balance_loss(out.router_logits, num_experts, top_k, batch["attention_mask"])
        total = total + routing.aux_loss_coef * aux
        parts["aux_loss"] = float(aux.detach())
    if anchor is not None and routing.anchor_kl_coef > 0:
        kl = anchor_kl(out.router_logits, batch["attention_mask"], anchor, routing.anchor_granularity)
        total = total + routing.anchor_kl_coef * kl
        parts["anchor_kl"] = float(kl.detach())
    return total, parts


def _micro_batches(raw: list, size: int, pad_id: int, device: torch.device) -> list[tuple[dict, float]]:
    """Split one step's sequences into micro-batches, each with its share of the step's supervised tokens."""
    size = size if 0 < size < len(raw) else len(raw)
    batches = [to_device(collate(raw[i:i + size], pad_id), device) for i in range(0, len(raw), size)]
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    total = sum(counts)
    return [(b, (c / total) if total else 1.0 / len(batches)) for b, c in zip(batches, counts, strict=True)]


def train_sft(model: nn.Module, encoded: list[tuple[list[int], list[int]]], pad_id: int,
              train: TrainConfig, routing: RoutingConfig, num_experts: int, top_k: int,
              anchor: torch.Tensor | None, seed: int) -> SFTResult:
    """Run ``train.local_steps`` optimizer steps on ``encoded`` (input_ids, labels) pairs.

    Each step of ``train.batch-size`` sequences runs as micro-batches of ``train.micro-batch-size``
    with gradient accumulation. Each micro-batch's loss is weighted by its share of the step's
    supervised tokens, so the task-loss gradient equals the whole batch's exactly; the aux loss and
    the anchor KL, which are not sums over tokens, are averaged over micro-batches with the same
    weights (equal to the whole batch's when there is one micro-batch). On a model whose base is
    stored below float32 the forwards run under autocast (``model/device.py``); float16 adds a
    gradient scaler.
    """
    if not encoded:
        raise ValueError("train_sft: no training examples")
    torch.manual_seed(seed)
    device = device_of(model)
    if train.gradient_checkpointing != getattr(model, "_distmoe_checkpointing", False):  # a cached model keeps it
        # transformers 5 renamed gradient_checkpointing_* to activation_checkpointing_* (the old names warn)
        new_api = hasattr(model, "activation_checkpointing_enable")
        if train.gradient_checkpointing and new_api:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif train.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif new_api:
            model.activation_checkpointing_disable()
        else:
            model.gradient_checkpointing_disable()
        model._distmoe_checkpointing = train.gradient_checkpointing
    model.train()
    opt, sched = build_optimizer(model, train)
    scaler = torch.amp.GradScaler(device.type, enabled=base_dtype(model) == torch.float16)
    params = [p for p in model.parameters() if p.requires_grad]
    if anchor is not None:
        anchor = anchor.to(device)
    res = SFTResult(steps=0, skipped_steps=0, num_examples=len(encoded))
    t0 = time.perf_counter()
    with BalanceTracker(model, routing.balance_rate) as balance:  # a no-op without routing.balance "bias"
        _steps(model, encoded, pad_id, train, routing, num_experts, top_k, anchor, seed, opt, sched, scaler,
               params, device, res, balance)
    model.eval()
    res.time_s = time.perf_counter() - t0
    return res


def _steps(model, encoded, pad_id, train, routing, num_experts, top_k, anchor, seed, opt, sched, scaler, params,
           device, res: SFTResult, balance: BalanceTracker) -> None:
    for raw in batch_iterator(encoded, train.batch_size, train.local_steps, seed):
        opt.zero_grad(set_to_none=True)
        loss_value, parts_sum, finite = 0.0, {}, True
        for batch, weight in _micro_batches(raw, train.micro_batch_size, pad_id, device):
            balance.start_forward()
            loss, parts = sft_loss(model, batch, routing, num_experts, top_k, anchor)
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
            balance.discard()
            opt.zero_grad(set_to_none=True)
            continue
        scaler.unscale_(opt)
        # the pre-clip total norm is NaN/Inf iff some gradient is; then skip (clipping already
        # scaled those gradients by a non-finite factor, so they are discarded)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, train.grad_clip)
        if not torch.isfinite(grad_norm):
            res.skipped_steps += 1
            balance.discard()
            scaler.update()  # float16: lowers the loss scale; otherwise a no-op
            opt.zero_grad(set_to_none=True)
            continue
        scaler.step(opt)
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
