"""Expert LoRA computed on the routed tokens only: ``y = W_e x + (alpha/r) B_e A_e x`` for the tokens routed
to expert ``e``, inside the MoE block, with no ``W + BA`` ever built.

LoRA (Hu et al. 2021, eq. 3: ``h = W_0 x + B A x``) per expert ``e`` of a fused expert stack: ``A_e`` ``[r, in]``
and ``B_e`` ``[out, r]``, applied only to the ``(token, expert)`` pairs the router chose. peft's
``target_parameters`` path (``ParamWrapper``) instead registers a parametrisation that forms
``W + scaling * B A`` for every expert of the stack on every forward (and its gradient in the backward): memory
and time that scale with the experts' weights, not with the routed tokens. Here the base projection is the
grouped matmul transformers' own ``grouped_mm`` experts run (``torch.nn.functional.grouped_mm`` over tokens
sorted by expert; the frozen 3-D weight takes no gradient), and the adapter is two more grouped matmuls of
rank ``r`` on the same sorted tokens, added in place to the base product by one autograd node (``_RoutedLoRA``)
whose backward forms exactly ``dx``, ``dA`` and ``dB``.

The adapters stay peft's own tensors: ``install`` only changes the class of peft's outermost ``ParamWrapper``
of each adapted expert stack to ``RoutedExpertsLoRA`` (a subclass whose ``forward`` is the routed one), so the
parameter names, shapes, initialisation, ``get_peft_model_state_dict``, saving, loading and
``merge_and_unload`` (``distmoe export``) are peft's, unchanged. peft's factor layout (``ParamWrapper``:
``lora_A.weight`` ``[r*E, in]`` = E blocks of ``[r, in]``; ``lora_B.weight`` ``[out, r*E]`` with the expert
index fastest) is read here; ``tests/model/test_expert_lora.py`` checks outputs and adapter gradients against
peft's own forward on every supported family, so a change of that layout fails there.

Covers every expert stack transformers ships with ``@use_experts_implementation`` (all supported families):
``[E, out, in]`` weights (``is_transposed = False``) or ``[E, in, out]`` (GPT-OSS), biases (GPT-OSS), the
family's own gate (``_apply_gate``: SwiGLU, GPT-OSS's clamped interleaved GLU) or activation, the optional
post-expert norm.

A stack stored in 4 bits (``expert_quant.py``) is dequantised here, for the routed experts only, and dequantised
again in the backward (``torch.utils.checkpoint``) rather than kept for it.

Owns: the routed forward and its installation on a peft model. Must not: decide what trains
(``trainable.py``), touch the router or attention adapters (peft's own modules), or change any tensor's name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import ParamWrapper
from torch import nn
from torch.utils.checkpoint import checkpoint

# (device type, dtype) for which torch's grouped_mm failed once: the per-expert loop is used from then on
_NO_GROUPED: set[tuple[str, torch.dtype]] = set()


def _native(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` runs here: the CPU, CUDA sm80+ in bf16."""
    return hasattr(F, "grouped_mm") and (device.type, dtype) not in _NO_GROUPED and (
        device.type == "cpu" or (device.type == "cuda" and dtype == torch.bfloat16
                                 and torch.cuda.get_device_capability(device) >= (8, 0)))


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x`` ``[S, in]`` sorted by group, ``w`` ``[G, in, out]``, ``offs`` ``[G]`` cumulative row ends (int32)
    -> ``[S, out]``, row block ``g`` times ``w[g]``. ``torch.nn.functional.grouped_mm`` where it runs (the CPU,
    CUDA sm80+ in bf16), else a loop over the groups; either way autograd computes a gradient only for the
    operands that require one (a frozen ``w`` gets none)."""
    x = x.to(w.dtype)
    if _native(x.device, w.dtype):
        try:
            return F.grouped_mm(x, w, offs=offs)
        except (RuntimeError, NotImplementedError):
            _NO_GROUPED.add((x.device.type, w.dtype))  # an unsupported shape or stride here: loop from now on
    parts, start = [], 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            parts.append(x[start:end] @ w[g])  # [n_g, out]
        start = end
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])


def grouped_outer(p: torch.Tensor, q: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``p`` ``[S, m]`` and ``q`` ``[S, n]`` sorted by group, ``offs`` ``[G]`` cumulative row ends -> ``[G, m, n]``,
    block ``g`` the product ``p_g^T q_g`` of group ``g``'s rows (zero for an empty group): the weight gradient of
    ``grouped_matmul``. Native ``grouped_mm`` (2-D by 2-D) where ``grouped_matmul`` runs it, else a loop."""
    if _native(p.device, p.dtype):
        try:
            return F.grouped_mm(p.t(), q, offs=offs)
        except (RuntimeError, NotImplementedError):
            _NO_GROUPED.add((p.device.type, p.dtype))
    out, start = p.new_zeros(offs.numel(), p.shape[1], q.shape[1]), 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[g] = p[start:end].t() @ q[start:end]  # [m, n]
        start = end
    return out


