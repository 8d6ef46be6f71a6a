"""Training metrics as extra slots of the model-update secure sum: a learning curve under secure aggregation.

Owns: the slot table of each objective (``slots_for``: the metric key, its public per-party bound ``[lo, hi]`` and
the value a non-finite figure counts as), the layout of a training release with its slots (``release_layout``: the
last ``k`` words of the update vector, ``UpdateLayout.metric_start``), the party's encoding of its clipped figures
into those words (``encode_into``), the coordinator's decoding of the sum into means over the contributors with
the bound check (``decode``), and the same figures for the plaintext baseline (``plain_means``).

What travels (per party, per training round; ``docs/privacy.md`` §3):

    sft  task_loss                    [0, B]     mean task loss of the round's steps (B = privacy.metric-loss-bound)
    dpo  task_loss, dpo_margin, dpo_acc   [0, B], [-B, B], [0, 1]   mean DPO loss, log-ratio margin, preference acc.
    rl   reward, masked_frac_low, masked_frac_high, k3, logp_diff_mean
                                      [0, 1], [0, 1], [0, 1], [0, 1], [0, 1]   IcePop / mismatch figures

Each figure is clipped to its bound before it is encoded (``+inf`` to ``hi``, ``-inf`` to ``lo``, NaN to the
slot's "worst" end: ``hi`` for losses and mismatch, ``lo`` for reward, margin and accuracy); a party without data
for the task encodes 0 (it is not a contributor). Slot ``j`` (``m_j = max(|lo_j|, |hi_j|)``) holds ``v_j * a_j`` in
the update's fixed point (``frac_bits``, the same rounding as the delta) with

    a_j = max(clip, 1) / m_j                               no update noise: |slot| <= max(clip, 1), inside B(f)
    a_j = M / (sqrt(k) * m_j),                             update noise on (``UpdateLayout.private``):
    M   = (sqrt(D2^2 - (C_d 2^f + sqrt(numel) r)^2) - sqrt(k) r) / 2^f,   C_d = clip sqrt(1 - rho^2)

(``rho`` = ``privacy.update-metric-share``, ``D2 = layout.int_sensitivity()``, ``r`` the rounding radius: 1 at 32
bits, 1/2 at 64). The delta is then clipped to ``C_d`` (``UpdateLayout.delta_clip``), so the party's whole rounded
vector still has L2 norm ``<= D2``: the update noise (``distmoe.privacy.update_noise``, the same variance on the
metric words) covers the slots at the sensitivity it was calibrated to, and the accounting is unchanged. The noise
std of slot ``j``'s mean is ``z_u * D2 * sqrt(n_active / t) / (2^f * a_j * contributors)`` (about
``z_u * m_j * sqrt(k) / (rho * contributors)``). With update noise and ``rho = 0`` there are no slots.

Must not: import ``flwr`` or ``torch``, let a value outside its slot's bound into a vector, or decode a sum whose
slots no honest set of contributors can produce (``decode`` names the slot instead).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from distmoe.privacy import dp, ring
from distmoe.privacy.vectors import LayoutError, UpdateLayout

__all__ = ["Slot", "slots_for", "objective_of", "release_layout", "clip_value", "slot_scales", "encode_into",
           "decode", "plain_means", "noise_std"]

OBJECTIVES = ("sft", "dpo", "rl")
MISMATCH_MAX = 1.0  # the public bound of the K3 estimate and of the mean |logp_train - logp_infer| per token
TAIL_SIGMAS = 10.0  # the coordinator's margin for the update noise in a slot's bound check


@dataclass(frozen=True)
class Slot:
    key: str  # the metric key (wire.schema: TRAIN_METRIC_KEYS / RL_METRIC_KEYS), also the metrics.jsonl key
    lo: float
    hi: float
    worst: float  # what a NaN counts as

    @property
    def magnitude(self) -> float:
        return max(abs(self.lo), abs(self.hi))


def slots_for(objective: str, loss_bound: float) -> tuple[Slot, ...]:
    """The released training metrics of ``objective`` (``sft``, ``dpo`` or ``rl``); ``loss_bound`` is
    ``privacy.metric-loss-bound``."""
    b = float(loss_bound)
    if not b > 0:
        raise LayoutError(f"privacy.metric-loss-bound must be > 0 for the training-metric slots, got {b:g}")
    if objective == "sft":
        return (Slot("task_loss", 0.0, b, b),)
    if objective == "dpo":
        return Slot("task_loss", 0.0, b, b), Slot("dpo_margin", -b, b, -b), Slot("dpo_acc", 0.0, 1.0, 0.0)
    if objective == "rl":
        return (Slot("reward", 0.0, 1.0, 0.0), Slot("masked_frac_low", 0.0, 1.0, 1.0),
                Slot("masked_frac_high", 0.0, 1.0, 1.0), Slot("k3", 0.0, MISMATCH_MAX, MISMATCH_MAX),
                Slot("logp_diff_mean", 0.0, MISMATCH_MAX, MISMATCH_MAX))
    raise LayoutError(f"no training-metric slots for objective {objective!r} (one of {', '.join(OBJECTIVES)})")


def objective_of(kind: str, objective: str | None = None) -> str:
    """The slot table's objective of an update release: ``rl`` for an rl round, else the sft instruction's
    objective (None = ``sft``, ``dpo``)."""
    return "rl" if kind == "rl" else (objective or "sft")


def release_layout(layout: UpdateLayout, objective: str, loss_bound: float, share: float
                   ) -> tuple[UpdateLayout, tuple[Slot, ...]]:
    """``layout`` with the slots of ``objective`` (none with update noise and ``share`` = 0); ``share`` is
    ``privacy.update-metric-share`` (used only with update noise)."""
    if not 0.0 <= share < 1.0:
        raise LayoutError(f"privacy.update-metric-share must be in [0, 1), got {share:g}")
    if layout.private and share == 0.0:
        return replace(layout, metric_slots=0, metric_share=0.0), ()
    slots = slots_for(objective, loss_bound)
    out = replace(layout, metric_slots=len(slots), metric_share=share if layout.private else 0.0)
    slot_scales(out, slots)  # fails here, naming the share, if it leaves no room above the rounding
    return out, slots


def _radius(layout: UpdateLayout) -> float:
    return 1.0 if layout.bits == 32 else 0.5


def slot_scales(layout: UpdateLayout, slots: Sequence[Slot]) -> np.ndarray:
    """``[k]`` a_j: float units of the update per unit of each metric (module docstring)."""
    mags = np.array([s.magnitude for s in slots], np.float64)  # [k]
    if len(slots) != layout.metric_slots:
        raise LayoutError(f"{len(slots)} metric slots for a layout with {layout.metric_slots}")
    if not layout.private:
        return max(layout.clip, 1.0) / mags
    f, r, k = layout.frac_bits, _radius(layout), len(slots)
    d2 = layout.int_sensitivity()
    a = layout.delta_clip * 2.0**f + math.sqrt(layout.numel) * r
    m = (math.sqrt(max(d2 * d2 - a * a, 0.0)) - math.sqrt(k) * r) / 2.0**f
    if not m > 0:
        raise LayoutError(f"privacy.update-metric-share = {layout.metric_share:g} leaves no room for {k} metric "
                          "slots above the fixed-point rounding; raise it or set it to 0")
    return m / (math.sqrt(k) * mags)


def clip_value(slot: Slot, v: float) -> float:
    """``v`` clipped to the slot's bound; NaN counts as the slot's worst value."""
    v = float(v)
    if math.isnan(v):
        return slot.worst
    return min(max(v, slot.lo), slot.hi)


def encode_into(vec: np.ndarray, layout: UpdateLayout, slots: Sequence[Slot], values: Mapping[str, float],
                contributed: bool, rng: ring.UniformSource | None = None) -> dict[str, float]:
    """Write the party's clipped figures (0 where it did not contribute) into the metric words of ``vec`` (its
    ``layout.encode`` output, before noise or masks); returns the clipped figures for its own log."""
    if vec.shape != (layout.length,):
        raise LayoutError(f"input has shape {vec.shape}, layout length {layout.length}")
    if not slots:
        return {}
    clipped = {s.key: clip_value(s, values.get(s.key, math.nan)) for s in slots}
    x = np.array([clipped[s.key] if contributed else 0.0 for s in slots], np.float64) * slot_scales(layout, slots)
    if layout.bits == 32 and rng is None:
        rng = dp.KeystreamUniform()
    ring.encode_fixed_into(x, 2.0**layout.frac_bits, vec[layout.metric_start:], rng if layout.bits == 32 else None)
    return clipped if contributed else {}


def noise_std(layout: UpdateLayout, z_u: float, n_active: int, threshold: int) -> float:
    """Std of the update noise on one word of the sum, in fixed-point units (0 without update noise)."""
    if not (layout.private and z_u > 0):
        return 0.0
    return z_u * layout.int_sensitivity() * math.sqrt(n_active / max(threshold, 1))


def decode(total: np.ndarray, layout: UpdateLayout, slots: Sequence[Slot], contributors: int, n_included: int,
           sigma_int: float = 0.0) -> tuple[dict[str, float], dict[str, float], str | None]:
    """From the sum: (mean of each slot over the ``contributors``, the noise std of each mean, why the slots cannot
    come from honest parties or None). Each slot's sum must lie in ``[c lo, c hi]`` widened by the rounding of the
    ``n_included`` inputs (< 1 unit each) and ``TAIL_SIGMAS`` noise stds; no contributor: no mean."""
    if not slots:
        return {}, {}, None
    ints = ring.from_ring(np.asarray(total))
    if ints.shape != (layout.length,):
        raise LayoutError(f"sum has shape {ints.shape}, layout length {layout.length}")
    unit = 2.0**layout.frac_bits * slot_scales(layout, slots)  # [k] fixed-point units per metric unit
    sums = ints[layout.metric_start:].astype(np.float64) / unit  # [k] metric units
    tol = (n_included + TAIL_SIGMAS * sigma_int) / unit  # [k]
    c = max(int(contributors), 0)
    for s, v, e in zip(slots, sums, tol, strict=True):
        if not (c * s.lo - e <= v <= c * s.hi + e):
            return {}, {}, (f"training-metric slot {s.key} sums to {v:.6g}, outside [{c} x {s.lo:g}, {c} x {s.hi:g}] "
                            "(a party that did not clip it to its bound)")
    if c == 0:
        return {}, {}, None
    means = {s.key: float(v / c) for s, v in zip(slots, sums, strict=True)}
    stds = {s.key: float(sigma_int / u / c) for s, u in zip(slots, unit, strict=True)} if sigma_int > 0 else {}
    return means, stds, None


def plain_means(figures: Sequence[Mapping[str, float]], slots: Sequence[Slot]) -> dict[str, float]:
    """The plaintext baseline's same figures: each contributor's value clipped to its slot, averaged uniformly."""
    if not figures:
        return {}
    return {s.key: float(np.mean([clip_value(s, f.get(s.key, math.nan)) for f in figures])) for s in slots}
