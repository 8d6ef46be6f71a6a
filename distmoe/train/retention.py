"""Rehearsal-free retention inside the local SFT loop: expert protection, output distillation and the
router-only warm-up. ``train/sft.py`` calls these; ``party/work.py`` builds the ``Retention`` context.

**Expert protection.** Given the protected set ``P: [L, E]`` (``routing/retention.protected_experts``,
from the earlier tasks' anchors) and a scale ``s`` (``retention.protect-lr-scale``), each optimizer
step's update of a protected expert's slice of every expert tensor is scaled::

    theta_e <- theta_e^old + s * (theta_e^AdamW - theta_e^old)        for (l, e) in P

which is the learning rate (and weight decay) of that expert times ``s`` exactly; ``s = 0`` freezes it.
Scaling the gradient instead would not work: Adam normalises it away. An expert's slice is found by
the tensor's layout: fused experts ``[E, ...]`` (``mlp.experts.gate_up_proj``), per-expert modules
(``mlp.experts.<e>.*``), and in ``lora`` mode peft's per-expert adapters of the fused experts
(``lora_A: [E*r, in]``, expert ``e`` = rows ``e*r:(e+1)*r``; ``lora_B: [out, r*E]``, expert ``e`` =
columns ``e::E``, peft's ``ParamWrapper`` layout).

**Output distillation** (Learning without Forgetting: Li & Hoiem, "Learning without Forgetting",
ECCV 2016, https://arxiv.org/abs/1606.09282): on the new task's own batch, with the pre-task model's
logits ``z^ref: [B, S, V]`` (the global model at the start of the task, kept at the party), the current
logits ``z``, temperature ``tau`` and the attention mask ``m: [B, S]``::

    L_distill = tau^2 / sum_t m_t * sum_t m_t KL(softmax(z^ref_t / tau) || softmax(z_t / tau))       []

**Router-only warm-up.** For the first ``N`` local steps of a task (``train.router-warmup-steps``,
counted across the task's rounds) only the router's gradients are kept (the others are dropped before
clipping, so AdamW leaves those tensors and their moments untouched).

**Frozen experts after an expansion** (``retention.expand-experts``, Lifelong-MoE: ``model/expand.py``): the
same update scaling with ``s = 0`` on every expert but the newest ``k``, and on those experts' router rows
(``frozen_masks``)::

    theta_e <- theta_e^old,  R[e, :] <- R^old[e, :]          for every e < E - k, every MoE layer

and their gradients are zeroed before clipping, so the clip norm is that of the slices that train.

Must not: read data, talk to the wire, or decide which tensors travel (``model/trainable.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from distmoe.model.build import describe, router_modules
from distmoe.model.device import autocast_for, device_of
from distmoe.model.trainable import grouped_parameters

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT_MODULE = re.compile(r"\.experts\.(\d+)\.")
_LORA = re.compile(r"\.experts\.(?:base_layer\.)?lora_([AB])\.")


@dataclass
class Retention:
    """What one SFT round needs for retention; every part optional (``None`` / 0 = off)."""

    task_anchors: torch.Tensor | None = None  # [T, L, E] earlier tasks' anchors
    task_anchor_reduce: str = "off"  # off | sum | mean
    protected: torch.Tensor | None = None  # [L, E] bool
    protect_lr_scale: float = 0.0
    ref_state: dict[str, torch.Tensor] | None = None  # the pre-task trainable tensors (canonical names)
    distill_weight: float = 0.0
    distill_temperature: float = 2.0
    router_warmup_steps: int = 0
    task_step_offset: int = 0  # local steps of this task done in earlier rounds
    frozen: torch.Tensor | None = None  # [L, E] bool: experts (and router rows) frozen after an expansion
    notes: list[str] = field(default_factory=list)


def expert_slice_masks(model: nn.Module, protected: torch.Tensor, scale: float
                       ) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """``(parameter, multiplier)`` per trainable expert tensor with a protected slice: the multiplier has the
    parameter's shape, ``scale`` on protected experts' entries and 1 elsewhere. ``protected: [L, E]`` bool."""
    spec = describe(model)
    if tuple(protected.shape) != (len(spec.moe_layers), spec.num_experts):
        raise ValueError(f"protected experts have shape {tuple(protected.shape)}, expected "
                         f"[{len(spec.moe_layers)}, {spec.num_experts}]")
    n_exp = spec.num_experts
    out = []
    for name, p in model.named_parameters():
        if not p.requires_grad or ".experts" not in name:
            continue
        m = _LAYER.search(name)
        if m is None or int(m.group(1)) not in spec.moe_layers:
            continue
        experts = protected[spec.moe_layers.index(int(m.group(1)))].nonzero().flatten().tolist()
        if not experts:
            continue
        mult = torch.ones_like(p, dtype=torch.float32)
        per_module, lora = _EXPERT_MODULE.search(name), _LORA.search(name)
        for e in experts:
            if per_module is not None:
                if int(per_module.group(1)) == e:
                    mult.fill_(scale)
            elif lora is not None and lora.group(1) == "A":
                r = p.shape[0] // n_exp  # [E*r, in]
                mult[e * r:(e + 1) * r] = scale
            elif lora is not None:
                mult[:, e::n_exp] = scale  # [out, r*E]
            elif p.dim() >= 2 and p.shape[0] == n_exp:
                mult[e] = scale  # fused [E, ...]
            else:
                raise ValueError(f"expert protection: cannot find expert {e}'s slice of {name!r} "
                                 f"(shape {tuple(p.shape)})")
        if bool((mult != 1).any()):
            out.append((p, mult))
    return out


def frozen_masks(model: nn.Module, frozen: torch.Tensor) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Dynamic expert expansion (``model/expand.py``): ``(parameter, multiplier)`` that freeze the experts
    ``frozen: [L, E]`` (bool), 0 on their slices of every expert tensor and on their rows of every router weight
    ``[E, H]``, 1 elsewhere."""
    out = expert_slice_masks(model, frozen, 0.0)
    for li, (_, router) in enumerate(router_modules(model)):
        w = router.weight  # [E, H]
        rows = frozen[li].to(torch.bool)
        if not w.requires_grad or not bool(rows.any()):
            continue
        mult = torch.ones_like(w, dtype=torch.float32)
        mult[rows.to(w.device)] = 0.0
        out.append((w, mult))
    return out


