"""The inference engine for RL rollouts: a weight-synced view of the policy whose numerics differ from the
trainer's in a controlled, genuine way (``docs/algorithms.md``, "Inference engine profiles").

Owns: the numerics profiles (``exact``, ``bf16``, ``int8-dynamic``, ``int8-weight-only``,
``int<b>-experts``, ``prune-k`` and ``+``-combinations such as ``bf16+prune-1``), the expert-usage table used to choose
which experts ``prune-k`` drops (``measure_usage``), and ``sync`` (re-copy the policy's weights and
re-apply the profile).

The engine reads the policy's own weights (``engine_view.py``): its model is a copy of the module tree whose
tensors are the policy's; casts and fake quantisation run on the fly one decoder layer at a time, pruning is a
hook on the view's routers, and only ``int8-dynamic`` holds tensors of its own (the int8 weights of the
quantised linears). ``share_weights=False`` keeps the former behaviour, a deep copy with the profile applied to
it, for comparison (same token ids and log-probs: ``tests/rl/test_engine_view.py``).

Must not: modify the policy model (every change is made on the view's own modules or on a copy), train
anything, compute log-probs or losses (``rollout.py`` and the RL loss do that), or import Flower.

Profiles (measured on a briefly trained tiny Qwen3-MoE; the table is in ``docs/algorithms.md``):

* ``exact``: same numerics (the control; KV-cache decode vs teacher forcing differs by ~1e-6).
* ``bf16``: weights and compute in bfloat16 (mild: mean |dlogp| ~1e-2, ~0.4 % routing flips).
* ``int8-dynamic``: ``torch.ao.quantization.quantize_dynamic`` on every ``nn.Linear`` (attention and
  ``lm_head``; it does NOT touch the fused 3-D experts or the router, which are bare parameters, nor
  peft's LoRA factors, which stay float32 on top of the quantised base linear: peft's forward reads their
  ``weight.dtype``).
  Batch-composition dependent, like batch-non-invariant GPU kernels.
* ``int8-weight-only``: fake-quantised symmetric per-row int8 of the fused experts' 3-D parameters
  and the router weight (deterministic; compute stays fp32).
* ``int<b>-experts`` (b in 2..8, e.g. ``int4-experts``; ``int<b>g<n>-experts`` with groups of n input
  columns): symmetric fake quantisation of the fused experts' weights only, one scale per output channel (per
  row of the last dimension; per group of n columns of it with ``g<n>``), compute in fp32, the router untouched.
  With ``q = 2^(b-1) - 1`` and ``W[e, o, :]`` one output channel (a group of it with ``g<n>``)::

      s[e, o] = max_i |W[e, o, i]| / q          W_hat = clamp(round(W / s), -q, q) * s

  The weights every token meets differ, so log-probs move on every token, while routes move only through
  the hidden states (the router is exact): a mismatch routing replay cannot remove, by construction.
* ``prune-k``: the k least-used experts of every MoE layer are dropped by setting their router
  logits to -inf (a forward hook on each router of the copy). "Least used" comes from a usage table
  ``[L, E]`` passed in, or measured on calibration batches with ``measure_usage``. Strong and
  systematic: this is the profile that makes IcePop masks non-zero.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from distmoe.model.balance import selection_scores
from distmoe.model.build import num_experts as experts_of
from distmoe.model.build import router_modules, topk_weighting
from distmoe.model.device import autocast_for, device_of
from distmoe.model.router_rule import CORRECTION_BIAS, Routing, routing_of
from distmoe.rl.engine_view import OnTheFly, share_copy

BASE_PROFILES = ("exact", "bf16", "int8-dynamic", "int8-weight-only", "prune-k", "int<b>-experts")
_PRUNE_RE = re.compile(r"^prune-(\d+)$")
_EXPERT_QUANT_RE = re.compile(r"^int(\d+)(?:g(\d+))?-experts$")


def _profile_error(profile: str, why: str) -> ValueError:
    return ValueError(f"unknown or invalid inference profile {profile!r} ({why}); valid profiles: "
                      f"{', '.join(BASE_PROFILES)} (prune-k with an integer k, e.g. prune-1; int<b>-experts with b in "
                      "2..8, e.g. int4-experts, or int<b>g<n>-experts for groups of n columns), or a '+'-"
                      "combination of bf16 / int8-dynamic / int8-weight-only / int<b>-experts / prune-k such as "
                      "bf16+prune-1 "
                      "(bf16 and int8-dynamic exclude each other; exact stands alone)")


def parse_profile(profile: str) -> dict[str, object]:
    """``"bf16+prune-1"`` -> ``{"bf16": True, "int8_dynamic": False, "int8_wo": False, "prune": 1,
    "expert_bits": 0, "expert_group": 0}`` (``expert_group`` 0: one scale per whole output channel)."""
    parts = [p.strip() for p in str(profile).lower().split("+") if p.strip()]
    if not parts:
        raise _profile_error(profile, "empty")
    spec: dict[str, object] = {"bf16": False, "int8_dynamic": False, "int8_wo": False, "prune": 0,
                               "expert_bits": 0, "expert_group": 0}
    if parts == ["exact"]:
        return spec
    seen: set[str] = set()
    for part in parts:
        m = _PRUNE_RE.match(part)
        q = _EXPERT_QUANT_RE.match(part)
        key = "prune" if m else "expert_bits" if q else part
        if key in seen:
            raise _profile_error(profile, f"{part!r} given twice")
        seen.add(key)
        if m:
            k = int(m.group(1))
            if k < 1:
                raise _profile_error(profile, "prune-k needs k >= 1")
            spec["prune"] = k
        elif q:
            bits, group = int(q.group(1)), int(q.group(2) or 0)
            if not 2 <= bits <= 8:
                raise _profile_error(profile, f"{part!r}: bits must be in 2..8")
            if q.group(2) is not None and group < 1:
                raise _profile_error(profile, f"{part!r}: the group size must be >= 1")
            spec["expert_bits"], spec["expert_group"] = bits, group
        elif part == "bf16":
            spec["bf16"] = True
        elif part == "int8-dynamic":
            spec["int8_dynamic"] = True
        elif part == "int8-weight-only":
            spec["int8_wo"] = True
        elif part == "exact":
            raise _profile_error(profile, "exact cannot be combined")
        else:
            raise _profile_error(profile, f"unknown part {part!r}")
    if spec["bf16"] and spec["int8_dynamic"]:
        raise _profile_error(profile, "bf16 and int8-dynamic exclude each other")
    if spec["int8_wo"] and spec["expert_bits"]:
        raise _profile_error(profile, "int8-weight-only and int<b>-experts both quantise the experts")
    return spec


def _batch_tensors(batch) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, Mapping):
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
    else:
        ids, mask = batch, None
    if mask is None:
        mask = torch.ones_like(ids)
    return ids, mask


@torch.no_grad()
def measure_usage(model: nn.Module, batches: Iterable) -> torch.Tensor:
    """Top-k assignment counts per MoE layer and expert, ``[L, E]`` float32, over valid tokens.

    ``batches``: dicts with ``input_ids`` ``[B, S]`` and optional ``attention_mask`` ``[B, S]`` (e.g.
    from ``collate`` / ``collate_prompts``) or bare ``[B, S]`` id tensors. Padding is not counted.
    """
    routers = router_modules(model)
    if not routers:
        raise ValueError("measure_usage: the model has no top-k router modules")
    top_k = int(model.config.num_experts_per_tok)
    rule = routing_of(model)
    usage: torch.Tensor | None = None
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            ids, mask = _batch_tensors(batch)
            dev = device_of(model)
            with autocast_for(model):
                out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), output_router_logits=True,
                            use_cache=False)
            mask = mask.to(dev)
            valid = mask.reshape(-1).bool()  # [B*S]
            rl = [rule.routing_logits(z) for z in out.router_logits]  # as forward_with_router returns them
            layers = []
            for c in selection_scores(model, [z[valid] for z in rl]):  # L x [n, E]: the router's own choice
                idx = torch.topk(c, top_k, dim=-1).indices  # [n, k]
                layers.append(torch.bincount(idx.reshape(-1), minlength=c.shape[-1]).float())  # [E]
            counts = torch.stack(layers, 0)  # [L, E]
            usage = counts if usage is None else usage + counts
    finally:
        model.train(was_training)
    if usage is None:
        raise ValueError("measure_usage: no calibration batches")
    return usage


def least_used(usage: torch.Tensor, k: int) -> torch.Tensor:
    """``[L, E]`` usage -> ``[L, k]`` indices of the k least-used experts per layer (ties: lower index)."""
    order = torch.sort(usage.float(), dim=-1, stable=True).indices  # [L, E] ascending
    return order[:, :k]


def _make_prune_hook(dropped: torch.Tensor, top_k: int, norm_topk_prob: bool, scale: float = 1.0,
                     rule: Routing | None = None):
    """Forward hook for a ``(logits, scores, indices)`` router: re-route with ``dropped`` logits at -inf. A sigmoid
    ``rule`` chooses by its group-limited rule with the router's correction bias, the dropped experts never
    chosen, and weighs the choice by its own rule (``router_rule.py``)."""
    def hook(mod, _inp, out):
        if not (isinstance(out, tuple) and len(out) == 3):
            raise TypeError("prune-k needs a router returning (logits, scores, indices) (Qwen3-MoE style)")
        logits = out[0]  # [tokens, E]
        masked = logits.index_fill(-1, dropped.to(logits.device), float("-inf"))  # [tokens, E]
        if rule is not None and rule.sigmoid:
            idx = rule.choose(logits, getattr(mod, CORRECTION_BIAS), dropped)  # [tokens, k]
            return masked, rule.weights(logits, idx).to(out[1].dtype), idx
        probs = torch.softmax(masked, dim=-1, dtype=torch.float)  # [tokens, E]
        top_v, top_i = torch.topk(probs, top_k, dim=-1)  # [tokens, k]
        if norm_topk_prob:
            top_v = top_v / top_v.sum(dim=-1, keepdim=True)
        top_v = top_v * scale if scale != 1.0 else top_v
        return masked, top_v.to(logits.dtype), top_i
    return hook


def fake_quant_int8(t: torch.Tensor) -> torch.Tensor:
    """Symmetric per-row (last dim) int8 fake quantisation: a new tensor of ``t``'s dtype and shape."""
    s = t.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127.0  # [..., 1]
    return (t / s).round().clamp(-127, 127) * s


