"""The audit's ``row-noise`` and ``canary-positions`` checks: noise in the router statistic itself, and canaries
where the round's public material puts them.

Owns: ``check_row_noise(releases) -> (findings, notes, figures)`` and ``check_canary_positions(releases,
parties) -> (findings, notes)`` (``distmoe.audit.engine`` turns them into checks). The canary test
(``noise-presence``) only sees the ``K`` canary coordinates; a party that puts its noise share there only passes
it. ``row-noise`` tests the statistic's own noise: with mass-preserving rounding every row sum is ``N*s`` plus
the sum of ``E`` noise coordinates, so the row sums of one release differ by noise only, of variance
``tau^2 = E * sigma_int^2`` each (``sigma_int`` recomputed from the release's DP parameters). The statistic is
``distmoe.privacy.dp.row_noise_test``: ``T = sum_r sum_l (R_rl - mean_r)^2 / tau_r^2 ~ chi2(sum_r (L_r - 1))``,
lower tail with a lattice correction for integer row sums. It fails when

- pooled over all router-statistics releases of the run, ``P[chi2_D <= (sqrt(T) + c)^2] < ALPHA / 2``, or
- one release alone has ``p < ALPHA / (2 R)`` (e.g. all its row sums exactly equal: ``T = 0``),

so an honest run fails with probability at most ``ALPHA = 1e-6`` (Bonferroni; the noise is fresh OS randomness).
Power: ``docs/privacy.md`` §4.2 (all parties canary-only, ``T = 0``: fails whenever ``P[chi2_D <= c^2] < ALPHA / 2``,
e.g. any release of >= 4 layers at the default scale and z >= 0.5; one of n parties: ``dp.row_noise_power``).

``canary-positions`` recomputes each release's seed from the recorded public material (SecAgg run id, round,
U1 mask keys: ``dp.canary_seed``), the positions from the seed (``dp.canary_positions``) and compares their
digest with the one recorded; every included party whose ledger is given must have recorded the same seed in its
own signed entry for that masked input (a party that built its vector with other positions, or a coordinator
that showed parties different U1 lists, shows here). Seeds must differ between releases.

What they cannot see: a party that knows these tests and puts noise of the right variance on the canaries and
along each row's sum only (1 of the ``E`` directions per row) passes both; code pinning (``docs/privacy.md``
§8) is what stops a modified party.

Must not: import ``flwr``, read anything but the ledger entries and figures it is given, or write anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from distmoe.privacy.dp import canary_positions, canary_seed, positions_digest, row_noise_test

ROW_NOISE = "row-noise"
POSITIONS = "canary-positions"
ALPHA = 1e-6  # family-wise false-alarm probability of row-noise per honest run
MASKED_STATS = "masked-input:router-stats"


def check_row_noise(
    releases: Sequence[tuple[str, int, Sequence[Any], float]],
) -> tuple[list[str], list[str], dict[int, dict[str, float]]]:
    """``releases``: per router-statistics release ``(where, seq, row_sums, tau)``, ``tau = sqrt(E) * sigma_int``
    recomputed by the caller. Returns findings, notes and per-release figures keyed by ledger ``seq``."""
    findings: list[str] = []
    notes: list[str] = []
    figs: dict[int, dict[str, float]] = {}
    usable: list[tuple[list[float], float]] = []
    tested = [r for r in releases if len(r[2]) >= 2]
    alpha_one = ALPHA / 2 / max(len(tested), 1)
    for where, seq, rows, tau in tested:
        try:
            v = [float(x) for x in rows]
            t = row_noise_test([(v, tau)], alpha_one)
        except (TypeError, ValueError) as exc:
            findings.append(f"{where}: row sums unusable ({exc})")
            continue
        usable.append((v, tau))
        figs[seq] = {"row_noise_ratio": t.ratio, "row_noise_p": t.p_low}
        equal = max(v) == min(v)
        msg = f"{where}: row-noise variance ratio {t.ratio:.3g} on {t.dof} dof, p = {t.p_low:.3g}" + (
            f"; all {len(v)} row sums exactly equal ({v[0]:.0f})" if equal else ""
        )
        if t.passed:
            notes.append(msg)
        else:
            findings.append(msg + f" < {alpha_one:.2g}: the statistic carries less noise than recorded")
    if len(usable) > 1:
        t = row_noise_test(usable, ALPHA / 2)
        msg = (
            f"pooled over {len(usable)} releases: variance ratio {t.ratio:.3g} on {t.dof} dof, "
            f"p = {t.p_low:.3g} (alpha {ALPHA / 2:.2g})"
        )
        if t.passed:
            notes.append(msg)
        else:
            findings.append(msg + ": the statistic carries less noise than recorded (noise on the canaries only?)")
    for where, _, rows, _ in releases:
        if len(rows) < 2:
            notes.append(f"{where}: one layer: no row-sum differences to test")
    return findings, notes, figs


def _party_seeds(entries: Iterable[Mapping[str, Any]], rnd: Any) -> list[str | None]:
    """The canary seeds a party recorded for its router-statistics masked inputs of round ``rnd`` (None for one
    without a seed). A resumed run can hold two of them for one round number (one per SecAgg setup epoch)."""
    out: list[str | None] = []
    for e in entries:
        if (
            e.get("direction") == "out"
            and e.get("payload_type") == MASKED_STATS
            and e.get("round") == rnd
            and e.get("verdict") == "accepted"
        ):
            dp = e.get("dp") if isinstance(e.get("dp"), dict) else {}
            seed = dp.get("canary_seed")
            out.append(seed if isinstance(seed, str) else None)
    return out


def check_canary_positions(
    releases: Sequence[Mapping[str, Any]], parties: Mapping[str, Iterable[Mapping[str, Any]]]
) -> tuple[list[str], list[str]]:
    """``releases``: the coordinator's router-statistics release entries; ``parties``: party name -> the entries of
    its verified ledger (those given to the audit)."""
    findings: list[str] = []
    notes: list[str] = []
    seen: dict[str, str] = {}
    for r in releases:
        info = r.get("info") if isinstance(r.get("info"), dict) else {}
        where = f"coordinator#{r.get('seq')} {r.get('payload_type')} (round {r.get('round')})"
        canary, dp = info.get("canary"), r.get("dp")
        if not isinstance(canary, dict) or not isinstance(dp, dict):
            continue  # noise-presence reports a release without DP parameters or canary record
        k = canary.get("k")
        if not k:
            notes.append(f"{where}: no canaries: nothing to place")
            continue
        try:
            seed = bytes.fromhex(canary["seed"])
            u1 = [(int(c), bytes.fromhex(pk)) for c, pk in canary["u1"]]
            again = canary_seed(bytes.fromhex(canary["secagg_run"]), int(r["round"]), u1)
            length = int(info["layers"]) * int(info["experts"]) + int(k)
            digest = positions_digest(canary_positions(again, length, int(k)))
        except (KeyError, TypeError, ValueError) as exc:
            findings.append(f"{where}: canary seed, U1 keys or positions not recorded or unusable ({exc!r})")
            continue
        bad = False
        if again != seed:
            findings.append(
                f"{where}: recorded canary seed {seed.hex()[:16]} is not the hash of the recorded round "
                f"material ({again.hex()[:16]})"
            )
            bad = True
        if canary.get("positions_sha256") != digest:
            findings.append(f"{where}: the recorded canaries are not at the positions recomputed from the seed")
            bad = True
        if len(u1) < len(info.get("included") or []):
            findings.append(
                f"{where}: U1 lists {len(u1)} mask keys for {len(info.get('included') or [])} included parties"
            )
            bad = True
        if again.hex() in seen:
            findings.append(f"{where}: the same canary seed as {seen[again.hex()]}: positions repeat")
            bad = True
        seen[again.hex()] = where
        checked = 0
        for name in info.get("included") or []:
            if name not in parties:
                continue
            got = _party_seeds(parties[name], r.get("round"))
            if not got:
                continue  # the cross-check reports a release without the party's masked input
            checked += 1
            if again.hex() not in got:
                used = ", ".join((g or "none")[:16] for g in got)
                findings.append(f"{where}: {name} built its vector with canary seed {used}, not {again.hex()[:16]}")
                bad = True
        if not bad:
            notes.append(
                f"{where}: {k} canaries at the positions of seed {again.hex()[:16]} "
                f"({len(u1)} U1 keys; {checked} party ledgers agree)"
            )
    return findings, notes
