"""Example-level DP-SGD (opacus per-sample gradients): can this model do it, and if not, a clear refusal.

Owns: the support probe (:func:`diagnose_dp_sgd_support` / :func:`check_dp_sgd_support`), which asks opacus'
own machinery rather than a list of names, and the refusal (:func:`require_dp_sgd_support` raising
:class:`DPSGDUnsupported` with what, why and what to do instead).

Must not: import ``flwr``, send anything, train, or change the model it is given (the probe runs on a deep copy
with a private RNG state).

The probe. A deep copy in train mode is wrapped in ``opacus.GradSampleModule`` (hooks mode: registered grad
samplers, functorch fallback for the other modules) and given one small batch (two examples; for a causal LM,
token ids with a per-sequence mean next-token loss, summed over the batch, ``loss_reduction="sum"``). A trainable
parameter is supported only if opacus produced ``p.grad_sample`` of shape ``[B, *p.shape]``, those per-example
gradients sum to the batch gradient, and example 0's per-example gradient equals its gradient computed alone.
A module whose opacus hook raises is recorded (the backward pass continues) rather than aborting the probe;
``opacus.validators.ModuleValidator``'s per-module validators are consulted too.

Findings for the Qwen3-MoE of ``distmoe.model.build`` (opacus 1.6, transformers 5):

* supported: ``nn.Embedding`` (including the tied ``lm_head``), attention ``nn.Linear`` projections, the
  ``Qwen3MoeRMSNorm`` weights (functorch fallback), and peft LoRA adapters on the attention projections;
* unsupported: the fused 3-D expert weights (``Qwen3MoeExperts.gate_up_proj``/``down_proj``): no opacus grad
  sampler, and the functorch fallback replays a module on its first positional input only, while the experts
  also need the routing indices and weights; the router (``Qwen3MoeTopKRouter.weight``): no grad sampler, and
  the fallback differentiates the first output only, which (the router logits) receives no gradient. Both see
  the batch flattened to ``[B*T, H]`` tokens, so even a working sampler would give per-token, not per-example,
  gradients. peft's ``target_parameters`` LoRA on the experts/router reads ``lora_A.weight``/``lora_B.weight``
  outside their modules' ``forward``, so opacus' hooks never fire and no per-example gradient exists.
  ``grad_sample_mode="ew"`` (ExpandedWeights) fails earlier (RMSNorm's ``mul``, peft's ``matmul``).

Hence none of ``model.trainable`` = ``all`` | ``router+experts`` | ``lora`` is supported for example-level
DP-SGD, and no private training step is provided here; use client-level DP on the update instead.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "DPSGDSupport",
    "DPSGDUnsupported",
    "check_dp_sgd_support",
    "diagnose_dp_sgd_support",
    "require_dp_sgd_support",
]

PROBE_BATCH = 2
PROBE_SEQ_LEN = 16
_RTOL, _ATOL = 1e-3, 1e-6
_SHOW = 5  # parameter names quoted in the refusal message

ALTERNATIVE = ("use client-level DP on the update (`privacy.update-noise-multiplier` > 0: the party's update is "
               "clipped and noised before it leaves), or make only parameters trainable that opacus can sample "
               "per example (its own modules: nn.Linear, nn.Embedding, norms; e.g. attention)")


class DPSGDUnsupported(RuntimeError):
    """Example-level DP-SGD was requested for a model whose per-example gradients opacus cannot compute."""

    def __init__(self, message: str, unsupported: list[str]):
        super().__init__(message)
        self.unsupported = unsupported


@dataclass(frozen=True)
class DPSGDSupport:
    """The probe's verdict: trainable parameter names opacus cannot sample per example, and why."""

    trainable: tuple[str, ...]
    reasons: dict[str, str] = field(default_factory=dict)  # unsupported parameter name -> reason

    @property
    def unsupported(self) -> list[str]:
        return [n for n in self.trainable if n in self.reasons]

    @property
    def supported(self) -> bool:
        return not self.reasons


def _probe_input(model: nn.Module, gen: torch.Generator) -> torch.Tensor:
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab:
        return torch.randint(1, int(vocab), (PROBE_BATCH, PROBE_SEQ_LEN), generator=gen)
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return torch.randint(0, m.num_embeddings, (PROBE_BATCH, PROBE_SEQ_LEN), generator=gen)
        if isinstance(m, nn.Linear):
            return torch.randn(PROBE_BATCH, m.in_features, generator=gen)
    raise ValueError("cannot infer a probe input for this model: pass `batch=` (a tensor with the batch first)")


def _per_example_losses(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """``[B]`` losses, example i depending on example i only."""
    if getattr(getattr(model, "config", None), "vocab_size", None) and not batch.is_floating_point():
        logits = model(input_ids=batch).logits.float()
        ce = nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), batch[:, 1:], reduction="none")
        return ce.mean(dim=1)
    out = model(batch)
    out = getattr(out, "logits", out)
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out.float().flatten(1).square().mean(dim=1)


def _validator_reasons(model: nn.Module) -> dict[str, str]:
    from opacus.validators import ModuleValidator

    reasons: dict[str, str] = {}
    for mname, mod in model.named_modules():
        validator = ModuleValidator.VALIDATORS.get(type(mod))
        errors = validator(mod) if validator else []
        if errors:
            msg = f"opacus validator rejects {type(mod).__name__}: {errors[0]}"
            for pname, p in mod.named_parameters():
                if p.requires_grad:
                    reasons[f"{mname}.{pname}" if mname else pname] = msg
    return reasons