def fake_quant_int8_(t: torch.Tensor) -> None:
    """``fake_quant_int8`` in place."""
    t.copy_(fake_quant_int8(t))


def fake_quant_channels(t: torch.Tensor, bits: int, group: int = 0) -> torch.Tensor:
    """Symmetric ``bits``-bit fake quantisation, one scale per row of the last dim (per output channel of an
    ``[E, out, in]`` fused expert), or per ``group`` consecutive entries of it (``group`` 0: the whole row; it must
    divide the last dim): a new tensor of ``t``'s dtype and shape."""
    q = 2 ** (bits - 1) - 1
    shape = t.shape
    if group:
        if shape[-1] % group:
            raise ValueError(f"expert quantisation: group size {group} does not divide the input dim {shape[-1]}")
        view = t.reshape(*shape[:-1], shape[-1] // group, group)  # [..., in/g, g]
    else:
        view = t.reshape(*shape[:-1], 1, shape[-1])  # [..., 1, in]
    s = view.abs().amax(-1, keepdim=True).clamp(min=1e-8) / q  # [..., groups, 1]
    return ((view / s).round().clamp(-q, q) * s).reshape(shape)


def fake_quant_channels_(t: torch.Tensor, bits: int, group: int = 0) -> None:
    """``fake_quant_channels`` in place."""
    t.copy_(fake_quant_channels(t, bits, group))


def expert_tensor_names(model: nn.Module) -> list[str]:
    """Names of the fused 3-D expert parameters (``[E, out, in]`` in Qwen3-MoE), what ``int<b>-experts`` quantises."""
    return [n for n, p in model.named_parameters() if p.dim() == 3 and ".experts." in f".{n}"]


def quantized_tensor_names(model: nn.Module) -> list[str]:
    """Names of the parameters ``int8-weight-only`` fake-quantises: fused 3-D experts + router weights."""
    names = expert_tensor_names(model)
    for rname, mod in router_modules(model):
        if isinstance(getattr(mod, "weight", None), torch.Tensor):
            names.append(f"{rname}.weight")
    return names


_LORA_FACTORS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


def dynamic_quant_targets(model: nn.Module) -> list[str]:
    """The ``nn.Linear`` modules ``int8-dynamic`` quantises: every one but peft's LoRA factors (peft's forward
    reads ``lora_A.weight.dtype``, which a dynamically quantised linear does not have; the factors stay float32
    and are applied on top of the quantised base linear, as peft applies them to any base layer)."""
    return [n for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and not set(n.split(".")) & set(_LORA_FACTORS)]


def _quantize_dynamic(model: nn.Module) -> nn.Module:
    """``int8-dynamic``: ``quantize_dynamic`` of ``dynamic_quant_targets`` in place (``model`` is a copy or a
    view: its modules, not the policy's, are replaced)."""
    spec = dict.fromkeys(dynamic_quant_targets(model), torch.ao.quantization.default_dynamic_qconfig)
    with warnings.catch_warnings():  # torch 2.13 deprecates torch.ao quantization (-> torchao)
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, spec, dtype=torch.qint8, inplace=True)


