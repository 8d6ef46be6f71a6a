"""Dynamic expert expansion (``retention.expand-experts``): model surgery that adds experts and router rows to
every MoE layer, and the masks that freeze the earlier experts while a new task trains.

Lifelong-MoE (Chen et al., "Lifelong Language Pretraining with Distribution-Specialized Experts", ICML 2023,
https://arxiv.org/abs/2305.12281): at each new task after the first, ``k`` experts are added to every MoE layer
(and ``k`` rows to its router); the earlier experts and their router rows are frozen while the new task trains,
so the earlier tasks' expert weights and router logits are kept exactly. For MoE layer ``l`` with ``E``
experts, fused expert tensors ``W^l: [E, ...]`` and router ``R^l: [E, H]``, and the sources ``s^l_1..s^l_k``
(the ``k`` experts with the most routing mass in the latest anchor, ties by index; experts ``0..k-1`` when
there is no anchor)::

    W'^l = [W^l ; W^l[s^l_1] ; ... ; W^l[s^l_k]]            [E + k, ...]   (new experts copy their sources)
    R'^l = [R^l ; R^l[s^l_1] ; ... ; R^l[s^l_k]]            [E + k, H]     (new router rows copy theirs)

Old experts' weights and router rows are unchanged. A copy ties with its source, so a token whose top-k holds a
source gets the copy in place of its k-th expert (its output changes at the expansion); a token whose top-k stays
among the old experts gets the same expert outputs; with ``norm_topk_prob`` its routing weights are unchanged too
(renormalised over the chosen experts), without it they shrink by the new experts' softmax mass (zero as their
logits go to -inf).

While a task trains after an expansion, every expert but the ``k`` newest is frozen (``frozen_set``; the update
multiplier 0 on those experts' slices of the fused tensors and on their router rows is
``train.retention.frozen_masks``, applied around each optimizer step by ``ProtectedUpdate``).

Supported: the families whose MoE layers hold fused experts ``gate_up_proj [E, 2I, H]`` / ``down_proj
[E, H, I]`` and a bias-free ``TopKRouter`` ``weight [E, H]`` (``EXPANDABLE``: qwen3_moe, qwen2_moe, olmoe,
flex_olmo, mixtral; not gpt_oss, whose router has a bias, nor deepseek_v2, untested), in ``model.trainable`` = ``all``
or ``router+experts`` (both send the whole expert and router tensors). ``lora`` adapters of fused experts are
laid out per expert count and a routing bias (``routing.balance`` "bias") has a slot per expert: both refused.

Must not: read data or anchors from disk, decide when to expand (the coordinator does, ``coordinator/expand.py``)
or touch the wire.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from distmoe.config import RunConfig, expansion_tasks
from distmoe.model.balance import BIAS_NAME
from distmoe.model.build import ModelError, describe, router_modules

KEY = "retention.expand-experts"
# family -> the config field that holds its routed expert count (saved with the expanded model's config.json)
EXPANDABLE = {"qwen3_moe": "num_experts", "qwen2_moe": "num_experts", "olmoe": "num_experts",
              "flex_olmo": "num_experts", "mixtral": "num_local_experts"}
EXPERT_TENSORS = ("gate_up_proj", "down_proj")
BASE_ATTR = "_distmoe_base_experts"


def _moe_blocks(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """``(experts, router)`` per MoE layer, in layer order; ``ModelError`` naming the key when unsupported."""
    family = model.config.model_type
    if family not in EXPANDABLE:
        raise ModelError(f"config key '{KEY}': expert expansion supports the {', '.join(EXPANDABLE)} families, "
                         f"not {family!r}")
    if getattr(model, "peft_config", None) is not None:
        raise ModelError(f"config key '{KEY}': expert expansion needs model.trainable = all or router+experts "
                         "(lora adapters of the fused experts are laid out per expert count)")
    modules = dict(model.named_modules())
    out = []
    for name, router in router_modules(model):
        parent = modules[name.rsplit(".", 1)[0]]
        experts = getattr(parent, "experts", None)
        params = dict(router.named_parameters(recurse=False))
        if BIAS_NAME in params:
            raise ModelError(f"config key '{KEY}': a routing bias (routing.balance \"bias\") has one slot per "
                             "expert; expert expansion cannot be combined with it")
        if experts is None or set(params) != {"weight"} or any(
                not isinstance(getattr(experts, t, None), nn.Parameter) for t in EXPERT_TENSORS):
            raise ModelError(f"config key '{KEY}': MoE layer {name!r} is not fused experts "
                             f"({'/'.join(EXPERT_TENSORS)}) with a bias-free router; cannot expand it")
        out.append((experts, router))
    return out


def stages(cfg: RunConfig, experts: int) -> list[int]:
    """The expert counts the run goes through, in order (``[experts]`` when expansion is off): one more stage for each
    task of ``config.expansion_tasks`` (the rule ``coordinator.expand.due`` applies as the run goes)."""
    k = cfg.retention.expand_experts
    return [experts + i * k for i in range(1 + (len(expansion_tasks(cfg.schedule.phases)) if k else 0))]


def check_expandable(model: nn.Module) -> None:
    """``ModelError`` naming the key unless ``model`` can be expanded (checked when a run starts)."""
    _moe_blocks(model)


def default_sources(anchor: np.ndarray | None, layers: int, experts: int, k: int) -> list[list[int]]:
    """Per MoE layer, the ``k`` experts the new ones copy: the most routing mass in ``anchor`` ``[L, E']`` (only
    its first ``experts`` columns: an older anchor is zero-padded), ties by lower index; ``0..k-1`` without one."""
    if k < 1:
        raise ValueError(f"expand by k >= 1 experts, got {k}")
    if anchor is None:
        return [[e % experts for e in range(k)] for _ in range(layers)]
    a = np.asarray(anchor, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != layers or a.shape[1] < experts:
        raise ValueError(f"anchor of shape {a.shape} does not fit {layers} MoE layers x {experts} experts")
    out = []
    for row in a[:, :experts]:
        order = sorted(range(experts), key=lambda e: (-row[e], e))
        out.append([order[i % experts] for i in range(k)])
    return out


@torch.no_grad()
def expand_experts(model: nn.Module, sources: list[list[int]]) -> int:
    """Add ``len(sources[l])`` experts to MoE layer ``l`` (the same count everywhere), copies of
    ``sources[l]`` with their router rows; updates the modules' and the config's ``num_experts``. Returns
    the new expert count. Gradients are kept as they were (``requires_grad`` of each tensor)."""
    blocks = _moe_blocks(model)
    if len(sources) != len(blocks) or len({len(s) for s in sources}) != 1 or not sources[0]:
        raise ValueError(f"expansion sources: one equal-length, non-empty list per MoE layer "
                         f"({len(blocks)} layers), got {[len(s) for s in sources]}")
    e_old = describe(model).num_experts
    if not hasattr(model, BASE_ATTR):
        setattr(model, BASE_ATTR, e_old)  # the count before any expansion (``base_experts``)
    for (experts, router), src in zip(blocks, sources, strict=True):
        if any(not 0 <= s < e_old for s in src):
            raise ValueError(f"expansion sources {src} outside the {e_old} experts")
        idx = torch.tensor(src, dtype=torch.long, device=router.weight.device)
        for t in EXPERT_TENSORS:
            p = getattr(experts, t)  # [E, ...]
            setattr(experts, t, nn.Parameter(torch.cat([p.data, p.data[idx]], 0), requires_grad=p.requires_grad))
        w = router.weight  # [E, H]
        router.weight = nn.Parameter(torch.cat([w.data, w.data[idx]], 0), requires_grad=w.requires_grad)
    e_new = e_old + len(sources[0])
    for mod in model.modules():  # the experts, the router, and the causal LM's own (its aux loss reads it)
        if isinstance(getattr(mod, "num_experts", None), int) and mod.num_experts == e_old:
            mod.num_experts = e_new
    setattr(model.config, EXPANDABLE[model.config.model_type], e_new)
    return e_new


def base_experts(model: nn.Module) -> int:
    """The model's expert count before any expansion (its count now when it was never expanded)."""
    return int(getattr(model, BASE_ATTR, None) or describe(model).num_experts)


