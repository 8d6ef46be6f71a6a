"""Client-level DP on model updates: each party's share of the Gaussian noise on the summed update.

Mechanism (the Gaussian mechanism on the secure sum; client-level DP as in McMahan et al., "Learning
Differentially Private Recurrent Language Models", ICLR 2018, https://arxiv.org/abs/1710.06963, with the
noise split across parties as in distributed DP): every party clips its update to L2 norm ``C``
(``privacy.update-clip``) in the private ``UpdateLayout`` (uniform weights, no metrics, so nothing outside
the noised block depends on data) and adds

    n_i ~ round(N(0, (z_u * D2)^2 / t))   over the first ``numel`` coordinates of its vector ``[D]``

in fixed-point units (``D2 = layout.int_sensitivity() = C * 2^f + sqrt(numel) * r``, the L2 sensitivity
after rounding, ``r = 1`` for the stochastic rounding of a 32-bit layout and ``1/2`` for nearest rounding
at 64 bits; ``f = layout.frac_bits``; ``t`` = the SecAgg threshold), in the layout's ring width. The sum
over ``n_active >= t`` survivors then carries standard deviation ``>= z_u * D2``, the add/remove-one-party
L2 sensitivity of the rounded sum. The ledgers' unit is one sequence, and one sequence moves a party's
clipped delta by up to ``2 * C``
(its delta with and without the sequence are two vectors of norm <= C): at that sensitivity the release is
the Gaussian mechanism at ``z_u / 2`` (``SEQUENCE_FACTOR``), which is what :func:`update_event` charges
(``z_u * sqrt(n_active / t) / 2`` for ``n_active`` survivors; the party charges ``n_active = t``).
The share is rounded to the fixed-point grid (step ``2^-f``, some 10^-12 of the noise std): a rounded
Gaussian, accounted as the Gaussian mechanism. Exact Skellam is not used here because numpy's Poisson
sampler stops at rate ~1e19, below these variances in fixed-point units.

The training-metric words of a release that has them (``distmoe.privacy.train_metrics``: the delta is clipped to
``clip * sqrt(1 - rho^2)`` and the metric words hold the rest of the clip's norm, so the whole rounded vector keeps
L2 norm ``<= D2``) get the same variance per word: the metrics are inside the noised block, at the same sensitivity.

Must not: decide whether a release may happen (the party's accountant does), or touch anything but the
update block and the training-metric words of the vector.
"""

from __future__ import annotations

import math

import numpy as np

from distmoe.privacy import ring
from distmoe.privacy.accountant import PrivacyEvent
from distmoe.privacy.dp import crypto_rng
from distmoe.privacy.vectors import UpdateLayout

SEQUENCE_FACTOR = 2.0  # one sequence's L2 sensitivity on a clipped update, in units of the clip


def sequence_noise_multiplier(z_party: float) -> float:
    """The noise multiplier at the sequence level of a release calibrated to ``z_party`` at sensitivity clip."""
    return z_party / SEQUENCE_FACTOR


def update_event(z_u: float, n_active: int, threshold: int, label: str) -> PrivacyEvent:
    """The per-sequence ledger's event of one noised update release summed over ``n_active`` survivors."""
    return PrivacyEvent(sequence_noise_multiplier(z_u * math.sqrt(n_active / threshold)), 1.0, 1, "gaussian", label)


class UpdateNoiseError(ValueError):
    """Update noise was asked for a layout that would release exact weights or metrics."""


def add_update_noise(vec: np.ndarray, layout: UpdateLayout, z_u: float, threshold: int) -> np.ndarray:
    """``vec`` ([D] uint32/uint64, the party's encoded update) plus its Gaussian noise share (module docstring)."""
    if not layout.private:
        raise UpdateNoiseError("update noise requested on a non-private layout (weights and metrics would leave "
                               "exact)")
    sens = layout.int_sensitivity()  # L2 sensitivity after rounding, fixed-point units
    var = (z_u * sens) ** 2 / threshold  # over-provisioned: the sum over >= t survivors carries >= (z_u * sens)^2
    signed = ring.from_ring(vec).astype(np.int64)  # [D] int64 (a copy)
    signed[:layout.numel] += np.rint(crypto_rng().normal(0.0, math.sqrt(var), layout.numel)).astype(np.int64)
    if layout.metric_slots:  # the training-metric words (distmoe.privacy.train_metrics): inside the same sensitivity
        k = layout.metric_slots
        signed[layout.metric_start:] += np.rint(crypto_rng().normal(0.0, math.sqrt(var), k)).astype(np.int64)
    return ring.to_ring(signed, layout.bits)  # [D] in the layout's width (WrapError if a share leaves it)


def update_dp_facts(layout: UpdateLayout, z_u: float, n_parties: int, threshold: int,
                    n_active: int | None = None) -> dict:
    """The ledgers' ``dp`` facts of a noised update release over ``n_active`` survivors (a party: ``threshold``).
    ``z_eff`` is the party-level multiplier (noise std over ``clip``), ``z_sequence`` what the ledger charges.
    ``metrics``: ``"in-noised-block"`` when the training metrics travel inside the noised block (``metric_slots``
    of them, noised at the same sensitivity, the delta clipped to ``delta_clip``), ``"withheld"`` when none travels;
    either way no metric travels beside the noised block."""
    n = threshold if n_active is None else n_active
    z_eff = z_u * math.sqrt(n / threshold)
    return {"mechanism": "gaussian", "unit": "party", "neighbours": "add/remove", "noise_multiplier": z_u,
            "n_parties": n_parties, "n_active": n, "max_dropouts": n_parties - threshold, "z_eff": z_eff,
            "clip": layout.clip, "weights": "uniform", "sensitivity": layout.sensitivity,
            "metrics": "in-noised-block" if getattr(layout, "metric_slots", 0) else "withheld",
            "metric_slots": getattr(layout, "metric_slots", 0),
            "delta_clip": getattr(layout, "delta_clip", layout.clip),
            "sequence_sensitivity": SEQUENCE_FACTOR * layout.clip, "z_sequence": sequence_noise_multiplier(z_eff)}
