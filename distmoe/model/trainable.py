"""Which parameters are trained, and therefore which travel: ``all``, ``router+experts`` or
``lora`` (adapters through ``peft``, on attention, the fused experts and optionally the router; the expert
adapters computed on the routed tokens only, ``expert_lora.py``).

Owns: freezing, the canonical names and order of the trainable tensors, reading and loading them
(strict: exact keys, shapes, finite values), the parameter-group classification (experts / router /
rest) used by the optimizer, and the hash of the frozen base that every party must share.

Must not: build optimizers or touch the wire format (that is ``wire/codec.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from distmoe.config import ModelConfig
from distmoe.model.build import router_modules

GROUPS = ("experts", "router", "rest")


class TrainableError(ValueError):
    """A received set of trainable tensors does not match this model."""


@dataclass(frozen=True)
class TrainableSpec:
    """The exact keys and shapes of the tensors that travel, in canonical (sorted) order."""

    mode: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    base_hash: str  # fingerprint of the frozen base (must be equal on every node)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.shapes)

    @property
    def numel(self) -> int:
        n = 0
        for _, s in self.shapes:
            m = 1
            for d in s:
                m *= d
            n += m
        return n


def lora_config(cfg: ModelConfig, model: nn.Module):
    """The one ``peft.LoraConfig`` of ``lora`` mode, shared by the parties (``apply_trainable``), the server
    (``distmoe.model.adapters``) and the adapter checkpoints: attention projections as modules, the fused
    experts (and, with ``model.lora-router``, the router weight) as ``target_parameters``."""
    from peft import LoraConfig

    targets = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if cfg.lora_experts else []
    if cfg.lora_router:  # "mlp.gate.weight" in most families, "mlp.router.weight" in GPT-OSS
        targets += sorted({f"{name.rsplit('.', 2)[-2]}.{name.rsplit('.', 1)[-1]}.weight"
                           for name, _ in router_modules(model)})
    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, bias="none",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=targets, init_lora_weights=True)


def apply_trainable(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """Freeze/wrap ``model`` per ``cfg.trainable``; returns the (possibly peft-wrapped) model."""
    if cfg.trainable == "all":
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    if cfg.trainable == "router+experts":
        router_names = {n for n, _ in router_modules(model)}
        for name, p in model.named_parameters():
            mod = name.rsplit(".", 1)[0]
            p.requires_grad_(mod in router_names or ".experts" in name)
        return model
    if cfg.trainable == "lora":
        from peft import get_peft_model

        # peft's default B=0 init makes the adapter a no-op; seed A deterministically so every
        # node starts from the same adapter (the server's own initial adapters are what is sent).
        with torch.random.fork_rng():
            torch.manual_seed(cfg.seed + 1)
            pm = get_peft_model(model, lora_config(cfg, model))
        if cfg.lora_experts:  # peft's expert adapters, applied to the routed tokens only (expert_lora.py)
            from distmoe.model.expert_lora import install

            install(pm)
        if cfg.quantize_experts == "nf4" and not next(pm.parameters()).is_meta:  # (a meta model: the server's)
            from distmoe.model.expert_quant import quantize_experts

            quantize_experts(pm)
        return pm
    raise TrainableError(f"unknown model.trainable {cfg.trainable!r}")


def trainable_names(model: nn.Module) -> list[str]:
    return sorted(n for n, p in model.named_parameters() if p.requires_grad)


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached float32 CPU copies of the trainable tensors, keyed by canonical name (what travels is
    float32 and device-free, whatever the party computes on)."""
    params = dict(model.named_parameters())
    return {n: params[n].detach().to("cpu", torch.float32).clone() for n in trainable_names(model)}


def frozen_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}


def spec_of(model: nn.Module, mode: str, base_hash: str = "") -> TrainableSpec:
    """The travelling tensors of ``model``; ``base_hash`` is the base's fingerprint (``base.base_fingerprint``)."""
    params = dict(model.named_parameters())
    names = trainable_names(model)
    return TrainableSpec(mode=mode, shapes=tuple((n, tuple(params[n].shape)) for n in names), base_hash=base_hash)


def check_trainable(state: dict[str, torch.Tensor], spec: TrainableSpec) -> None:
    """``state`` has exactly the keys and shapes of ``spec``, all finite; else ``TrainableError``."""
    expected = dict(spec.shapes)
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise TrainableError(f"trainable tensors do not match the model: missing {missing[:5]}, "
                             f"unexpected {extra[:5]}")
    for name, shape in expected.items():
        t = torch.as_tensor(state[name])
        if tuple(t.shape) != shape:
            raise TrainableError(f"tensor {name!r}: shape {tuple(t.shape)} != expected {shape}")
        if not all_finite(t):
            raise TrainableError(f"tensor {name!r}: contains NaN or Inf")


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite. A CPU tensor of a dtype numpy has is checked through numpy (a view,
    no copy): on one CPU thread ``np.isfinite(...).all()`` is several times faster than ``torch.isfinite(...).all()``
    (about 3 ms against 23 ms for the default model's 7.1M trainable floats); other tensors through torch."""
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64, torch.float16):
        return bool(np.isfinite(t.detach().numpy()).all())
    if not (t.is_floating_point() or t.is_complex()):
        return True
    return bool(torch.isfinite(t).all())


def load_trainable(model: nn.Module, state: dict[str, torch.Tensor], spec: TrainableSpec) -> None:
    """Copy ``state`` into the trainable parameters; exact keys, shapes and finite values."""
    check_trainable(state, spec)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in spec.keys:
            params[name].copy_(torch.as_tensor(state[name]).to(params[name].dtype))


def param_group(name: str, router_prefixes: tuple[str, ...]) -> str:
    """experts / router / rest for a (possibly peft-prefixed) parameter name."""
    if ".experts." in name or name.endswith(".experts") or ".experts" in name:
        return "experts"
    plain = name.replace("base_model.model.", "")
    for pre in router_prefixes:
        if plain.startswith(pre + ".") or plain == pre:
            return "router"
    return "rest"


def grouped_parameters(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    # peft wraps an adapted router as "<router>.base_layer": its adapters live under "<router>."
    prefixes = tuple(n.replace("base_model.model.", "").removesuffix(".base_layer")
                     for n, _ in router_modules(model))
    groups: dict[str, list[nn.Parameter]] = {g: [] for g in GROUPS}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups[param_group(name, prefixes)].append(p)
    return groups
