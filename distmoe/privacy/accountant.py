"""Per-party privacy accountant: every release of a party's data is an event; refuse before overspending.

Owns: the event record (``PrivacyEvent``: mechanism, noise multiplier ``z``, sample rate ``q``, steps), the
composition of a party's events into epsilon at a fixed delta with two opacus accountants, the prospective
budget check (:meth:`Accountant.would_exceed`, :meth:`Accountant.spend` raising :class:`BudgetExceeded`
*before* anything is composed), a JSON-able state (the event list; numbers are always recomputed from it, so
the audit can replay it with :func:`epsilon_from_events`), the inversion ``target epsilon -> z``
(:func:`noise_multiplier_for`) and a Skellam RDP bound (:func:`skellam_epsilon`) to check the approximation.

Events. A router-statistic release on all local data is ``PrivacyEvent(z_eff, 1.0, 1, "skellam", d2=D2, d1=D1)``
(``z_eff`` from ``SkellamSpec.effective_noise_multiplier(n_active)``: survivors only; ``D2, D1`` its integer
sensitivities, ``distmoe.privacy.releases.stats.event``); a subsampled Gaussian is ``PrivacyEvent(z, sample_rate=B/N,
steps=k)``. The unit is one sequence (add/remove). A client-level DP model update (noise std ``z_u * clip``,
party-level sensitivity ``clip``) moves by up to ``2 * clip`` when one sequence changes, so it enters this ledger
as a Gaussian event at ``z_u / 2`` (``distmoe.privacy.update_noise.update_event``), never at ``z_u``.

Papers: PRV, Gopi, Lee, Wutschitz, "Numerical Composition of Differential Privacy", NeurIPS 2021,
https://arxiv.org/abs/2106.02848; RDP, Mironov, "Renyi Differential Privacy", CSF 2017,
https://arxiv.org/abs/1702.07476; the Skellam bound, Agarwal, Kairouz, Liu, "The Skellam Mechanism for
Differentially Private Federated Learning", NeurIPS 2021, https://arxiv.org/abs/2110.04995. For a history of
events ``(z_i, q_i, steps_i)`` (merged per ``(z, q)``) at a fixed ``delta``, with RDP orders ``alpha`` in ``ALPHAS``
(``[A]``, 1.1 ... 1024; only the integer ones, ``[A_int]``, when a Skellam event is in the history)::

    rdp(alpha)  = sum_i steps_i * rdp_i(alpha)                               [A]
    rdp_i       = rdp_subsampled_gaussian(q_i, z_i, alpha)   (= alpha / (2 z^2) at q = 1)          gaussian
                = alpha/(2 z^2) + min(((2 alpha - 1) D2^2 + 6 D1)/(4 mu^2), 3 D1/(2 mu)),  mu = (z D2)^2   skellam
    eps_rdp     = min_alpha rdp(alpha) - (log delta + log alpha) / (alpha - 1) + log((alpha - 1) / alpha)     []
                  (opacus' RDP -> (eps, delta) conversion, Balle et al. 2020)
    eps_prv     = PRV composition of the privacy-loss distributions, within eps_error = 0.01   []
                  (a Skellam event enters PRV as its Gaussian approximation: informational only)
    eps         = max(eps_prv, eps_rdp)   (the default primary)                                 []

Which epsilon. ``epsilon()`` returns ``(eps_prv, eps_rdp)``. PRV (Gopi et al. 2021, opacus ``PRVAccountant``,
``eps_error=0.01``) is a numerical upper bound within ~0.01 of the exact value; RDP (opacus' ``compute_rdp`` and
conversion, orders up to 1024; opacus' default orders stop at 63 and over-estimate small-noise-count cases) is a
looser analytical upper bound (~7% above, ``docs/privacy.md`` §10). The budget is enforced on the **primary**
epsilon, by default ``"max"`` = max(PRV, RDP): both are valid upper bounds for a Gaussian history (with a
Skellam event only RDP is, and the maximum is still >= it), so the maximum can only be safe,
and a numerical failure of one accountant cannot under-report; the cost is ~7% of budget. ``"prv"`` (tighter)
and ``"rdp"`` are selectable. If PRV fails to compute, it is reported as NaN and the primary falls back to RDP.

Skellam by its own RDP bound, at integer orders. The distributed Skellam release (``distmoe.privacy.dp``) is
accounted with the bound of Agarwal et al. 2021 (Theorem 3.5, ``rdp_i`` above), which holds for **integer**
orders ``alpha >= 2`` only: a history with a Skellam event is composed and converted over the integer orders of
``alphas`` (``INT_ALPHAS`` if there are none), Gaussian events included (their RDP holds at every order). At
fractional orders the default run's single release read 7.999 where the integer-order bound is 8.064 (above a
budget of 8). A Skellam event without ``d2``/``d1`` (a state written before they were recorded) is charged at
``d2 = d1 = MIN_SCALE`` (32): scale 32, one layer, mass-preserving rounding, the worst case of every
``releases.stats.spec`` (both excess terms decrease in the scale and the number of layers). PRV cannot take the Skellam
law, so with ``primary = "prv"`` a history with a Skellam event uses ``max`` instead.

Must not: import ``flwr``, add noise, or keep numeric state that is not re-derivable from the events.

Why hand-written where libraries exist: opacus gives the accountants (used here) but no budget refusal,
no replayable event ledger and no Skellam; flwr's ``RdpAccountant`` has a ledger but is server-side,
client-level, RDP-only and needs ``dp-accounting``; none knows the distributed Skellam mechanism.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

# opacus calls ``logging.basicConfig`` when imported: a stderr handler on the root logger, which repeats every
# propagated log line (Flower's too: its log stream then carries each ServerApp/ClientApp line twice). Drop it.
_ROOT_HANDLERS = list(logging.getLogger().handlers)
from opacus.accountants import PRVAccountant  # noqa: E402
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent  # noqa: E402

for _h in [h for h in logging.getLogger().handlers if h not in _ROOT_HANDLERS]:
    logging.getLogger().removeHandler(_h)

__all__ = [
    "ALPHAS",
    "INT_ALPHAS",
    "Accountant",
    "BudgetExceeded",
    "PrivacyEvent",
    "epsilon_from_events",
    "noise_multiplier_for",
    "rdp_orders",
    "skellam_epsilon",
    "skellam_rdp",
]

ALPHAS: list[float] = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [128, 256, 512, 1024]
INT_ALPHAS: list[int] = list(range(2, 129)) + [256, 512, 1024]  # the Skellam bound holds at integer orders only
MECHANISMS = ("gaussian", "skellam")  # skellam: its own RDP bound at integer orders (module docstring)
SKELLAM_WORST_SENS = 32.0  # d2 = d1 of a legacy Skellam event: dp.MIN_SCALE, one layer, mass-preserving
PRIMARIES = ("max", "prv", "rdp")
EPS_ERROR = 0.01
STATE_VERSION = 1


class BudgetExceeded(RuntimeError):
    """A release was refused because it would take epsilon above the budget; nothing was composed."""

    def __init__(self, budget: float, current: float, after: float, event: PrivacyEvent | None = None):
        self.budget, self.current, self.after, self.event = budget, current, after, event
        super().__init__(f"privacy budget epsilon={budget:g} would be exceeded: current epsilon={current:.4f}, "
                         f"after this release epsilon={after:.4f} (event {event.to_dict() if event else None})")


@dataclass(frozen=True)
class PrivacyEvent:
    """One release (or ``steps`` identical releases) of a party's data."""

    noise_multiplier: float
    sample_rate: float = 1.0
    steps: int = 1
    mechanism: str = "gaussian"
    label: str = ""
    d2: float = 0.0  # skellam only: L2 / L1 sensitivity in integer units (0: the worst case, SKELLAM_WORST_SENS)
    d1: float = 0.0

    def __post_init__(self) -> None:
        if self.mechanism not in MECHANISMS:
            raise ValueError(f"mechanism must be one of {MECHANISMS}, got {self.mechanism!r}")
        for name, v in (("d2", self.d2), ("d1", self.d1)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.mechanism == "gaussian" and (self.d2 or self.d1):
            raise ValueError("d2/d1 are Skellam sensitivities; a Gaussian event is calibrated by its z alone")
        if self.mechanism == "skellam" and self.sample_rate != 1.0:
            raise ValueError("a Skellam event is a release on all local data (sample_rate 1): no subsampled bound")
        z, q = self.noise_multiplier, self.sample_rate
        if isinstance(z, bool) or not isinstance(z, (int, float)) or not (math.isfinite(z) and z > 0):
            raise ValueError(f"noise_multiplier must be a finite number > 0, got {z!r}")
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {q!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {self.steps!r}")

    def sensitivities(self) -> tuple[float, float]:
        """``(d2, d1)`` of a Skellam event, the worst case when not recorded."""
        return self.d2 or SKELLAM_WORST_SENS, self.d1 or SKELLAM_WORST_SENS

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.mechanism == "gaussian":
            del d["d2"], d["d1"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PrivacyEvent:
        unknown = set(d) - {"noise_multiplier", "sample_rate", "steps", "mechanism", "label", "d2", "d1"}
        if unknown:
            raise ValueError(f"unknown privacy event fields {sorted(unknown)}")
        return cls(noise_multiplier=float(d["noise_multiplier"]), sample_rate=float(d.get("sample_rate", 1.0)),
                   steps=int(d.get("steps", 1)), mechanism=str(d.get("mechanism", "gaussian")),
                   label=str(d.get("label", "")), d2=float(d.get("d2", 0.0)), d1=float(d.get("d1", 0.0)))

    def key(self) -> tuple[float, float, str, float, float]:
        """What composition depends on besides ``steps``."""
        return (float(self.noise_multiplier), float(self.sample_rate), self.mechanism, *(
            self.sensitivities() if self.mechanism == "skellam" else (0.0, 0.0)))


def _as_event(e: PrivacyEvent | Mapping[str, Any]) -> PrivacyEvent:
    return e if isinstance(e, PrivacyEvent) else PrivacyEvent.from_dict(e)


Merged = list[tuple[tuple[float, float, str, float, float], int]]


def _merge(events: Iterable[PrivacyEvent | Mapping[str, Any]]) -> Merged:
    """Identical events merged, ``[(key, steps)]`` (composition is commutative; PRV is faster and tighter)."""
    steps: dict[tuple[float, float, str, float, float], int] = {}
    for e in map(_as_event, events):
        steps[e.key()] = steps.get(e.key(), 0) + e.steps
    return sorted(steps.items())


def _history(merged: Merged) -> list[tuple[float, float, int]]:
    """opacus PRV history ``(z, q, steps)``: a Skellam event as its Gaussian approximation."""
    steps: dict[tuple[float, float], int] = {}
    for (z, q, *_), k in merged:
        steps[(z, q)] = steps.get((z, q), 0) + k
    return [(z, q, k) for (z, q), k in sorted(steps.items())]


def rdp_orders(skellam: bool, alphas: Sequence[float] = ALPHAS) -> list[float]:
    """The RDP orders a history may be converted at: all of ``alphas``, or with a Skellam event only the
    integer ones >= 2 (``INT_ALPHAS`` if ``alphas`` has none)."""
    if not skellam:
        return [float(a) for a in alphas]
    ints = sorted({int(a) for a in alphas if float(a) == int(a) and a >= 2})
    return [float(a) for a in (ints or INT_ALPHAS)]


def skellam_rdp(z: float, d2: float, d1: float, orders: Sequence[float]) -> np.ndarray:
    """RDP ``[A]`` of one Skellam release with std ``z * d2`` (integer units) at integer ``orders``
    (Agarwal, Kairouz, Liu 2021, Theorem 3.5); fractional orders are refused (the bound does not hold)."""
    a = np.asarray(orders, dtype=np.float64)  # [A]
    if (a != np.floor(a)).any() or (a < 2).any():
        raise ValueError("the Skellam RDP bound holds at integer orders >= 2 only")
    mu = (z * d2) ** 2
    return a * d2**2 / (2 * mu) + np.minimum(((2 * a - 1) * d2**2 + 6 * d1) / (4 * mu**2), 3 * d1 / (2 * mu))


def _check_delta(delta: float) -> None:
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")


def _eps_rdp(merged: Merged, delta: float, alphas: Sequence[float]) -> float:
    orders = rdp_orders(any(k[2] == "skellam" for k, _ in merged), alphas)
    rdp = np.zeros(len(orders))  # [A]
    for (z, q, mech, d2, d1), steps in merged:
        rdp += steps * (skellam_rdp(z, d2, d1, orders) if mech == "skellam"
                        else np.asarray(compute_rdp(q=q, noise_multiplier=z, steps=1, orders=orders)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "optimal order is the largest alpha": still a valid upper bound
        return float(get_privacy_spent(orders=orders, rdp=list(rdp), delta=delta)[0])


def _eps_prv(hist: list[tuple[float, float, int]], delta: float, eps_error: float) -> float:
    acc = PRVAccountant()
    acc.history = list(hist)
    try:
        with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            warnings.simplefilter("ignore")  # log(1 - q) = log(0) at q = 1 is handled by opacus' np.where
            return float(acc.get_epsilon(delta=delta, eps_error=eps_error))
    except Exception as exc:  # numerical domain failures: report NaN, primary falls back to RDP
        warnings.warn(f"PRV accountant failed ({exc!r}); using RDP only", RuntimeWarning, stacklevel=3)
        return math.nan


# (merged history, delta, eps_error, alphas) -> (eps_prv, eps_rdp): composition is a pure function of these, and
# a coordinator holds one accountant per party with the same history (every party charged the same releases), so
# without this a DP round costs n identical PRV compositions (~40 ms each) at the server. Derived only; bounded.
_COMPOSED: dict[tuple, tuple[float, float]] = {}
_COMPOSED_MAX = 256


def epsilon_from_events(events: Iterable[PrivacyEvent | Mapping[str, Any]], delta: float, *,
                        eps_error: float = EPS_ERROR, alphas: Sequence[float] = ALPHAS) -> tuple[float, float]:
    """``(eps_prv, eps_rdp)`` of the composition of ``events`` (dicts or events) at ``delta``; (0, 0) if none.
    ``eps_rdp`` is backed for every mechanism; ``eps_prv`` takes a Skellam event as its Gaussian approximation.
    Memoised per process on the merged history (``_COMPOSED``): identical histories are composed once."""
    _check_delta(delta)
    merged = _merge(events)
    if not merged:
        return 0.0, 0.0
    key = (tuple(merged), float(delta), float(eps_error), tuple(float(a) for a in alphas))
    hit = _COMPOSED.get(key)
    if hit is not None:
        return hit
    eps = _eps_prv(_history(merged), delta, eps_error), _eps_rdp(merged, delta, alphas)
    if not math.isnan(eps[0]):  # a failed PRV (NaN, warned) is recomputed, so it warns again
        if len(_COMPOSED) >= _COMPOSED_MAX:
            _COMPOSED.clear()
        _COMPOSED[key] = eps
    return eps


def _primary(eps: tuple[float, float], primary: str, skellam: bool = False) -> float:
    prv, rdp = eps
    if primary == "rdp" or math.isnan(prv):
        return rdp
    return prv if primary == "prv" and not skellam else max(prv, rdp)


def _has_skellam(events: Iterable[PrivacyEvent]) -> bool:
    return any(e.mechanism == "skellam" for e in events)


class Accountant:
    """One party's privacy ledger at fixed ``delta`` with an epsilon budget (see the module docstring)."""

    def __init__(self, delta: float, epsilon_budget: float, *, primary: str = "max", eps_error: float = EPS_ERROR,
                 alphas: Sequence[float] = ALPHAS):
        _check_delta(delta)
        if not (math.isfinite(epsilon_budget) and epsilon_budget > 0):
            raise ValueError(f"epsilon_budget must be a finite number > 0, got {epsilon_budget!r}")
        if primary not in PRIMARIES:
            raise ValueError(f"primary must be one of {PRIMARIES}, got {primary!r}")
        self.delta, self.epsilon_budget, self.primary = float(delta), float(epsilon_budget), primary
        self.eps_error, self.alphas = float(eps_error), list(alphas)
        self._events: list[PrivacyEvent] = []
        self._cache: dict[tuple[PrivacyEvent, ...], tuple[float, float]] = {}  # derived only; never persisted

    @property
    def events(self) -> tuple[PrivacyEvent, ...]:
        return tuple(self._events)

    def _eps(self, events: Sequence[PrivacyEvent]) -> tuple[float, float]:
        key = tuple(events)
        if key not in self._cache:
            if len(self._cache) > 8:
                self._cache.clear()
            self._cache[key] = epsilon_from_events(key, self.delta, eps_error=self.eps_error, alphas=self.alphas)
        return self._cache[key]

    def epsilon(self) -> tuple[float, float]:
        """``(eps_prv, eps_rdp)`` spent so far; the budget applies to :meth:`primary_epsilon`."""
        return self._eps(self._events)

    def primary_epsilon(self) -> float:
        return _primary(self.epsilon(), self.primary, _has_skellam(self._events))

    def epsilon_after(self, event: PrivacyEvent | Mapping[str, Any]) -> float:
        """Primary epsilon if ``event`` were composed (a dry run; state unchanged)."""
        evs = [*self._events, _as_event(event)]
        return _primary(self._eps(evs), self.primary, _has_skellam(evs))

    def would_exceed(self, event: PrivacyEvent | Mapping[str, Any]) -> bool:
        return self.epsilon_after(event) > self.epsilon_budget

    def spend(self, event: PrivacyEvent | Mapping[str, Any]) -> float:
        """Compose ``event`` and return the new primary epsilon, or raise :class:`BudgetExceeded` first."""
        ev = _as_event(event)
        after = self.epsilon_after(ev)
        if not after <= self.epsilon_budget:  # also refuses NaN
            raise BudgetExceeded(self.epsilon_budget, self.primary_epsilon(), after, ev)
        self._events.append(ev)
        return after

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: parameters and the event list (no derived numbers)."""
        return {"version": STATE_VERSION, "delta": self.delta, "epsilon_budget": self.epsilon_budget,
                "primary": self.primary, "eps_error": self.eps_error, "alphas": list(self.alphas),
                "events": [e.to_dict() for e in self._events]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported accountant state version {state.get('version')!r}")
        events = [PrivacyEvent.from_dict(e) for e in state["events"]]  # validate all before replacing
        fresh = Accountant(state["delta"], state["epsilon_budget"], primary=state.get("primary", "max"),
                           eps_error=state.get("eps_error", EPS_ERROR), alphas=state.get("alphas", ALPHAS))
        self.delta, self.epsilon_budget, self.primary = fresh.delta, fresh.epsilon_budget, fresh.primary
        self.eps_error, self.alphas = fresh.eps_error, fresh.alphas
        self._events, self._cache = events, {}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> Accountant:
        acc = cls(state["delta"], state["epsilon_budget"])
        acc.load_state_dict(state)
        return acc

    def __repr__(self) -> str:
        return f"Accountant(delta={self.delta:g}, budget={self.epsilon_budget:g}, events={len(self._events)})"


def noise_multiplier_for(target_eps: float, delta: float, releases: int, *, sample_rate: float = 1.0,
                         primary: str = "max", rtol: float = 1e-3, eps_error: float = EPS_ERROR,
                         alphas: Sequence[float] = ALPHAS, mechanism: str = "gaussian", d2: float = 0.0,
                         d1: float = 0.0, others: Sequence[PrivacyEvent] = ()) -> float:
    """Smallest ``z`` (to relative ``rtol``) whose ``releases`` compositions at ``sample_rate`` (a ``mechanism``
    event, Skellam with sensitivities ``d2``/``d1``), composed with the fixed events ``others``, give primary
    epsilon <= ``target_eps``: geometric bisection on z, epsilon being decreasing in z."""
    _check_delta(delta)
    if not target_eps > 0 or releases < 1:
        raise ValueError("need target_eps > 0 and releases >= 1")
    if primary not in PRIMARIES:
        raise ValueError(f"primary must be one of {PRIMARIES}, got {primary!r}")

    def eps(z: float) -> float:
        evs = [PrivacyEvent(z, sample_rate, releases, mechanism, d2=d2, d1=d1), *others]
        return _primary(epsilon_from_events(evs, delta, eps_error=eps_error, alphas=alphas), primary,
                        _has_skellam(evs))

    if others and eps(1e7) > target_eps:
        raise ValueError(f"the fixed releases alone spend epsilon above {target_eps}")

    # Gaussian start: eps ~ sqrt(2 R ln(1/delta)) / z, bracket around it.
    z0 = math.sqrt(2.0 * releases * math.log(1.0 / delta)) / target_eps * max(sample_rate, 1e-3)
    lo, hi = z0 / 2.0, z0 * 2.0
    while eps(hi) > target_eps:
        lo, hi = hi, hi * 2.0
        if hi > 1e7:
            raise ValueError(f"no noise multiplier reaches epsilon={target_eps} in {releases} releases")
    while lo > 1e-3 and eps(lo) <= target_eps:
        lo, hi = lo / 2.0, lo
    while hi / lo > 1.0 + rtol:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if eps(mid) > target_eps else (lo, mid)
    return hi


def skellam_epsilon(mu: float, delta2: float, delta1: float, releases: int, delta: float,
                    alphas: Sequence[float] = ALPHAS) -> float:
    """Epsilon of ``releases`` Skellam releases of aggregate variance ``mu`` (integer units) via its RDP bound
    ``alpha D2^2/(2mu) + min(((2alpha-1) D2^2 + 6 D1)/(4 mu^2), 3 D1/(2 mu))`` (Agarwal, Kairouz, Liu 2021),
    converted over the integer orders of ``alphas`` only (:func:`rdp_orders`): the bound holds at no other."""
    _check_delta(delta)
    orders = rdp_orders(True, alphas)
    rdp = skellam_rdp(math.sqrt(mu) / delta2, delta2, delta1, orders) * releases  # [A]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eps, _ = get_privacy_spent(orders=orders, rdp=list(rdp), delta=delta)
    return float(eps)