class ProtectedUpdate:
    """Scales each step's update of the protected slices: ``before()`` ahead of ``opt.step``, ``after()`` behind it."""

    def __init__(self, masks: list[tuple[nn.Parameter, torch.Tensor]]):
        self.masks = [(p, m.to(p.device)) for p, m in masks]
        self._old: list[torch.Tensor] = []

    def before(self) -> None:
        self._old = [p.detach().clone() for p, _ in self.masks]

    @torch.no_grad()
    def after(self) -> None:
        for (p, m), old in zip(self.masks, self._old, strict=True):
            p.copy_((old + m * (p.float() - old.float())).to(p.dtype))
        self._old = []


def reference_logits(model: nn.Module, ref_state: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]
                     ) -> torch.Tensor:
    """``[B, S, V]`` logits of the model with its trainable tensors replaced by ``ref_state`` (no copy into the
    model: ``torch.func.functional_call``), without gradient."""
    dev = device_of(model)
    with torch.no_grad(), autocast_for(model):
        out = torch.func.functional_call(
            model, ref_state, args=(),
            kwargs={"input_ids": batch["input_ids"].to(dev), "attention_mask": batch["attention_mask"].to(dev),
                    "use_cache": False}, strict=False)
    return out.logits.detach()


def distill_loss(logits: torch.Tensor, ref_logits: torch.Tensor, attention_mask: torch.Tensor,
                 temperature: float) -> torch.Tensor:
    """LwF: ``tau^2`` times the mask-mean over tokens of ``KL(softmax(z_ref/tau) || softmax(z/tau))``."""
    if logits.shape != ref_logits.shape:
        raise ValueError(f"distillation: logits {tuple(logits.shape)} vs reference {tuple(ref_logits.shape)}")
    logq = torch.log_softmax(ref_logits.float() / temperature, dim=-1)  # [B, S, V]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [B, S, V]
    kl = F.kl_div(logp, logq, log_target=True, reduction="none").sum(-1)  # [B, S]
    m = attention_mask.to(kl.dtype)
    return temperature ** 2 * (kl * m).sum() / m.sum().clamp_min(1.0)


def router_params(model: nn.Module) -> set[int]:
    """Ids of the trainable router parameters (the only ones a router-only warm-up step updates)."""
    return {id(p) for p in grouped_parameters(model)["router"]}


def drop_non_router_grads(model: nn.Module, keep: set[int]) -> None:
    for p in model.parameters():
        if p.requires_grad and id(p) not in keep:
            p.grad = None
