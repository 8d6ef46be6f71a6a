"""Gradient guards of one local optimizer step, shared by SFT (``train/sft.py``) and GRPO (``rl/grpo.py``).

Owns: ``guard_gradients`` (the non-finite check that names the offending tensors, optional winsorisation,
then gradient-norm clipping) and ``NonFinite`` (the per-round tally of skipped steps and the parameter
names behind them, for the party's own log).

Winsorisation (``train.winsorize = k``, off at 0), per gradient tensor ``g`` of a trainable parameter,
after any float16 unscaling and before the global norm clip::

    rms(g) = sqrt(mean(g_i^2))                                    []  over the tensor's elements
    g_i   <- clamp(g_i, -k * rms(g), +k * rms(g))                 [same shape as g]

Classical winsorisation (Dixon 1960; Tukey 1962, "The Future of Data Analysis") with the tensor's own RMS
as its scale: one element far outside its tensor's spread (a rare token's logit row, a hot expert's
row) is cut back to ``k`` RMS, while the norm clip afterwards still bounds the whole step. It is the
element-wise counterpart of value clipping (``torch.nn.utils.clip_grad_value_``) with a scale that follows
each tensor, in the spirit of the spike guards of large-scale MoE RL training (outlier updates from a few
tokens, see the Ring-1T and R3 notes in ``docs/algorithms.md``). The scale is stateless (recomputed every
step): a deployed party runs each round in a fresh process, so no running statistic survives anyway.
Since ``max_i |g_i| >= rms(g)``, ``k >= 1`` is required; a tensor of ``n`` elements is touched only where
one element exceeds ``k`` RMS, which needs ``k < sqrt(n)``.

Must not: step the optimizer, read files or talk to the wire.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

NAMES_SHOWN = 5  # parameter names listed in a log line (the count is always given)


@dataclass
class NonFinite:
    """Skipped steps of one local round: how many, and per parameter name in how many of them its
    gradient was non-finite (first-seen order). ``"<loss>"`` stands for steps whose loss was already
    non-finite, so no gradient was computed."""

    skipped: int = 0
    params: dict[str, int] = field(default_factory=dict)

    def add(self, names: list[str]) -> None:
        self.skipped += 1
        for n in names:
            self.params[n] = self.params.get(n, 0) + 1

    def summary(self) -> str:
        """``"3 steps; 2 tensors: a.weight (3), b.weight (1)"``: the first ``NAMES_SHOWN`` names and the count."""
        names = [f"{n} ({c})" for n, c in list(self.params.items())[:NAMES_SHOWN]]
        more = len(self.params) - NAMES_SHOWN
        head = (f"{self.skipped} step{'s' if self.skipped != 1 else ''}; {len(self.params)} tensor"
                f"{'s' if len(self.params) != 1 else ''}: ")
        return head + ", ".join(names) + (f", +{more} more" if more > 0 else "")

    def facts(self) -> dict:
        """For the party's own metrics log: the names (first ``NAMES_SHOWN``) and the number of tensors."""
        return {"nonfinite_params": list(self.params)[:NAMES_SHOWN], "nonfinite_tensors": len(self.params)}


@torch.no_grad()
def winsorize_(grads: list[torch.Tensor], k: float) -> None:
    """Clamp each gradient tensor's elements to ``[-k rms, k rms]`` of that tensor, in place (module
    docstring); ``k <= 0``: nothing. No host synchronisation (the bound stays a device tensor)."""
    if k <= 0:
        return
    for g in grads:
        bound = (k / math.sqrt(max(g.numel(), 1)) * torch.linalg.vector_norm(g, dtype=torch.float32)).to(g.dtype)  # []
        g.clamp_(min=-bound, max=bound)


def guard_gradients(named: list[tuple[str, torch.nn.Parameter]], grad_clip: float, winsorize: float = 0.0
                    ) -> tuple[torch.Tensor, list[str] | None]:
    """Check, winsorise and clip the gradients of ``named`` trainable parameters.

    Returns ``(total norm before clipping, None)`` when the step may proceed, or ``(non-finite norm, names)``
    with the names of the tensors whose gradient norm is NaN/Inf (then nothing was modified and the
    caller skips the step). The check runs before clipping, which would scale every gradient by the
    non-finite factor and hide where it came from."""
    with_grad = [(n, p.grad) for n, p in named if p.grad is not None]
    grads = [g for _, g in with_grad]
    if not grads:
        return torch.zeros(()), None
    total = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False)
    if not torch.isfinite(total):
        bad = [n for n, g in with_grad if not torch.isfinite(torch.linalg.vector_norm(g.detach().float()))]
        return total, bad or ["<norm overflow>"]  # every tensor finite, only their summed squares overflowed
    if winsorize > 0:
        winsorize_(grads, winsorize)
        total = torch.nn.utils.get_total_norm(grads, 2.0)
    torch.nn.utils.clip_grads_with_norm_([p for _, p in named if p.grad is not None], grad_clip, total)
    return total, None