class InferenceEngine:
    """A weight-synced view (default) or deep copy (``share_weights=False``) of ``policy_model`` with numerics
    profile ``profile``.

    ``engine.model`` is what rollouts are sampled from (eval mode, no grad). ``usage`` (``[L, E]``) fixes which
    experts ``prune-k`` drops; without it, pass ``calibration`` batches and the usage is measured on the policy
    at construction and at every ``sync``.
    """

    def __init__(self, policy_model: nn.Module, profile: str, temperature: float = 1.0,
                 usage: torch.Tensor | None = None, calibration: list | None = None, share_weights: bool = True):
        self.profile = str(profile)
        self.spec = parse_profile(self.profile)
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (sampling), got {temperature}")
        self.temperature = float(temperature)
        self.fixed_usage = usage
        self.calibration = calibration
        self.share_weights = bool(share_weights)
        if self.spec["prune"] and usage is None and not calibration:
            raise ValueError(f"profile {self.profile!r} needs a usage table [L, E] or calibration batches")
        self.usage: torch.Tensor | None = None
        self.pruned: torch.Tensor | None = None  # [L, k] dropped experts per MoE layer
        self.model: nn.Module
        self.sync(policy_model)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.spec["bf16"] else torch.float32

    def sync(self, policy_model: nn.Module) -> InferenceEngine:
        """Re-read the policy's current weights and re-apply the profile (the policy is untouched)."""
        if self.spec["int8_dynamic"] and device_of(policy_model).type != "cpu":
            raise ValueError(f"inference profile {self.profile!r}: int8-dynamic (torch.ao dynamic quantisation) runs "
                             f"on the CPU only, the policy is on {device_of(policy_model)}; use int8-weight-only or "
                             "bf16 on an accelerator")
        self.model = None  # type: ignore[assignment]  # the previous view or copy goes before the next is made
        model = share_copy(policy_model) if self.share_weights else copy.deepcopy(policy_model)
        model.eval()
        k = int(self.spec["prune"])
        if k:
            self._apply_prune(model, policy_model, k)
        if self.share_weights:
            self.model = self._view(model)
            return self
        for p in model.parameters():
            p.requires_grad_(False)
        if self.spec["int8_wo"]:
            with torch.no_grad():
                params = dict(model.named_parameters())
                for name in quantized_tensor_names(model):
                    fake_quant_int8_(params[name].data)
        if self.spec["expert_bits"]:
            names = expert_tensor_names(model)
            if not names:
                raise ValueError(f"inference profile {self.profile!r}: the model has no fused 3-D expert weights")
            with torch.no_grad():
                params = dict(model.named_parameters())
                for name in names:
                    fake_quant_channels_(params[name].data, int(self.spec["expert_bits"]),
                                         int(self.spec["expert_group"]))
        if self.spec["bf16"]:
            model.to(torch.bfloat16)
        if self.spec["int8_dynamic"]:
            model = _quantize_dynamic(model)
        self.model = model
        return self

    def _view(self, view: nn.Module) -> nn.Module:
        """The profile on a view sharing the policy's tensors (``engine_view``): what ``sync`` does to a deep copy,
        with the casts and fake quantisation made on the fly and only the dynamically quantised linears owned."""
        fq = set(quantized_tensor_names(view)) if self.spec["int8_wo"] else set()
        bits, group = int(self.spec["expert_bits"]), int(self.spec["expert_group"])
        eq = set(expert_tensor_names(view)) if bits else set()
        if bits and not eq:
            raise ValueError(f"inference profile {self.profile!r}: the model has no fused 3-D expert weights")
        bf16 = bool(self.spec["bf16"])

        def transform(name: str, t: torch.Tensor) -> torch.Tensor:
            if name in fq:
                t = fake_quant_int8(t)
            elif name in eq:
                t = fake_quant_channels(t, bits, group)
            return t.to(torch.bfloat16) if bf16 else t

        if self.spec["int8_dynamic"]:
            mods = dict(view.named_modules())
            with torch.no_grad():  # a fake-quantised router linear is quantised from its fake-quantised weight
                for name in dynamic_quant_targets(view):
                    if f"{name}.weight" in fq:
                        mods[name]._parameters["weight"] = nn.Parameter(transform(f"{name}.weight",
                                                                                  mods[name].weight))
            view = _quantize_dynamic(view)
        if fq or eq or bf16:
            OnTheFly(view, transform)
        if bf16:
            view.distmoe_compute_dtype = torch.bfloat16  # what autocast_for sees (the tensors stay the policy's)
        return view

    def _apply_prune(self, model: nn.Module, policy_model: nn.Module, k: int) -> None:
        routers = router_modules(model)
        if self.fixed_usage is not None:
            usage = torch.as_tensor(self.fixed_usage).float()
        else:
            usage = measure_usage(policy_model, self.calibration)
        num_experts = experts_of(model)
        top_k = int(model.config.num_experts_per_tok)
        if usage.shape != (len(routers), num_experts):
            raise ValueError(f"usage table has shape {tuple(usage.shape)}, expected "
                             f"({len(routers)}, {num_experts}) = [MoE layers, experts]")
        if num_experts - k < top_k:
            raise ValueError(f"prune-{k} leaves {num_experts - k} experts, fewer than top_k={top_k}")
        self.usage = usage
        self.pruned = least_used(usage, k)  # [L, k]
        norm, scale = topk_weighting(model)  # the family's own weighting of its top-k
        rule = routing_of(model)
        for li, (_, mod) in enumerate(routers):
            rule.check_pruned(self.pruned[li], num_experts)
            mod.register_forward_hook(_make_prune_hook(self.pruned[li], top_k, norm, scale, rule))

    def __repr__(self) -> str:
        return f"InferenceEngine(profile={self.profile!r}, temperature={self.temperature})"
