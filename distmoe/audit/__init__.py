"""The privacy audit: re-verify a finished run from its ledgers, receipts and run records (never models or data).

``audit_run(run_dir, party_ledgers=None, canaries=None, receipt_files=None) -> AuditResult`` (:mod:`.engine`) runs
the checks; ``write_audit`` / ``cli_audit`` (:mod:`.report`) write ``RUN/audit/audit.{json,md}`` and back
``distmoe audit`` (exit 0 pass, 1 violation, 2 unusable input, 3 unverified).
"""

from distmoe.audit.engine import CHECKS, AuditInputError, AuditResult, Check, audit_run
from distmoe.audit.report import cli_audit, render_markdown, summary, write_audit

__all__ = ["CHECKS", "AuditInputError", "AuditResult", "Check", "audit_run", "cli_audit", "render_markdown",
           "summary", "write_audit"]
