"""The local SFT loop: task loss + aux-loss-coef * aux + anchor-kl-coef * anchor KL.

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
    if routing.aux_loss_coef > 0:
        aux = aux_load_balance_loss(out.router_logits, num_experts, top_k, batch["attention_mask"])
        total = total + routing.aux_loss_coef * aux
        parts["aux_loss"] = float(aux.detach())
    if anchor is not None and routing.anchor_kl_coef > 0:
        kl = anchor_kl(out.router_logits, batch["attention_mask"], anchor, routing.anchor_granularity)
        total = total + routing.anchor_kl_coef * kl
        parts["anchor_kl"] = float(kl.detach())
    return total, parts


def train_sft(model: nn.Module, encoded: list[tuple[list[int], list[int]]], pad_id: int,
              train: TrainConfig, routing: RoutingConfig, num_experts: int, top_k: int,
              anchor: torch.Tensor | None, seed: int) -> SFTResult:
    """Run ``train.local_steps`` optimizer steps on ``encoded`` (input_ids, labels) pairs."""
    if not encoded:
        raise ValueError("train_sft: no training examples")
    torch.manual_seed(seed)
    model.train()
    opt, sched = build_optimizer(model, train)
    params = [p for p in model.parameters() if p.requires_grad]
    res = SFTResult(steps=0, skipped_steps=0, num_examples=len(encoded))
    t0 = time.perf_counter()
    for raw in batch_iterator(encoded, train.batch_size, train.local_steps, seed):
        batch = collate(raw, pad_id)
        loss, parts = sft_loss(model, batch, routing, num_experts, top_k, anchor)
        opt.zero_grad(set_to_none=True)
        if not math.isfinite(float(loss.detach())):
            res.skipped_steps += 1
            continue
        loss.backward()
        # the pre-clip total norm is NaN/Inf iff some gradient is; then skip (clipping already
        # scaled those gradients by a non-finite factor, so they are discarded)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, train.grad_clip)
        if not torch.isfinite(grad_norm):
            res.skipped_steps += 1
            opt.zero_grad(set_to_none=True)
            continue
        opt.step()
        sched.step()
        res.steps += 1
        res.losses.append(float(loss.detach()))
        res.task_losses.append(parts["task_loss"])
        if "aux_loss" in parts:
            res.aux_losses.append(parts["aux_loss"])
        if "anchor_kl" in parts:
            res.anchor_kls.append(parts["anchor_kl"])
    model.eval()
    res.time_s = time.perf_counter() - t0
    return res
