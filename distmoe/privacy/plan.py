"""The privacy plan of a run: how many releases each party's data goes into, and the noise they need.

Owns: counting the DP releases in a schedule (one router-statistics release per ``stats`` round, one
update release per ``sft``/``rl`` round when ``privacy.update-noise-multiplier > 0``, one evaluation release
per ``eval`` round under secure aggregation, ``distmoe.privacy.metric_noise``), deriving the
router-statistics noise multiplier from the budget when ``privacy.noise-multiplier = 0`` (the smallest
``z`` whose composition with the planned update releases stays within ``privacy.epsilon`` at
``privacy.delta``), and the secure-aggregation threshold for ``n`` parties. Each release's own calibration for
``n`` parties and threshold ``t`` and its ledger event are its release module's (``distmoe.privacy.releases``).

Same events as the parties charge. The plan's router-statistics events are Skellam events accounted by
their own RDP bound at integer orders (``distmoe.privacy.accountant``) with the sensitivities of one layer
at ``privacy.scale`` (the plan does not know the model; one layer is the worst case of the bound's excess
term, so a party's actual charge is at most the planned one), and its update events are charged at the
sequence level, ``z_u / 2`` (``distmoe.privacy.update_noise``). Its evaluation events are Skellam events at
``privacy.metric-noise-multiplier`` with the sensitivities of one held-out sequence (``eval_sensitivity``).

Dropouts: every share is over-provisioned for the worst survivor set the protocol allows (``t``
parties: ``max_dropouts = n - t``), so ``z_eff >= z`` for any round that completes, and a party can
account each release at ``z`` before it sends anything. The audit recomputes ``z_eff`` from the
survivors actually present (never below ``z``).

Must not: import ``flwr`` or ``torch``, or read party data (only public configuration).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache

from distmoe.config import UPDATE_KINDS, ConfigError, PrivacyConfig, ScheduleConfig
from distmoe.privacy.accountant import PrivacyEvent, epsilon_from_events, noise_multiplier_for
from distmoe.privacy.dp import int_sensitivity
from distmoe.privacy.metric_noise import eval_sensitivity
from distmoe.privacy.secagg.graph import graph_threshold
from distmoe.privacy.update_noise import sequence_noise_multiplier


@dataclass(frozen=True)
class PrivacyPlan:
    mode: str
    epsilon: float
    delta: float
    noise_multiplier: float  # router statistics (0 when the schedule has no stats round)
    derived: bool  # noise_multiplier derived from the budget
    update_noise_multiplier: float  # 0 = no DP on updates (party level: noise std over the clip)
    stats_releases: int
    update_releases: int
    planned_epsilon: float  # epsilon of all planned releases, unit one sequence (max of PRV, integer-order RDP)
    scale: float = 64.0  # privacy.scale: the Skellam events' sensitivities (one layer, see the module docstring)
    metric_noise_multiplier: float = 0.0  # z_m of the evaluation releases (0 when none are planned)
    eval_releases: int = 0

    def as_dict(self) -> dict:
        return asdict(self)

    def events(self) -> list[PrivacyEvent]:
        ev = []
        if self.stats_releases and self.noise_multiplier > 0:
            ev.append(_stats_events(self.noise_multiplier, self.stats_releases, self.scale))
        if self.update_releases and self.update_noise_multiplier > 0:
            ev.append(_update_events(self.update_noise_multiplier, self.update_releases))
        if self.eval_releases and self.metric_noise_multiplier > 0:
            ev.append(_eval_events(self.metric_noise_multiplier, self.eval_releases))
        return ev


def _stats_events(z: float, releases: int, scale: float) -> PrivacyEvent:
    d2, d1 = int_sensitivity(1, 1, scale, "mass-preserving")
    return PrivacyEvent(z, 1.0, releases, "skellam", "router-stats", d2=d2, d1=d1)


def _update_events(z_u: float, releases: int) -> PrivacyEvent:
    return PrivacyEvent(sequence_noise_multiplier(z_u), 1.0, releases, "gaussian", "model-update")


def _eval_events(z_m: float, releases: int) -> PrivacyEvent:
    d2, d1 = eval_sensitivity()
    return PrivacyEvent(z_m, 1.0, releases, "skellam", "eval", d2=d2, d1=d1)


def count_releases(p: PrivacyConfig, schedule: ScheduleConfig) -> tuple[int, int, int]:
    """``(stats, updates, evals)``: the DP releases of the schedule (evaluations only under secure aggregation)."""
    stats = sum(ph.rounds for ph in schedule.phases if ph.kind == "stats")
    updates = sum(ph.rounds for ph in schedule.phases if ph.kind in UPDATE_KINDS) if p.update_noise_multiplier > 0 \
        else 0  # sft, rl and dpo rounds each release one model update
    evals = sum(ph.rounds for ph in schedule.phases if ph.kind == "eval") if p.secure else 0
    return stats, updates, evals


def _eps(events: list[PrivacyEvent], delta: float) -> float:
    if not events:
        return 0.0
    prv, rdp = epsilon_from_events(events, delta)
    return max(rdp, prv) if math.isfinite(prv) else rdp


@lru_cache(maxsize=32)
def _plan(p: PrivacyConfig, schedule: ScheduleConfig) -> PrivacyPlan:
    n_stats, n_upd, n_eval = count_releases(p, schedule)
    upd = [_update_events(p.update_noise_multiplier, n_upd)] if n_upd else []
    upd += [_eval_events(p.metric_noise_multiplier, n_eval)] if n_eval else []
    z = p.noise_multiplier
    derived = False
    if n_stats and z == 0:
        derived = True
        if upd and _eps(upd, p.delta) >= p.epsilon:
            raise ConfigError(f"config key 'privacy.update-noise-multiplier': value {p.update_noise_multiplier:g} "
                              f"and privacy.metric-noise-multiplier {p.metric_noise_multiplier:g} "
                              f"alone spend epsilon {_eps(upd, p.delta):.3f} over {n_upd} update releases (one "
                              f"sequence moves a clipped update by 2 clips: z_u/2 = "
                              f"{sequence_noise_multiplier(p.update_noise_multiplier):g} per sequence) and {n_eval} "
                              f"evaluation releases, at or above "
                              f"privacy.epsilon = {p.epsilon:g}: nothing is left for router statistics")
        d2, d1 = int_sensitivity(1, 1, p.scale, "mass-preserving")
        z = noise_multiplier_for(p.epsilon, p.delta, n_stats, mechanism="skellam", d2=d2, d1=d1, others=upd)
    plan = PrivacyPlan(p.mode, p.epsilon, p.delta, z if n_stats else 0.0, derived, p.update_noise_multiplier,
                       n_stats, n_upd, 0.0, float(p.scale), p.metric_noise_multiplier if n_eval else 0.0, n_eval)
    eps = _eps(plan.events(), p.delta)
    if eps > p.epsilon * (1 + 1e-9):
        # the keys whose releases the schedule has: a run without stats rounds is not told to derive their noise
        keys = [k for k, n in (("privacy.noise-multiplier", n_stats and not derived),
                               ("privacy.update-noise-multiplier", n_upd), ("privacy.metric-noise-multiplier", n_eval))
                if n] or ["privacy.noise-multiplier"]
        derive = ", or set privacy.noise-multiplier = 0 to derive it" if n_stats and not derived else ""
        raise ConfigError(f"config key '{keys[0]}': the planned releases ({n_stats} router-statistics"
                          f" at z = {z:g}, {n_upd} updates at z_u = {p.update_noise_multiplier:g}, z_u/2 per "
                          f"sequence, {n_eval} evaluations at z_m = {p.metric_noise_multiplier:g}) spend epsilon "
                          f"{eps:.3f} > privacy.epsilon = {p.epsilon:g}; raise {' or '.join(keys)} or "
                          f"privacy.epsilon, or plan fewer of these rounds{derive}")
    return PrivacyPlan(**{**plan.as_dict(), "planned_epsilon": eps})


def plan_privacy(p: PrivacyConfig, schedule: ScheduleConfig) -> PrivacyPlan:
    """The run's plan (cached: deriving z runs the PRV accountant a few dozen times, ~1 s)."""
    return _plan(p, schedule)


def threshold_for(n_parties: int, min_parties: int, graph: str = "complete") -> int:
    """SecAgg threshold: a strict majority of each party's share holders (so two disjoint sets cannot both
    reconstruct; all n parties with the complete graph, k + 1 with ``privacy.secagg-graph = "harary"``, see
    ``secagg.graph.graph_threshold``) and at least ``privacy.min-parties`` (every release is a sum over at
    least that many parties)."""
    return graph_threshold(graph, n_parties, min_parties)
