"""4-bit frozen experts: every fused expert stack stored as NF4 (4-bit NormalFloat with one absmax per block of 64
values; Dettmers et al. 2023, QLoRA, sec. 3, "4-bit NormalFloat Quantization"), quantised and dequantised by
bitsandbytes' own blockwise kernels (``bitsandbytes.functional.quantize_4bit`` / ``dequantize_4bit``, which run on
the CPU too), and dequantised inside the routed expert forward for the experts the router chose only.

Why a storage of our own over bitsandbytes' functions rather than a library's ready path (``docs/checkpoints.md``,
"4-bit experts"): bitsandbytes' ``Linear4bit`` and transformers' ``BitsAndBytesConfig`` quantise ``nn.Linear``
modules only, and a fused ``[E, out, in]`` expert parameter is not one; torchao's ``Int4WeightOnlyConfig`` and
``IntxWeightOnlyConfig`` do not take a 3-D parameter on the CPU (the latter refuses it, the former leaves it
unquantised), and its ``Int8WeightOnlyConfig`` (8 bits, not 4) has no ``grouped_mm``. Blocks of 64 never straddle
two experts (``out * in`` is a multiple of 64, checked), so the routed experts' packed bytes and absmax rows are
gathered and dequantised in one call: the base costs ``0.5 + 4/64`` bytes per expert weight, and a forward
materialises the routed experts' weights of one projection at a time (at most the stack, in the compute dtype).

Loading straight into 4 bits (``quantize_while_loading``): while a checkpoint is read by ``from_pretrained``
(safetensors memory-mapped, tensors materialised one target at a time), each expert stack's weight is quantised the
moment transformers assigns it to its module (torch's global parameter-registration hook) and the module keeps a
zero-stride placeholder of the same shape instead (one element of memory), so the full-precision stacks never
coexist: the load holds the 4-bit model plus one stack in full precision. ``quantize_experts`` then installs the
stacks quantised while loading, which are the same bytes as quantising after the load (the same tensor, the same
kernel). Until it runs, a forward of such a stack raises (its placeholder is not its weight).

Owns: ``NF4Stack`` (the packed stack and its routed dequantisation), ``quantize_while_loading`` and
``quantize_experts`` (replace every adapted stack's 3-D weights of a routed-LoRA peft model). Must not: quantise
anything that trains or that another forward reads directly (it refuses a stack without the routed expert LoRA),
or compute the experts' forward (``expert_lora.py`` does).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from distmoe.model.expert_lora import RoutedExpertsLoRA, expert_wrappers

BLOCK = 64
CHUNK_VALUES = 1 << 18  # expert weights quantised per call (1 MB in float32), in whole experts
PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")
LOADED = "_distmoe_nf4_loaded"  # an expert stack's {projection: NF4Stack} quantised while loading
_GUARD = "_distmoe_nf4_guard"  # the forward pre-hook that refuses a stack whose weights are placeholders


class QuantError(ValueError):
    """The experts cannot be stored in 4 bits here (why, and which setting to change, in the message)."""


def _bnb():
    try:
        import bitsandbytes.functional as bnb_f
    except ImportError:
        raise QuantError("model.quantize-experts = \"nf4\": bitsandbytes is not installed; install distmoe with the "
                         "`quant-experts` extra (pip install 'distmoe[quant-experts]')") from None
    return bnb_f


class NF4Stack(nn.Module):
    """A ``[E, a, b]`` expert weight as NF4: ``packed`` ``[E, a*b/2]`` uint8 (two 4-bit codes a byte), ``absmax``
    ``[E, a*b/64]`` float32, the NF4 code book ``code`` ``[16]``; ``dtype`` is the weight's own (what
    ``dequantize`` returns)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        e, a, b = weight.shape
        if (a * b) % BLOCK:
            raise QuantError(f"an expert weight of {a} x {b} values is not a whole number of {BLOCK}-value NF4 "
                             "blocks; set model.quantize-experts = \"none\"")
        # a few experts at a time: bitsandbytes' CPU kernel holds several temporaries of its input's size (measured:
        # a 100 MB stack at once raised the RSS by 300 MB), and blocks never straddle experts, so the bytes are the same
        step = max(1, CHUNK_VALUES // (a * b))
        packed, absmax = [], []
        for i in range(0, e, step):
            p, state = _bnb().quantize_4bit(weight[i:i + step].detach().contiguous(), blocksize=BLOCK,
                                            quant_type="nf4")
            packed.append(p.reshape(-1, a * b // 2))  # [chunk, a*b/2]
            absmax.append(state.absmax.float().reshape(-1, a * b // BLOCK))  # [chunk, a*b/64]
        self.register_buffer("packed", torch.cat(packed))  # [E, a*b/2]
        self.register_buffer("absmax", torch.cat(absmax))  # [E, a*b/64]
        self.register_buffer("code", state.code.float())  # [16]
        self.shape = (e, a, b)
        self.dtype = weight.dtype

    def dequantize(self, experts: torch.Tensor | None = None) -> torch.Tensor:
        """The weights of ``experts`` (``[R]`` expert indices; all when None) -> ``[R, a, b]`` in ``self.dtype``."""
        bnb_f = _bnb()
        packed, absmax = (self.packed, self.absmax) if experts is None else (self.packed[experts], self.absmax[experts])
        r = packed.shape[0]
        state = bnb_f.QuantState(absmax=absmax.reshape(-1).float(), shape=torch.Size((r, *self.shape[1:])),
                                 code=self.code.float(), blocksize=BLOCK, quant_type="nf4", dtype=self.dtype)
        return bnb_f.dequantize_4bit(packed.reshape(-1, 1), state)  # [R, a, b]

    def extra_repr(self) -> str:
        return f"shape={self.shape}, nf4 blocks of {BLOCK}, dtype={self.dtype}"


def _refuse_placeholder(module: nn.Module, args) -> None:
    raise QuantError(f"{type(module).__name__}: its expert weights were quantised to 4 bits while loading "
                     "(model.quantize-experts = \"nf4\") and only the routed expert LoRA runs them; apply_trainable "
                     "with the same model config installs them")


def _quantize_on_registration(module: nn.Module, name: str, param: torch.Tensor | None) -> nn.Parameter | None:
    """Global parameter-registration hook: an expert stack's 3-D projection weight (not on ``meta``) -> kept as
    ``NF4Stack`` on the module, a zero-stride placeholder of the same shape, dtype and device registered instead."""
    if (param is None or name not in PROJECTIONS or not hasattr(module, "has_gate") or param.is_meta
            or param.dim() != 3):
        return None
    module.__dict__.setdefault(LOADED, {})[name] = NF4Stack(param.detach())
    if _GUARD not in module.__dict__:
        module.__dict__[_GUARD] = module.register_forward_pre_hook(_refuse_placeholder)
    stub = nn.Parameter(torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape),
                        requires_grad=False)  # [E, a, b] with stride 0: one element of memory
    stub._is_hf_initialized = True  # transformers' loader: loaded, do not initialise
    return stub


@contextmanager
def quantize_while_loading() -> Iterator[None]:
    """Within: every expert stack weight assigned to its module is quantised at once (module docstring). The
    loader's thread pool is turned off for the duration (``HF_DEACTIVATE_ASYNC_LOAD``): its workers would read
    every tensor ahead of the assignment, and the full-precision stacks would coexist again."""
    _bnb()  # refuse before reading anything when bitsandbytes is missing
    handle = torch.nn.modules.module.register_module_parameter_registration_hook(_quantize_on_registration)
    before = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    try:
        yield
    finally:
        handle.remove()
        if before is None:
            os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD", None)
        else:
            os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = before


def quantize_experts(model: nn.Module) -> int:
    """Store every expert stack's 3-D weights of the peft ``model`` as ``NF4Stack`` (the full-precision parameter is
    removed). Every stack must run the routed expert LoRA (``model.lora-experts = true``), whose forward
    dequantises the routed experts; anything else is refused. A stack quantised while loading
    (``quantize_while_loading``) gets the stacks made then. Returns the number of weights quantised."""
    wrappers = expert_wrappers(model)
    stacks = {id(m) for m in model.modules() if hasattr(m, "has_gate") and isinstance(
        getattr(m, "_parameters", {}).get("down_proj"), torch.Tensor)}  # transformers' expert stacks
    if not wrappers or stacks - {id(w.get_base_layer()) for w in wrappers}:
        raise QuantError("model.quantize-experts = \"nf4\" needs the routed expert LoRA on every expert stack "
                         "(model.trainable = \"lora\" with model.lora-experts = true): another forward would read "
                         "the full-precision expert weights that 4-bit storage removes")
    done = 0
    for w in wrappers:
        if not isinstance(w, RoutedExpertsLoRA):
            raise QuantError("model.quantize-experts = \"nf4\": an expert stack runs peft's own forward, not the "
                             "routed expert LoRA, and would read the removed full-precision weights")
        experts = w.get_base_layer()
        loaded = experts.__dict__.pop(LOADED, {})
        for name in PROJECTIONS:
            p = experts._parameters.get(name)
            if p is None:
                continue
            if p.is_meta:
                raise QuantError("model.quantize-experts = \"nf4\": the expert weights are on the meta device "
                                 "(nothing to quantise; the server holds adapters only)")
            q = loaded.pop(name, None)  # quantised while loading; else now
            if q is None:
                q = NF4Stack(p)
            del experts._parameters[name]
            experts.add_module(f"{name}_nf4", q)
            done += 1
        guard = experts.__dict__.pop(_GUARD, None)
        if guard is not None:
            guard.remove()
    return done
