"""The inference engine's view over the policy's own weights: a copy of the module tree (module objects, their
hooks, their ``training`` flags) whose parameters and buffers ARE the policy's tensors, so an engine costs no
second copy of the base (``docs/algorithms.md``, "Inference engine profiles").

What a numerics profile changes is applied without a resident copy:

* a per-tensor ``transform`` (``bf16``: cast; ``int8-weight-only``: symmetric per-row int8 fake quantisation;
  ``int<b>-experts``: per-channel fake quantisation of the expert stacks)
  runs **on the fly**, one decoder layer at a time: a forward pre-hook on each layer (and on each module with
  tensors of its own outside the layers: embeddings, final norm, ``lm_head``, the rotary buffers) puts the
  transformed tensors into that module's (the view's) own parameter and buffer dicts, and a forward hook puts
  the policy's tensors back. A layer is the unit, not a leaf module, because some forwards read weights of
  modules they do not call (the routed expert LoRA reads the expert stack's tensors and peft's factors).
  Peak extra memory: one layer's transformed tensors.
* a module replaced by another (``int8-dynamic``: ``torch.ao`` dynamic quantisation of ``nn.Linear``) is
  replaced in the view's tree only; the view then owns that module's int8 weights (a quarter of those
  linears' float32 bytes), nothing else.
* forward hooks (``prune-k``) are registered on the view's router modules, not on the policy's.

The values a forward of the view sees are exactly those of a ``copy.deepcopy`` of the policy with the same
changes applied to the copy's tensors (``tests/rl/test_engine_view.py`` checks token ids and log-probs equal,
per profile, on a plain and on a peft model).

Owns: ``share_copy`` (the tree copy sharing chosen tensors) and ``OnTheFly`` (the per-layer swap). Must not:
modify any tensor of the policy (every swap is a dict entry of the view's own modules), decide what a profile
does (``engines.py``), sample or compute losses.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

Transform = Callable[[str, torch.Tensor], torch.Tensor]


def share_copy(model: nn.Module, share: Callable[[torch.Tensor], bool] | None = None) -> nn.Module:
    """``copy.deepcopy(model)`` in which every parameter and buffer for which ``share`` is true (all of them by
    default) is an alias of the policy's tensor: the same storage (in-place updates of the policy show), detached
    and not requiring a gradient, as in a frozen copy (kernels that dispatch on ``requires_grad`` see what they
    would see in a deep copy, and no graph is ever built over the policy's tensors); new module objects, no new
    tensor storage for shared ones."""
    memo: dict[int, object] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if share is None or share(t):
            alias = t.detach()
            memo[id(t)] = nn.Parameter(alias, requires_grad=False) if isinstance(t, nn.Parameter) else alias
    return copy.deepcopy(model, memo)


def _layer_units(root: nn.Module) -> list[nn.Module]:
    """The decoder layers: the children of every ``nn.ModuleList`` named ``...layers``."""
    units: list[nn.Module] = []
    for name, mod in root.named_modules():
        if isinstance(mod, nn.ModuleList) and name.split(".")[-1] == "layers":
            units.extend(mod)
    return units


class OnTheFly:
    """Apply ``transform(qualified_name, tensor)`` to the view's tensors one unit at a time (module docstring).
    ``transform`` returns its input unchanged where nothing changes (no swap is made then)."""

    def __init__(self, view: nn.Module, transform: Transform):
        self.transform = transform
        units = _layer_units(view)
        in_unit = {id(m) for u in units for m in u.modules()}
        names = {id(m): n for n, m in view.named_modules(remove_duplicate=False)}
        owners = [m for m in view.modules() if id(m) not in in_unit and (m._parameters or m._buffers)]
        for unit in units + owners:
            slots = []  # (module, dict attribute, key, qualified name): every tensor the unit's forward may read
            mods = unit.modules() if id(unit) in in_unit else [unit]
            for m in mods:
                base = names.get(id(m), "")
                for attr in ("_parameters", "_buffers"):
                    for key, t in getattr(m, attr).items():
                        if t is not None and t.is_floating_point():
                            slots.append((m, attr, key, f"{base}.{key}" if base else key))
            if slots:
                self._hook(unit, slots)

    def _hook(self, unit: nn.Module, slots: list[tuple[nn.Module, str, str, str]]) -> None:
        saved: list[list[tuple[dict, str, torch.Tensor]]] = []

        def pre(_m, _a):
            swapped = []
            with torch.no_grad():
                for m, attr, key, qual in slots:
                    d = getattr(m, attr)
                    orig = d[key]
                    new = self.transform(qual, orig)
                    if new is not orig:  # a Parameter where one was (peft re-registers what it finds by its type)
                        d[key] = nn.Parameter(new, requires_grad=False) if attr == "_parameters" else new
                        swapped.append((d, key, orig))
            saved.append(swapped)

        def post(_m, _a, _o):
            for d, key, orig in saved.pop() if saved else ():
                d[key] = orig

        unit.register_forward_pre_hook(pre)
        unit.register_forward_hook(post, always_call=True)
