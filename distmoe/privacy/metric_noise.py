"""Distributed DP for evaluation figures: per-example integer sums with a Skellam noise share, per task.

Why. Under secure aggregation the server sees only sums, but two releases whose survivor sets differ by one
party (a straggler) difference to that party's own figures. Exact held-out counts, correct answers and
losses would therefore leak one party's numbers through the "sum". Here every figure of an evaluation
release carries distributed Skellam noise calibrated to one held-out sequence and is charged in the
per-sequence ledger like the router statistics (``distmoe.privacy.dp``, ``distmoe.privacy.accountant``).

Mechanism (Agarwal, Kairouz, Liu, "The Skellam Mechanism for Differentially Private Federated Learning",
NeurIPS 2021, https://arxiv.org/abs/2110.04995), per party and task ``t`` with held-out examples ``x``
(at most ``examples_max = data.max-eval-examples`` of them, a public cap)::

    v_x     = s * ([x answered correctly], round_s(min(max(loss_x, 0), B) / B), 1)     [3] integers in [0, s]
    c_t     = sum_x v_x                                                                 [3]
    share   = concat_t(c_t) + Sk(sigma_int^2 / (n - d_max))                            [3T]
    D2      = s * sqrt(3),   D1 = 3 s      (one held-out sequence belongs to one task)
    sigma_int = z_m * D2,    z_eff = z_m * sqrt(n_active / (n - d_max))

with ``s = SCALE`` integer units per example, ``loss_x`` the example's mean answer-token cross-entropy
clipped to ``B = privacy.metric-loss-bound`` nats, ``z_m = privacy.metric-noise-multiplier`` and
``Sk(v) = Poisson(v/2) - Poisson(v/2)``. The server decodes ``n_t = count/s``, ``acc_t = correct/count``,
``loss_t = B * loss/count`` (post-processing, clamped to their ranges). Each release is a Skellam event
``(z_eff, D2, D1)`` (the party charges ``z_eff(t) = z_m`` before it sends); the audit recomputes it.

Routing metrics (``routing_kl``, ``load_cv``, ``top1_consistency``) have no per-sequence bound as computed
(ratios and KLs of a party's whole routing set) and are not released under secure aggregation.

Must not: import ``flwr`` or ``torch``, decide whether a release may happen (the accountants do), or
account epsilon (``distmoe.privacy.accountant`` composes the event this module describes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from distmoe.privacy import ring
from distmoe.privacy.accountant import PrivacyEvent
from distmoe.privacy.dp import crypto_rng, skellam_noise, skellam_tail

SCALE = 64  # integer units per held-out example and coordinate (the loss is rounded to 1/64 of its bound)
SLOTS = ("correct", "loss", "count")  # per task, in this order


def eval_sensitivity(scale: float = SCALE) -> tuple[float, float]:
    """``(D2, D1)`` of one held-out sequence in integer units: three coordinates of at most ``s`` each."""
    return float(scale) * math.sqrt(len(SLOTS)), float(scale) * len(SLOTS)


class EvalNoiseError(ValueError):
    """Evaluation figures outside their declared bounds (tasks, counts, values)."""


@dataclass(frozen=True)
class EvalSpec:
    """Calibration of one evaluation release over ``tasks`` (module docstring); all values derived."""

    tasks: tuple[str, ...]
    noise_multiplier: float  # z_m, relative to D2
    n_parties: int
    max_dropouts: int
    examples_max: int  # data.max-eval-examples: held-out examples a party evaluates per task
    loss_bound: float  # B, nats
    scale: int = SCALE

    def __post_init__(self) -> None:
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier > 0):
            raise EvalNoiseError(f"evaluation noise multiplier must be > 0, got {self.noise_multiplier!r}")
        if self.n_parties < 1 or not 0 <= self.max_dropouts < self.n_parties:
            raise EvalNoiseError("need n_parties >= 1 and 0 <= max_dropouts < n_parties")
        if self.examples_max < 1 or not (math.isfinite(self.loss_bound) and self.loss_bound > 0):
            raise EvalNoiseError("need examples_max >= 1 and a finite loss bound > 0")

    @property
    def length(self) -> int:
        return self.length_for(self.tasks)

    @staticmethod
    def length_for(tasks: Sequence[str]) -> int:
        """The release's vector length for ``tasks``: three coordinates per task (public)."""
        return len(SLOTS) * len(tasks)

    @property
    def delta2_int(self) -> float:
        return eval_sensitivity(self.scale)[0]

    @property
    def delta1_int(self) -> float:
        return eval_sensitivity(self.scale)[1]

    @property
    def party_variance(self) -> float:
        """One party's Skellam variance: ``(z_m D2)^2 / (n - d_max)`` (over-provisioned for dropouts)."""
        return (self.noise_multiplier * self.delta2_int) ** 2 / (self.n_parties - self.max_dropouts)

    def aggregate_sigma(self, n_active: int) -> float:
        return math.sqrt(n_active * self.party_variance)

    def effective_noise_multiplier(self, n_active: int) -> float:
        return self.aggregate_sigma(n_active) / self.delta2_int

    def check_fits_ring64(self) -> None:
        """Raise ``ring.WrapError`` unless every party at ``examples_max`` plus the noise tail fits Z_2^64."""
        bound = self.n_parties * self.examples_max * self.scale + skellam_tail(
            self.aggregate_sigma(self.n_parties) ** 2, max(self.length, 1)
        )
        ring.check_fits_ring64(bound, f"{self.n_parties} parties x {self.examples_max} evaluation examples")

    def event(self, n_active: int, label: str) -> PrivacyEvent:
        """The per-sequence ledger event of this release summed over ``n_active`` survivors."""
        return PrivacyEvent(
            self.effective_noise_multiplier(n_active), 1.0, 1, "skellam", label, d2=self.delta2_int, d1=self.delta1_int
        )

    def dp_params(self, n_active: int) -> dict[str, Any]:
        """JSON-able ``dp`` facts of the ledgers' release entries."""
        return {
            "mechanism": "skellam",
            "unit": "sequence",
            "neighbours": "add/remove",
            "release": "eval",
            "noise_multiplier": self.noise_multiplier,
            "z_eff": self.effective_noise_multiplier(n_active),
            "scale": self.scale,
            "delta2_int": self.delta2_int,
            "delta1_int": self.delta1_int,
            "sigma_int": self.aggregate_sigma(n_active),
            "n_parties": self.n_parties,
            "n_active": n_active,
            "max_dropouts": self.max_dropouts,
            "examples_max": self.examples_max,
            "loss_bound": self.loss_bound,
            "routing_metrics": "withheld",
        }

    # ------------------------------------------------------------------ party side
    def sums(self, scores: Mapping[str, Sequence[tuple[bool, float]]]) -> np.ndarray:
        """``[3T]`` int64 per-task sums of ``v_x`` from ``(correct, loss)`` per held-out example (no noise)."""
        unknown = set(scores) - set(self.tasks)
        if unknown:
            raise EvalNoiseError(f"evaluation scores for undeclared tasks {sorted(unknown)[:3]}")
        out = np.zeros(self.length, np.int64)
        s, b = self.scale, self.loss_bound
        for i, t in enumerate(self.tasks):
            ex = list(scores.get(t, ()))
            if len(ex) > self.examples_max:
                raise EvalNoiseError(
                    f"task {t!r}: {len(ex)} evaluated examples, above data.max-eval-examples = {self.examples_max}"
                )
            for ok, loss in ex:
                lx = min(max(float(loss), 0.0), b) if math.isfinite(loss) else b  # a non-finite loss counts as B
                out[3 * i : 3 * i + 3] += (s * int(bool(ok)), int(round(s * lx / b)), s)
        return out

    def share(self, sums: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        """``sums`` ([3T] int64) plus this party's Skellam share, as ``[3T]`` uint64 (ring units)."""
        a = np.asarray(sums, np.int64)
        if a.shape != (self.length,):
            raise EvalNoiseError(f"evaluation sums of shape {a.shape}, layout length {self.length}")
        top = self.examples_max * self.scale
        if a.size and (a.min() < 0 or a.max() > top):
            raise EvalNoiseError(f"evaluation sums outside [0, {top}] (data.max-eval-examples x scale)")
        noisy = a + skellam_noise(a.shape, self.party_variance, rng if rng is not None else crypto_rng())
        return ring.to_ring64(noisy)

    # ------------------------------------------------------------------ server side
    def decode(self, total: np.ndarray) -> dict[str, float]:
        """From the sum (uint64 ``[3T]``): ``n/<task>`` (noisy count), ``acc/<task>`` and ``loss/<task>``
        (ratios of noisy sums, clamped to [0, 1] and [0, B]; NaN while the noisy count is below 1/2)."""
        ints = ring.from_ring64(np.asarray(total, np.uint64)).astype(np.float64)
        if ints.shape != (self.length,):
            raise EvalNoiseError(f"sum has shape {ints.shape}, layout length {self.length}")
        out: dict[str, float] = {}
        for i, t in enumerate(self.tasks):
            correct, loss, count = ints[3 * i : 3 * i + 3] / self.scale
            out[f"n/{t}"] = max(float(count), 0.0)
            ok = count >= 0.5
            out[f"acc/{t}"] = float(min(max(correct / count, 0.0), 1.0)) if ok else math.nan
            out[f"loss/{t}"] = float(min(max(self.loss_bound * loss / count, 0.0), self.loss_bound)) if ok else math.nan
        return out

    def problem(self, total: np.ndarray, n_included: int) -> str | None:
        """Why a decoded sum cannot come from ``n_included`` honest parties (a coordinate outside
        ``[0, n * examples_max * s]`` by more than 10 noise standard deviations), or None."""
        ints = ring.from_ring64(np.asarray(total, np.uint64)).astype(np.float64)
        tail = 10.0 * self.aggregate_sigma(n_included)
        top = n_included * self.examples_max * self.scale + tail
        if ints.size and (ints.min() < -tail or ints.max() > top):
            return (
                f"evaluation sums in [{ints.min():.6g}, {ints.max():.6g}], outside [-{tail:.6g}, {top:.6g}] "
                f"({n_included} parties x data.max-eval-examples {self.examples_max} at scale {self.scale} "
                "plus noise)"
            )
        return None
