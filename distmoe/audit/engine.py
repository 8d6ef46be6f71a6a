"""The post-run privacy audit: re-verify a finished run from its signed ledgers, receipts and run records alone.

Owns: the order of the checks (``CHECKS``) and :func:`audit_run`, which loads the run (:mod:`.run`), runs every
check and returns the :class:`~distmoe.audit.result.AuditResult` with its verdict (``pass``, ``fail`` or
``unverified``). Check names, in order, and the module that owns each:

- ``ledger-integrity``, ``cross-check``, ``allow-list``, ``no-blocked``, ``no-plaintext``, ``min-parties``:
  :mod:`.integrity`;
- ``epsilon`` (recomputed from the release entries; each party's own signed charges, from its ledger or its
  receipt, are a lower bound): :mod:`.epsilon` with :mod:`.ledgers` and :mod:`.receipts`;
- ``noise-presence``, ``row-sums``, ``row-noise``, ``canary-positions``: :mod:`.noise_checks` (statistics in
  :mod:`.noise`);
- ``canaries``: :mod:`.canaries`; ``server-files``: :mod:`.schemas`; ``mask-uniformity``: :mod:`.masks`;
- ``run-end``, ``coordinator-heads``, ``release-coverage``: :mod:`.ledgers`;
- ``schedule-coverage`` (a warning only): :mod:`.coverage`;
- ``release-records`` (``privacy/ledger.json``, ``metrics.jsonl``, ``run.json`` and so the report tell the
  ledger's release story): :mod:`.records`;
- ``receipts`` (each party's signed run receipt against the coordinator ledger) and who witnesses the run:
  :mod:`.receipts`.

Each check is ``pass``, ``fail``, ``warn`` or ``skipped`` with human-readable details. The verdict fails if any
check fails (a ``warn`` is listed, it does not fail it); with no failure it is ``unverified`` unless every party
of the roster is witnessed by its own ledger or its receipt: a coordinator-only run directory is never PASS.
Rendering and writing the report is :mod:`.report`.

Must not: import ``flwr``, read models, checkpoints, anchors or party data (the only file read from a party's data
directory is its canary list ``canaries.txt``), print a canary string, or write anything. Unusable input raises
:class:`~distmoe.audit.result.AuditInputError`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distmoe.audit import coverage, integrity, ledgers, noise_checks, receipts, records
from distmoe.audit.canaries import check_canaries
from distmoe.audit.epsilon import check_epsilon, z_eff
from distmoe.audit.masks import check_masks
from distmoe.audit.noise import POSITIONS, ROW_NOISE
from distmoe.audit.result import AuditInputError, AuditResult, Check
from distmoe.audit.run import Run, included_of, info_of
from distmoe.audit.schemas import check_server_files

__all__ = ["AuditInputError", "AuditResult", "Check", "CHECKS", "audit_run"]

CHECKS = ("ledger-integrity", "cross-check", "allow-list", "no-blocked", "no-plaintext", "epsilon",
          "noise-presence", "row-sums", ROW_NOISE, POSITIONS, "min-parties", "canaries", "server-files",
          "mask-uniformity", *ledgers.CHECKS, coverage.CHECK, records.CHECK, receipts.CHECK)
_RUN_NAME = re.compile(r"[A-Za-z0-9_.:/*+-]{1,64}\Z")  # run.name as the report accepts it (the run's one id)


def _server_files(run: Run) -> Check:
    findings, notes = check_server_files(run.dir, run.meta, info_of(run.start).get("mode"))
    c = Check("server-files").fill((findings, notes[:20]))
    if c.status == "pass":
        c.note("metrics.jsonl, run.json, the report and every other server-side file fit their schemas")
    return c


def _warn(c: Check, found: tuple[list[str], list[str]]) -> Check:
    """Fill ``c`` from a ``(warnings, notes)`` pair: its findings warn, they do not fail the verdict."""
    for w in found[0]:
        c.warn(w)
    for n in found[1]:
        c.note(n)
    return c


def audit_run(run_dir: str | os.PathLike[str], party_ledgers: Sequence[str | os.PathLike[str]] | None = None,
              canaries: str | os.PathLike[str] | None = None,
              receipt_files: Sequence[str | os.PathLike[str]] | None = None) -> AuditResult:
    """Audit the run in ``run_dir`` (see the module docstring); writes nothing.

    ``party_ledgers``: paths of the party ledgers to audit (each with its ``.pub`` next to it); default all
    ``work/*/ledger/*.jsonl``. ``canaries``: a canary list file (one string per line) overriding the run's.
    ``receipt_files``: the parties' signed run receipts (``<work-dir>/receipts/<party>-<run>.json``).
    Raises :class:`AuditInputError` when the run cannot be audited at all.
    """
    run = Run(Path(run_dir), party_ledgers, canaries, receipt_files)
    figs: dict[int, dict[str, Any]] = {}
    eps_check, table = check_epsilon(run)
    parties = {name: lf.entries for name, lf in run.parties.items()}
    rec_check, rec_charges, witnessed, unwitnessed = receipts.check_receipts(run, integrity.pins(run))
    budget = run.settings.get("privacy.epsilon")
    cap = budget if isinstance(budget, (int, float)) else math.inf
    charges = ledgers.party_charges(parties)
    for p, (eps, where) in rec_charges.items():  # a receipt's charge counts like the party ledger's
        if p not in charges or eps > charges[p][0]:
            charges[p] = (eps, where)
    eps_check.fill(ledgers.fold_party_charges(table, charges, cap))  # the larger of the coordinator's and the party's
    checks = [integrity.check_integrity(run), integrity.check_cross(run), integrity.check_allow_list(run),
              integrity.check_blocked(run), integrity.check_plaintext(run), eps_check,
              noise_checks.check_noise(run, figs), noise_checks.check_row_sums(run, figs),
              noise_checks.check_row_noise(run, figs), noise_checks.check_positions(run),
              integrity.check_min_parties(run), check_canaries(run), _server_files(run),
              Check("mask-uniformity").fill(check_masks(parties)),
              Check("run-end").fill(ledgers.check_run_end(run.coord.entries)),
              Check("coordinator-heads").fill(ledgers.check_heads(run.coord.entries, parties),
                                              None if parties else "no party ledgers: heads cannot be checked (see "
                                              "receipts: a ledger re-signed with the coordinator's key needs a "
                                              "party's witness)"),
              Check("release-coverage").fill(ledgers.check_coverage(run.coord.entries, parties)),
              _warn(Check(coverage.CHECK), coverage.check_schedule(run.meta, run.coord.entries)),
              records.check_records(run), rec_check]
    assert tuple(c.name for c in checks) == CHECKS
    releases = []
    for r in run.releases:
        releases.append({"seq": r.get("seq"), "round": r.get("round"), "phase": r.get("phase"),
                         "type": r.get("payload_type"), "mode": info_of(r).get("mode"),
                         "included": included_of(r), "dropped": info_of(r).get("dropped", []),
                         "dp": r.get("dp") is not None, "z_eff": z_eff(r, None), **figs.get(r.get("seq"), {})})
    paths = {lf.name: str(lf.path) for lf in run.ledgers}
    name = run.meta.get("name")
    run_name = name if isinstance(name, str) and _RUN_NAME.match(name) else run.dir.name
    flower_id = run.meta.get("run_id")
    return AuditResult(run.dir, run_name, checks, paths, run.settings, table, releases,
                       flower_run_id=str(flower_id) if flower_id else None, witnessed=witnessed,
                       unwitnessed=unwitnessed)