def diagnose_dp_sgd_support(model: nn.Module, batch: torch.Tensor | None = None) -> DPSGDSupport:
    """Probe whether opacus computes correct per-example gradients for every trainable parameter of ``model``.

    ``batch``: a probe input with the batch first (at least two examples); inferred for Hugging Face causal LMs
    (``config.vocab_size``) and for models whose first module is an ``nn.Linear`` / ``nn.Embedding``.
    """
    from opacus import GradSampleModule

    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # full-backward-hook and opacus notices about the throwaway copy
        torch.manual_seed(0)
        probe = copy.deepcopy(model)
        probe.train()
        for p in probe.parameters():
            p.grad = None
        named = [(n, p) for n, p in probe.named_parameters() if p.requires_grad]
        trainable = tuple(n for n, _ in named)
        if not named:
            return DPSGDSupport(trainable=())
        if batch is None:
            batch = _probe_input(probe, torch.Generator().manual_seed(0))
        if batch.shape[0] < 2:
            raise ValueError("the probe batch needs at least two examples")
        n_ex = int(batch.shape[0])
        reasons = _validator_reasons(probe)

        hook_errors: dict[int, str] = {}  # id(param) -> reason

        class _Probe(GradSampleModule):
            def capture_backprops_hook(self, module, *args, **kwargs):
                try:
                    return super().capture_backprops_hook(module, *args, **kwargs)
                except Exception as exc:  # record, keep the backward pass going
                    kind = ("its registered grad sampler" if type(module) in self.GRAD_SAMPLERS else
                            "opacus has no grad sampler for it, and the functorch fallback (which replays the module "
                            "on its first positional input and differentiates its first output, batch = dim 0)")
                    msg = f"{type(module).__name__}: {kind} failed: {type(exc).__name__}: {exc}"
                    for _, p in module.named_parameters():
                        hook_errors.setdefault(id(p), msg)
                    module.activations = []
                    if hasattr(module, "max_batch_len"):
                        del module.max_batch_len

        try:
            gsm = _Probe(probe, strict=False, loss_reduction="sum")
        except Exception as exc:
            msg = f"opacus cannot wrap the model: {type(exc).__name__}: {exc}"
            return DPSGDSupport(trainable, {n: reasons.get(n, msg) for n in trainable})
        try:
            _per_example_losses(gsm, batch).sum().backward()
        except Exception as exc:
            msg = f"forward/backward under opacus hooks failed: {type(exc).__name__}: {exc}"
            return DPSGDSupport(trainable, {n: reasons.get(n, msg) for n in trainable})

        # example 0 alone, hooks off: its per-example gradient must equal this
        gsm.disable_hooks()
        try:
            alone = torch.autograd.grad(_per_example_losses(gsm, batch[:1]).sum(), [p for _, p in named],
                                        allow_unused=True)
        except Exception as exc:
            alone = [None] * len(named)
            alone_error = (f"the model cannot compute example 0's gradient alone ({type(exc).__name__}: {exc}); "
                           "its forward depends on other examples of the batch")
        else:
            alone_error = "example 0's per-example gradient differs from its gradient computed alone"

        for (name, p), g0 in zip(named, alone, strict=True):
            if name in reasons:
                continue
            gs = getattr(p, "grad_sample", None)
            if id(p) in hook_errors:
                reasons[name] = hook_errors[id(p)]
            elif p.grad is None:
                reasons[name] = "the probe's forward pass did not use this parameter (no gradient at all)"
            elif gs is None:
                reasons[name] = ("opacus produced no per-example gradient although the parameter has a gradient: "
                                 "it is read outside its module's forward (e.g. peft `target_parameters` LoRA), "
                                 "which opacus' module hooks cannot see")
            elif not torch.is_tensor(gs) or tuple(gs.shape) != (n_ex, *p.shape):
                shape = tuple(gs.shape) if torch.is_tensor(gs) else f"list of {len(gs)}"
                reasons[name] = (f"per-example gradient has shape {shape}, expected {(n_ex, *p.shape)} (the module "
                                 "does not keep the batch as dim 0, e.g. it flattens batch and sequence into tokens)")
            elif not torch.allclose(gs.sum(0), p.grad, rtol=_RTOL, atol=_ATOL * max(1.0, p.grad.abs().max().item())):
                reasons[name] = "per-example gradients do not sum to the batch gradient"
            elif g0 is None or not torch.allclose(gs[0], g0, rtol=_RTOL, atol=_ATOL * max(1.0, g0.abs().max().item())):
                reasons[name] = alone_error
        gsm.remove_hooks()
    return DPSGDSupport(trainable, reasons)


def check_dp_sgd_support(model: nn.Module, batch: torch.Tensor | None = None) -> list[str]:
    """Names of trainable parameters whose per-example gradients opacus cannot compute ([] = supported)."""
    return diagnose_dp_sgd_support(model, batch).unsupported


def require_dp_sgd_support(model: nn.Module, where: str, batch: torch.Tensor | None = None) -> None:
    """Raise :class:`DPSGDUnsupported` (what, why, what instead) unless opacus supports every trainable parameter."""
    report = diagnose_dp_sgd_support(model, batch)
    bad = report.unsupported
    if not bad:
        return
    shown = ", ".join(bad[:_SHOW]) + (f", ... ({len(bad) - _SHOW} more)" if len(bad) > _SHOW else "")
    by_reason: dict[str, list[str]] = {}
    for n in bad:
        by_reason.setdefault(report.reasons[n], []).append(n)
    why = "; ".join(f"[{len(ns)} parameter(s), e.g. {ns[0]}] {r}" for r, ns in by_reason.items())
    raise DPSGDUnsupported(
        f"{where}: example-level DP-SGD (opacus per-example gradients) is not supported for {len(bad)} of "
        f"{len(report.trainable)} trainable parameters: {shown}. Why: {why}. Instead: {ALTERNATIVE}.", bad)
