"""The audit report: ``RUN/audit/audit.json`` and ``RUN/audit/audit.md``, the stdout summary, the CLI body.

Owns: the Markdown layout (verdict first, a table of checks, the per-party epsilon table, the releases,
then every check's details), atomic writes of both files, and :func:`cli_audit` (what
``distmoe audit`` does: exit 0 pass, 1 violation, 2 unusable input with one ``error: ...`` line, 3 unverified:
no check failed but a party of the roster is witnessed neither by its ledger nor by its receipt).

Must not: decide anything (the engine does) or print a canary string (details carry SHA-256 prefixes).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distmoe.audit.engine import AuditInputError, AuditResult, audit_run
from distmoe.audit.result import EXIT_INPUT
from distmoe.io import sanitize, write_json_atomic, write_text_atomic
from distmoe.rundir import RunDir
from distmoe.rundir.layout import AUDIT_JSON, AUDIT_MD

__all__ = ["cli_audit", "render_markdown", "summary", "write_audit"]

MAX_DETAILS = 50  # per check in the Markdown (the JSON keeps all)
DASH = "–"


def _fmt(v: Any, spec: str = ".4f") -> str:
    if isinstance(v, bool) or v is None:
        return DASH
    if isinstance(v, float):
        return format(v, spec) if math.isfinite(v) else DASH
    return str(v)


def _cell(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def render_markdown(result: AuditResult) -> str:
    counts = {s: sum(c.status == s for c in result.checks) for s in ("pass", "fail", "warn", "skipped")}
    out = [f"# Privacy audit: {result.run_id}", ""]
    if result.passed:
        out.append(f"**Verdict: PASS** ({counts['pass']} checks passed, {counts['warn']} with warnings, "
                   f"{counts['skipped']} skipped)")
    elif result.verdict == "unverified":
        out.append(f"**Verdict: UNVERIFIED**: no check failed, but {', '.join(result.unwitnessed) or 'no party'} "
                   "gave neither its ledger nor its signed receipt: the coordinator's ledger alone is its own story "
                   "(pass `--party-ledger` or `--receipt` for every party)")
    else:
        out.append(f"**Verdict: FAIL**: {', '.join(result.failed)}")
    if result.warnings:
        out += ["", "**Warnings** (privacy held; the run did not do all it planned):", ""]
        out += [f"- {_cell(w)}" for w in result.warnings]
    flower = (f" Flower's run id (a detail; the ledgers' `run` field): `{result.flower_run_id}`."
              if result.flower_run_id and result.flower_run_id != result.run_id else "")
    out += ["", f"Run directory: `{result.run_dir}`.{flower} Ledgers audited: {', '.join(result.ledgers)}.", "",
            "## Checks", "", "| check | status | summary |", "|---|---|---|"]
    for c in result.checks:
        if c.status == "fail":
            first = f"{len(c.findings)} finding(s); first: {c.findings[0]}"
        else:
            first = c.details[0] if c.details else ""
        out.append(f"| {c.name} | {c.status.upper() if c.status == 'fail' else c.status} | {_cell(first)} |")
    out += ["", "## Epsilon per party", ""]
    if result.epsilon:
        out += ["| party | DP releases | eps (PRV) | eps (RDP) | party's signed eps | eps = max | budget | delta | "
                "server eps | status |", "|---|---|---|---|---|---|---|---|---|---|"]
        for p, r in result.epsilon.items():
            out.append(f"| {p} | {r['releases']} | {_fmt(r['eps_prv'])} | {_fmt(r['eps_rdp'])} | "
                       f"{_fmt(r.get('party_epsilon'))} | {_fmt(r['epsilon'])} | {_fmt(r['budget'], 'g')} | "
                       f"{_fmt(r['delta'], 'g')} | {_fmt(r['server_epsilon'])} | {r['status']} |")
        out += ["", "eps is recomputed from the coordinator's release entries (z_eff from the survivors), and is "
                "at least the party's own signed charges (from its ledger, when given); the server's own figure "
                "is shown for comparison only."]
    else:
        out.append("No epsilon could be computed (see the epsilon check).")
    if result.releases:
        out += ["", "## Releases", "", "| seq | round | type | included | DP | z_eff | sigma_hat/sigma | noise p | "
                "row-sum p | row-noise ratio | row-noise p |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in result.releases:
            out.append(f"| {r['seq']} | {_fmt(r['round'])} | {r['type']} | {len(r['included'])} | "
                       f"{'yes' if r['dp'] else 'no'} | {_fmt(r['z_eff'])} | {_fmt(r.get('sigma_ratio'), '.3f')} | "
                       f"{_fmt(r.get('noise_p'), '.3g')} | {_fmt(r.get('row_sum_p'), '.3g')} | "
                       f"{_fmt(r.get('row_noise_ratio'), '.3f')} | {_fmt(r.get('row_noise_p'), '.3g')} |")
    out += ["", "## Details"]
    for c in result.checks:
        out += ["", f"### {c.name}: {c.status}", ""]
        shown = c.details[:MAX_DETAILS]
        out += [f"- {d}" for d in shown] or ["- (nothing to report)"]
        if len(c.details) > MAX_DETAILS:
            out.append(f"- ... and {len(c.details) - MAX_DETAILS} more (see audit.json)")
    return "\n".join(out) + "\n"


def write_audit(result: AuditResult, out_dir: str | os.PathLike[str] | None = None) -> tuple[Path, Path]:
    """Write ``audit.json`` and ``audit.md`` atomically into ``out_dir`` (default ``RUN/audit``)."""
    d = Path(out_dir) if out_dir is not None else RunDir(result.run_dir).audit
    body = {**result.to_dict(), "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    jpath, mpath = d / AUDIT_JSON, d / AUDIT_MD
    write_json_atomic(jpath, body)
    write_text_atomic(mpath, render_markdown(result))
    return jpath, mpath


def summary(result: AuditResult, report: Path | None = None) -> str:
    lines = [f"audit {result.run_id}: {result.verdict.upper()}"]
    if result.verdict == "unverified":
        lines.append("  UNVERIFIED: not witnessed (no party ledger, no receipt): " + (", ".join(result.unwitnessed)
                                                                                    or "no party"))
    for c in result.checks:
        if c.status == "fail":
            lines.append(f"  FAIL {c.name}: {c.findings[0] if c.findings else ''}"
                         + (f" (+{len(c.findings) - 1} more)" if len(c.findings) > 1 else ""))
    for w in result.warnings:
        lines.append(f"  WARNING {w}")
    if report is not None:
        lines.append(f"report: {report}")
    return "\n".join(lines)


def cli_audit(run_dir: str | os.PathLike[str], party_ledgers: Sequence[str] | None = None,
              canaries: str | None = None, as_json: bool = False, out: str | os.PathLike[str] | None = None,
              receipts: Sequence[str] | None = None) -> int:
    """``distmoe audit``: audit, write the report (into ``out``, default ``RUN/audit``: a data owner auditing
    a copy of the run at its site keeps its own report apart from the coordinator's), print a summary (or
    the JSON); return the exit status."""
    try:
        result = audit_run(run_dir, party_ledgers=party_ledgers or None, canaries=canaries, receipt_files=receipts)
    except AuditInputError as exc:
        if as_json:  # stdout stays one JSON object on every path
            print(json.dumps({"error": str(exc), "passed": False, "exit_status": EXIT_INPUT, "run_dir": str(run_dir)}))
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    jpath, mpath = write_audit(result, out)
    if as_json:
        print(json.dumps(sanitize({**result.to_dict(), "report": str(mpath)}), indent=2))
    else:
        print(summary(result, mpath))
    return result.exit_status