class _RoutedLoRA(torch.autograd.Function):
    """``out += scale * (x A_g^T) B_g^T`` on each row block ``g``, in place on the base projection's output
    ``out`` ``[S, out]``, as one autograd node. Its backward computes what LoRA needs and nothing else: ``dx``,
    ``dA`` (in ``A``'s own ``[G, r, in]`` layout: no transposed copy), ``dB`` and ``out``'s own gradient, passed
    through; the scale is applied to the rank-``r`` rows ``u`` ``[S, r]``, never to an ``[S, out]`` tensor, and
    nothing of the base's size is saved (``x``, ``u`` and the factors only)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor,
                scale: float) -> torch.Tensor:
        # out [S, out], x [S, in], a [G, r, in], b_t [G, r, out], offs [G]
        u = grouped_matmul(x, a.transpose(-2, -1), offs).mul_(scale)  # [S, r]
        out.add_(grouped_matmul(u, b_t, offs))  # [S, out]
        ctx.mark_dirty(out)
        ctx.save_for_backward(x, u, a, b_t, offs)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # grad [S, out]
        x, u, a, b_t, offs = ctx.saved_tensors
        grad_u = grouped_matmul(grad, b_t.transpose(-2, -1), offs).mul_(ctx.scale)  # [S, r]
        da = grouped_outer(grad_u, x, offs) if ctx.needs_input_grad[2] else None  # [G, r, in]
        db = grouped_outer(u, grad, offs) if ctx.needs_input_grad[3] else None  # [G, r, out]
        dx = grouped_matmul(grad_u, a, offs) if ctx.needs_input_grad[1] else None  # [S, in]
        return grad, dx, da, db, None, None


def _factors(wrapper: ParamWrapper, adapter: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float]:
    """peft's factors of one 3-D ``ParamWrapper`` as grouped-matmul operands: ``A`` ``[E, r, in]`` (a view),
    ``B^T`` ``[E, r, out]`` (in the base's dtype, as peft's own fold casts them) and the scaling ``alpha / r``."""
    e = wrapper.num_experts
    a = _weight(wrapper.lora_A[adapter])  # [r*E, in]: expert e's rows e*r .. e*r + r - 1
    b = _weight(wrapper.lora_B[adapter])  # [out, r*E]: column j*E + e is rank j of expert e
    a_e = a.reshape(e, -1, a.shape[-1])  # [E, r, in]
    b_t = b.reshape(b.shape[0], -1, e).permute(2, 1, 0).contiguous()  # [E, r, out]
    return a_e.to(dtype), b_t.to(dtype), float(wrapper.scaling[adapter])


def _weight(linear: nn.Module) -> torch.Tensor:
    w = linear.weight
    return w().dequantize() if callable(w) else w  # a dynamically quantised copy (int8 inference engine)


class RoutedExpertsLoRA(ParamWrapper):
    """peft's outermost ``ParamWrapper`` of an expert stack, computing every adapted projection of the stack on
    the routed tokens (module docstring). Anything peft's forward handles that this one does not (adapters
    disabled or merged, several active adapters, mixed-adapter batches) goes to peft's forward."""

    def _chain(self) -> tuple[nn.Module, list[ParamWrapper]]:
        wrappers, mod = [], self
        while isinstance(mod, ParamWrapper):
            wrappers.append(mod)
            mod = mod.base_layer
        return mod, wrappers

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        experts, wrappers = self._chain()
        active = self.active_adapters
        if self.disable_adapters and len(args) == 2 and any(_quantized(experts, n) for n in _PROJECTIONS):
            return routed_experts_forward(experts, x, *args, {}, "")  # the 4-bit base alone (peft's would read W)
        if (self.disable_adapters or kwargs.get("adapter_names") is not None or len(active) != 1
                or any(w.merged or active[0] not in w.lora_A for w in wrappers) or len(args) != 2):
            return super().forward(x, *args, **kwargs)
        top_k_index, top_k_weights = args
        loras = {w.parameter_name: w for w in wrappers}
        return routed_experts_forward(experts, x, top_k_index, top_k_weights, loras, active[0])


_PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")


def _quantized(experts: nn.Module, name: str) -> nn.Module | None:
    """The 4-bit storage (``expert_quant.NF4Stack``, registered as ``<name>_nf4``) of a projection, if any."""
    return getattr(experts, f"{name}_nf4", None)


