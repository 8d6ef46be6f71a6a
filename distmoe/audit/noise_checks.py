"""The audit's checks of the noise in each router-statistics release, from the coordinator's release entries.

Owns: ``noise-presence`` (the K canaries carry the recorded noise: ``Σc²/σ² ~ χ²_K``, one-sided at
``ALPHA / R``), ``row-sums`` (the L row sums estimate one count: upper tail at ``ROW_SUM_ALPHA / R``),
``row-noise`` and ``canary-positions`` (their statistics: :mod:`distmoe.audit.noise`). Family-wise false-alarm
levels (Bonferroni over a run's R router-stats releases): the noise is fresh OS randomness, so an honest run
fails with about this probability, small enough not to cry wolf across many audited runs and still powerful
(K = 2048 canaries caught one of 6 noise shares missing in 40 of 40 rounds at 1e-4; an inconsistently weighted
layer is off by thousands of sigma).

Must not: import ``flwr``, read anything but the loaded run, or write anything.
"""

from __future__ import annotations

import math
from typing import Any

from scipy import stats as _st

from distmoe.audit import noise
from distmoe.audit.epsilon import sigma_of
from distmoe.audit.result import Check
from distmoe.audit.run import COORDINATOR, Run, info_of, loc
from distmoe.privacy.dp import canary_chi2_test

ALPHA = 1e-4  # noise-presence
ROW_SUM_ALPHA = 1e-6  # row-sums (upper tail)


def check_noise(run: Run, figs: dict[int, dict[str, Any]]) -> Check:
    c = Check("noise-presence")
    rels = run.stats_releases
    if not rels:
        c.skip("no router-stats releases")
        return c
    alpha = ALPHA / len(rels)
    tested = 0
    for r in rels:
        w = loc(COORDINATOR, r)
        if not isinstance(r.get("dp"), dict):
            c.fail(f"{w}: router statistics released without DP noise (dp is null)")
            continue
        got = sigma_of(r, c)
        canary = info_of(r).get("canary")
        if got is None or not isinstance(canary, dict):
            if got is not None:
                c.fail(f"{w}: no canary record")
            continue
        sigma = got[0]
        values = canary.get("values") if isinstance(canary.get("values"), list) else []
        k = canary.get("k")
        if k != len(values):
            c.fail(f"{w}: canary.k = {k!r} but {len(values)} values recorded")
        if r["dp"].get("n_canaries") not in (None, k):
            c.fail(f"{w}: dp.n_canaries = {r['dp'].get('n_canaries')!r} but canary.k = {k!r}")
        if not values:
            c.note(f"{w}: no canaries (k = 0): not tested")
            continue
        try:
            t = canary_chi2_test([float(v) for v in values], sigma, alpha)
        except (TypeError, ValueError) as exc:
            c.fail(f"{w}: canary values unusable ({exc})")
            continue
        tested += 1
        figs.setdefault(r["seq"], {}).update({"sigma_int": sigma, "canaries": len(values),
                                              "sigma_ratio": t.sigma_ratio, "noise_p": t.p_low})
        msg = f"{w}: sigma_hat/sigma = {t.sigma_ratio:.3f}, p = {t.p_low:.3g} (alpha {alpha:.2g}, K = {len(values)})"
        if t.passed:
            c.note(msg)
        else:
            c.fail(msg + ": noise missing")
    if tested == 0 and c.status != "fail":
        c.skip("no release carries canaries")
    return c


def check_row_sums(run: Run, figs: dict[int, dict[str, Any]]) -> Check:
    c = Check("row-sums")
    tested = 0
    alpha = ROW_SUM_ALPHA / max(len(run.stats_releases), 1)
    for r in run.stats_releases:
        w = loc(COORDINATOR, r)
        if not isinstance(r.get("dp"), dict):
            c.note(f"{w}: no DP parameters (see noise-presence): not tested")
            continue
        got = sigma_of(r, Check("scratch"))
        if got is None:
            c.fail(f"{w}: noise scale cannot be recomputed")
            continue
        sigma, layers, experts = got
        rs = info_of(r).get("row_sums")
        if not isinstance(rs, list) or len(rs) != layers:
            c.fail(f"{w}: row_sums missing or not {layers} values")
            continue
        if layers < 2:
            c.note(f"{w}: one layer: nothing to compare")
            continue
        try:
            v = [float(x) for x in rs]
        except (TypeError, ValueError):
            c.fail(f"{w}: row_sums not numeric")
            continue
        mean = sum(v) / layers
        # Each row is N*s plus the sum of E noise coordinates, plus rounding error: none with mass-preserving
        # rounding (every sequence's row sums to s exactly); with per-sequence rounding about E/12 per
        # sequence (N estimated from the rows); with a rounded float sum E/12 in all.
        rounding = str(r["dp"].get("rounding", "per-sequence"))
        scale = float(r["dp"].get("scale", 1.0) or 1.0)
        n_hat = max(mean / scale, 0.0)
        extra = {"mass-preserving": 0.0, "sum": experts / 12.0}.get(rounding, n_hat * experts / 12.0)
        stat = sum((x - mean) ** 2 for x in v) / (experts * sigma**2 + extra)
        # one-sided: rows that disagree more than the noise allows mean inconsistent weighting. Too little
        # dispersion is not tested here (row sums are integers, so equal rows happen; missing noise is what
        # noise-presence tests on the canaries).
        p = float(_st.chi2.sf(stat, layers - 1))
        tested += 1
        figs.setdefault(r["seq"], {}).update({"row_sum_stat": stat, "row_sum_p": p})
        msg = f"{w}: dispersion {stat:.3g} on {layers - 1} dof, p = {p:.3g}"
        if p < alpha:
            c.fail(msg + f" < {alpha:.2g}: rows do not estimate one count")
        else:
            c.note(msg)
    if tested == 0 and c.status != "fail":
        c.skip("no router-stats release to test")
    return c


def check_row_noise(run: Run, figs: dict[int, dict[str, Any]]) -> Check:
    c = Check(noise.ROW_NOISE)
    rels = []
    for r in run.stats_releases:
        got = sigma_of(r, Check("scratch")) if isinstance(r.get("dp"), dict) else None
        rs = info_of(r).get("row_sums")
        if got is None or not isinstance(rs, list) or len(rs) != got[1]:
            continue  # noise-presence / row-sums report a release without usable parameters or row sums
        if str(r["dp"].get("rounding", "per-sequence")) != "mass-preserving":
            c.note(f"{loc(COORDINATOR, r)}: rounding {r['dp'].get('rounding')!r}: rows also carry rounding error "
                   "(the test stays valid, with less power)")
        rels.append((loc(COORDINATOR, r), r["seq"], rs, math.sqrt(got[2]) * got[0]))
    findings, notes, per = noise.check_row_noise(rels)
    for seq, f in per.items():
        figs.setdefault(seq, {}).update(f)
    for m in notes:
        c.note(m)
    for m in findings:
        c.fail(m)
    if not rels and c.status != "fail":
        c.skip("no router-stats release with row sums to test")
    return c


def check_positions(run: Run) -> Check:
    c = Check(noise.POSITIONS)
    findings, notes = noise.check_canary_positions(run.stats_releases, {n: lf.entries for n, lf in run.parties.items()})
    for m in notes:
        c.note(m)
    for m in findings:
        c.fail(m)
    if not run.stats_releases:
        c.skip("no router-stats releases")
    return c
