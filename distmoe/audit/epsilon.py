"""The audit's ``epsilon`` check: each party's epsilon recomputed from the coordinator's release entries.

Owns: ``z_eff`` (``z * sqrt(n_active / (n - d_max))`` recomputed from a release's survivors and checked against
what it claims), the per-sequence event of each DP release (an update at ``z_eff / 2``: one sequence moves a
clipped update by two clips; an evaluation release at one held-out sequence's sensitivities; router statistics
by the Skellam bound at integer orders), the DP-update facts (uniform weights, metrics withheld, sensitivity =
clip), ``sigma_of`` (a router-statistics release's recomputed noise std, shared with the noise checks), and the
per-party table (the server accountant's own figure only beside it, for comparison).

Must not: import ``flwr``, read anything but the loaded run, or write anything.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

from distmoe.audit.result import Check
from distmoe.audit.run import COORDINATOR, Run, close_to, included_of, info_of, loc
from distmoe.privacy.accountant import MECHANISMS, PrivacyEvent, epsilon_from_events
from distmoe.privacy.dp import int_sensitivity
from distmoe.privacy.metric_noise import eval_sensitivity
from distmoe.privacy.update_noise import sequence_noise_multiplier


def z_eff(rel: Mapping[str, Any], c: Check | None) -> float | None:
    """``z * sqrt(n_active / (n - d_max))`` recomputed from the release; disagreements fail ``c``."""
    dp = rel.get("dp")
    w = loc(COORDINATOR, rel)
    if not isinstance(dp, dict):
        return None
    try:
        z, n, dmax = float(dp["noise_multiplier"]), int(dp["n_parties"]), int(dp.get("max_dropouts", 0))
    except (KeyError, TypeError, ValueError):
        if c is not None:
            c.fail(f"{w}: dp parameters incomplete (need noise_multiplier, n_parties, max_dropouts)")
        return None
    n_active = len(included_of(rel))
    if c is not None and dp.get("n_active") != n_active:
        c.fail(f"{w}: dp.n_active = {dp.get('n_active')!r} but {n_active} parties are included")
    if n - dmax <= 0 or not (math.isfinite(z) and z > 0):
        if c is not None:
            c.fail(f"{w}: invalid dp parameters (z={z}, n_parties={n}, max_dropouts={dmax})")
        return None
    ze = z * math.sqrt(n_active / (n - dmax))
    if c is not None and ("z_eff" in dp or rel.get("payload_type") == "release:router-stats"):
        if not close_to(dp.get("z_eff"), ze):
            c.fail(f"{w}: dp.z_eff = {dp.get('z_eff')!r}, recomputed {ze:.6g} from {n_active} survivors")
    return ze


Ev = tuple[float, float, int, str, float, float]  # (z, q, steps, mechanism, d2, d1)


@functools.lru_cache(maxsize=256)
def _eps(events: tuple[Ev, ...], delta: float) -> tuple[float, float]:
    """``(eps_prv, eps_rdp)`` of ``(z, q, steps, mechanism, d2, d1)`` events (cached: parties often share a
    history); Skellam by its integer-order RDP bound (``distmoe.privacy.accountant``)."""
    return epsilon_from_events([PrivacyEvent(z, q, k, m, d2=d2, d1=d1) for z, q, k, m, d2, d1 in events], delta)


def _release_event(rel: Mapping[str, Any], ze: float, mech: str, c: Check) -> Ev:
    """The per-sequence ledger event of a DP release, recomputed: a Gaussian (update) release at ``z_eff / 2``
    (one sequence moves a clipped update by 2 clips; a ledger figure that says otherwise fails ``c``), a
    Skellam evaluation release at the sensitivities of one held-out sequence (``metric_noise``), a Skellam
    router-statistics release with the sensitivities of its recorded shape (the worst case if they cannot be
    computed)."""
    dp, w = rel["dp"], loc(COORDINATOR, rel)
    if mech == "gaussian":
        zs = sequence_noise_multiplier(ze)
        if "z_sequence" in dp and not close_to(dp.get("z_sequence"), zs):
            c.fail(f"{w}: dp.z_sequence = {dp.get('z_sequence')!r}, recomputed {zs:.6g} (z_eff / 2: one sequence "
                   "moves a clipped update by 2 clips)")
        return zs, 1.0, 1, mech, 0.0, 0.0
    if rel.get("payload_type") == "release:eval":  # one held-out sequence: three coordinates of <= s
        try:
            d2, d1 = eval_sensitivity(float(dp["scale"]))
        except (KeyError, TypeError, ValueError):
            c.fail(f"{w}: evaluation release without its integer scale (dp.scale)")
            d2 = d1 = 0.0
        for k, v in (("delta2_int", d2), ("delta1_int", d1)):
            if d2 and not close_to(dp.get(k), v):
                c.fail(f"{w}: dp.{k} = {dp.get(k)!r}, recomputed {v:.6g} (one held-out sequence, scale "
                       f"{dp.get('scale')!r})")
        return ze, 1.0, 1, mech, d2, d1
    info = info_of(rel)
    try:
        d2, d1 = int_sensitivity(int(info["layers"]), int(info["experts"]), float(dp["scale"]),
                                 str(dp.get("rounding", "per-sequence")))
    except (KeyError, TypeError, ValueError):
        d2 = d1 = 0.0  # PrivacyEvent's worst case; noise-presence names the missing shape
    return ze, 1.0, 1, mech, d2, d1


def primary(prv: float, rdp: float) -> float:
    return rdp if math.isnan(prv) else max(prv, rdp)


def _check_update_dp(rel: Mapping[str, Any], c: Check) -> None:
    """A DP model update is covered by its noise only if nothing data-dependent travels beside the noised
    block: uniform weights (so the released weight sum is the included-party count), metrics withheld or inside
    the noised block (``"in-noised-block"``: the training-metric slots, at the same sensitivity), and the
    sensitivity the noise was calibrated to equal to the clip."""
    dp, info, w = rel["dp"], info_of(rel), loc(COORDINATOR, rel)
    n_inc = len(included_of(rel))
    if dp.get("weights") != "uniform" or dp.get("metrics") not in ("withheld", "in-noised-block"):
        c.fail(f"{w}: DP update with weights {dp.get('weights')!r} and metrics {dp.get('metrics')!r}: the weight "
               "sum and metrics are released exact beside the noise")
    elif not (close_to(dp.get("sensitivity"), float(dp.get("clip", math.nan)))):
        c.fail(f"{w}: DP update noise calibrated to sensitivity {dp.get('sensitivity')!r}, clip {dp.get('clip')!r}")
    elif not close_to(info.get("weight_sum"), float(n_inc)):
        c.fail(f"{w}: released weight sum {info.get('weight_sum')!r} != {n_inc} included parties (uniform weights)")


def check_epsilon(run: Run) -> tuple[Check, dict[str, dict[str, Any]]]:
    c = Check("epsilon")
    budget, delta = run.setting("epsilon", c), run.setting("delta", c)
    nmax = run.setting("num-sequences-max", c)
    if not isinstance(budget, (int, float)) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
        c.fail(f"privacy.epsilon / privacy.delta not recorded or invalid ({budget!r}, {delta!r})")
        return c, {}
    if isinstance(nmax, int) and nmax > 0:
        if delta > 1.0 / nmax:
            c.fail(f"delta {delta:g} > 1/num-sequences-max = {1.0 / nmax:g}")
        else:
            c.note(f"delta {delta:g} <= 1/num-sequences-max = {1.0 / nmax:g}")
    else:
        c.fail(f"privacy.num-sequences-max not recorded or invalid ({nmax!r}): delta <= 1/N cannot be checked")
    events: dict[str, list[Ev]] = {}
    for r in run.releases:
        dp = r.get("dp")
        if dp is None:
            if r.get("payload_type") == "release:eval" and info_of(r).get("mode") == "secagg":
                c.fail(f"{loc(COORDINATOR, r)}: evaluation figures released without DP noise (dp is null): a "
                       "straggle would difference one party's counts and losses out of two such sums")
            continue
        ze = z_eff(r, c)
        mech = dp.get("mechanism") if isinstance(dp, dict) else None
        if mech not in MECHANISMS:
            c.fail(f"{loc(COORDINATOR, r)}: unknown DP mechanism {mech!r}")
            continue
        if ze is None or ze <= 0:
            continue
        if r.get("payload_type") in ("release:model-update", "release:rl-update"):
            _check_update_dp(r, c)
        ev = _release_event(r, ze, mech, c)
        for p in included_of(r):
            events.setdefault(p, []).append(ev)
    server = run.server_privacy.get("parties", {}) if isinstance(run.server_privacy, dict) else {}
    table: dict[str, dict[str, Any]] = {}
    for p in run.all_parties():
        evs = tuple(sorted(events.get(p, [])))
        prv, rdp = _eps(evs, float(delta))
        eps = primary(prv, rdp)
        row: dict[str, Any] = {"releases": len(evs), "eps_prv": prv, "eps_rdp": rdp, "epsilon": eps,
                               "budget": budget, "delta": delta, "server_epsilon": None, "server_events": None}
        st = server.get(p) if isinstance(server, dict) else None
        if isinstance(st, dict) and isinstance(st.get("events"), list):
            try:  # the server's accountant replayed from its own event list (informational)
                evs_s = [PrivacyEvent.from_dict(x) for x in st["events"]]
                sev = tuple(sorted((e.noise_multiplier, e.sample_rate, e.steps, e.mechanism, e.d2, e.d1)
                                   for e in evs_s))
                row["server_epsilon"] = primary(*_eps(sev, float(st.get("delta", delta))))
                row["server_events"] = len(evs_s)
            except (KeyError, TypeError, ValueError):
                c.note(f"{p}: the server's accountant state is unreadable (informational only)")
        row["status"] = "pass" if eps <= budget else "fail"
        if eps > budget:
            c.fail(f"{p}: epsilon {eps:.4f} (PRV {prv:.4f}, RDP {rdp:.4f}) over {len(evs)} releases exceeds the "
                   f"budget {budget:g} at delta {delta:g}")
        else:
            c.note(f"{p}: epsilon {eps:.4f} <= {budget:g} over {len(evs)} DP releases")
        if row["server_events"] is not None and row["server_events"] != len(evs):
            c.note(f"{p}: the server's accountant holds {row['server_events']} events, the ledger {len(evs)} "
                   "DP releases (informational)")
        table[p] = row
    return c, table


def sigma_of(rel: Mapping[str, Any], c: Check) -> tuple[float, int, int] | None:
    """``(sigma_int, L, E)`` of a router-stats release, recomputed; disagreements with the ledger fail ``c``."""
    dp, info, w = rel.get("dp"), info_of(rel), loc(COORDINATOR, rel)
    try:
        layers, experts = int(info["layers"]), int(info["experts"])
        d2 = int_sensitivity(layers, experts, float(dp["scale"]), str(dp.get("rounding", "per-sequence")))[0]
    except (KeyError, TypeError, ValueError) as exc:
        c.fail(f"{w}: cannot recompute the sensitivity ({exc})")
        return None
    if not close_to(dp.get("delta2_int"), d2):
        c.fail(f"{w}: dp.delta2_int = {dp.get('delta2_int')!r}, recomputed {d2:.6g}")
    ze = z_eff(rel, None)
    if ze is None or ze <= 0:
        c.fail(f"{w}: no noise multiplier for the survivors ({len(included_of(rel))} included)")
        return None
    sigma = ze * d2
    if "sigma_int" in dp and not close_to(dp.get("sigma_int"), sigma):
        c.fail(f"{w}: dp.sigma_int = {dp.get('sigma_int')!r}, recomputed {sigma:.6g}")
    return sigma, layers, experts