def resize_to(model: nn.Module, experts: int) -> bool:
    """Grow ``model`` to ``experts`` per layer (shape only: new slots copy experts ``0..``; the caller loads the
    global weights over them). False when it has more than ``experts`` already (the caller rebuilds the base)."""
    spec = describe(model)
    have = spec.num_experts
    if experts < have:
        return False
    if experts > have:
        expand_experts(model, [[e % have for e in range(experts - have)] for _ in spec.moe_layers])
    return True


def per_expert(name: str) -> bool:
    """Whether the trainable tensor ``name`` has one slice per expert along its first dimension (a fused expert
    tensor or a router weight)."""
    return (".experts." in name and name.rsplit(".", 1)[-1] in EXPERT_TENSORS) \
        or name.endswith((".gate.weight", ".router.weight"))


def experts_in(shapes) -> int | None:
    """The expert count the trainable tensors ``{name: shape}`` declare (every router weight's rows and every fused
    expert tensor's first dimension, which must agree); None when no router or expert tensor travels."""
    counts = set()
    for name, shape in dict(shapes).items():
        if per_expert(name):
            counts.add(int(shape[0]))
    if not counts:
        return None
    if len(counts) != 1:
        raise ModelError(f"config key '{KEY}': the received tensors disagree on the expert count ({sorted(counts)})")
    return counts.pop()


def frozen_set(layers: int, experts: int, trainable: int) -> torch.Tensor:
    """``[L, E]`` bool: every expert but the ``trainable`` newest (the last added) is frozen."""
    f = torch.ones(layers, experts, dtype=torch.bool)
    f[:, experts - trainable:] = False
    return f


def pad_anchor(probs: np.ndarray, experts: int) -> np.ndarray:
    """An ``[L, E]`` anchor padded with zero mass to ``[L, experts]`` (the new experts held no earlier routing)."""
    p = np.asarray(probs, dtype=np.float32)
    if p.shape[-1] > experts:
        raise ValueError(f"anchor has {p.shape[-1]} experts, more than the model's {experts}")
    pad = [(0, 0)] * (p.ndim - 1) + [(0, experts - p.shape[-1])]
    return np.pad(p, pad).astype(np.float32)