def _projection(experts: nn.Module, name: str, inp: torch.Tensor, offs: torch.Tensor, ids: torch.Tensor,
                lora: ParamWrapper | None, adapter: str, routed: torch.Tensor) -> torch.Tensor:
    """One projection of the stack on the sorted routed rows ``inp`` ``[S, in]`` -> ``[S, out]``. A 4-bit stack
    (``expert_quant.py``) dequantises the ``routed`` experts ``[R]`` only and runs over their groups alone."""
    q = _quantized(experts, name)
    if q is not None:
        offs = offs[routed]  # [R] the routed groups' cumulative row ends (the others are empty)
        dtype = q.dtype

        def base(x: torch.Tensor) -> torch.Tensor:
            w = q.dequantize(routed)  # [R, out, in] (or [R, in, out]): the routed experts only
            return grouped_matmul(x, w if experts.is_transposed else w.transpose(-2, -1), offs)  # [S, out]

        # dequantised again in the backward instead of kept for it (QLoRA, sec. 3): a training step holds the
        # routed experts' full-precision weights of one projection at a time, not of every layer until backward
        out = checkpoint(base, inp, use_reentrant=False) if torch.is_grad_enabled() else base(inp)
    else:
        w = getattr(experts, name)  # [E, out, in], or [E, in, out] when is_transposed
        dtype = w.dtype
        out = grouped_matmul(inp, w if experts.is_transposed else w.transpose(-2, -1), offs)  # [S, out]
    if experts.has_bias:
        out = out + getattr(experts, f"{name}_bias")[ids]  # [S, out]
    if lora is not None:
        a_e, b_t, scale = _factors(lora, adapter, dtype)
        if q is not None:
            a_e, b_t = a_e[routed], b_t[routed]  # [R, r, in], [R, r, out]
        out = _RoutedLoRA.apply(out, inp.to(dtype), a_e, b_t, offs, scale)  # [S, out] += scale (inp A^T) B^T
    return out


def routed_experts_forward(experts: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor, loras: dict[str, ParamWrapper], adapter: str) -> torch.Tensor:
    """The expert stack's output with LoRA on the routed tokens: ``hidden`` ``[T, H]``, ``top_k_index`` and
    ``top_k_weights`` ``[T, k]`` -> ``[T, H]`` (the same computation as transformers' grouped_mm experts, plus
    the adapters of ``loras``, keyed by the adapted parameter's name)."""
    num_tokens, k = top_k_index.shape
    ids = top_k_index.reshape(-1)  # [S = T*k]
    ids_sorted, perm = torch.sort(ids)  # [S]
    rows = hidden[perm // k]  # [S, H], grouped by expert
    counts = torch.bincount(ids_sorted, minlength=experts.num_experts)  # [E]
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # [E]
    routed = counts.nonzero().squeeze(-1)  # [R] the experts with at least one row
    up = "gate_up_proj" if experts.has_gate else "up_proj"
    h = _projection(experts, up, rows, offs, ids_sorted, loras.get(up), adapter, routed)  # [S, 2I] or [S, I]
    h = experts._apply_gate(h) if experts.has_gate else experts.act_fn(h)  # [S, I]
    y = _projection(experts, "down_proj", h, offs, ids_sorted, loras.get("down_proj"), adapter, routed)  # [S, H]
    if getattr(experts, "has_post_expert_norm", False):
        y = experts.post_expert_norm(y)
    y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(y.dtype)  # [S, H]
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    out = y[inv].view(num_tokens, k, -1).sum(dim=1)  # [T, H]: the k routed outputs of each token, summed
    return out.to(hidden.dtype)


def expert_wrappers(model: nn.Module) -> list[ParamWrapper]:
    """The outermost peft ``ParamWrapper`` of every adapted 3-D expert stack (routed or not)."""
    found = [m for _, m in model.named_modules() if isinstance(m, ParamWrapper) and getattr(m, "num_experts", 1) > 1]
    inner = {id(m.base_layer) for m in found}
    return [m for m in found if id(m) not in inner]


def install(model: nn.Module, routed: bool = True) -> int:
    """Make every adapted expert stack of the peft ``model`` use the routed forward (``routed=False``: peft's
    own ``target_parameters`` forward again, for comparison). Returns how many stacks were switched."""
    wrappers = expert_wrappers(model)
    for w in wrappers:
        if not hasattr(w.get_base_layer(), "has_gate"):
            raise TypeError(f"{type(w.get_base_layer()).__name__}: not a transformers experts stack "
                            "(@use_experts_implementation); the routed expert LoRA cannot apply")
        w.__class__ = RoutedExpertsLoRA if routed else ParamWrapper
    return len(wrappers)
