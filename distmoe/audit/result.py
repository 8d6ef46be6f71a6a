"""The audit's result types: one :class:`Check` per check, and the :class:`AuditResult` with its verdict.

Owns: the three verdicts and their exit statuses (``pass`` 0, ``fail`` 1, ``unverified`` 3; unusable input,
:class:`AuditInputError`, is 2). A run is **verified** only when every party of its roster is witnessed: its own
ledger or its signed receipt (``distmoe.audit.receipts``) was given. Without them the coordinator's ledger is
the coordinator's own story (it holds its key and can re-sign any self-consistent rewrite), so a run with no
failed check but an unwitnessed party is ``unverified``, never ``pass``.

Must not: run a check, read a file, or print.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EXIT_PASS, EXIT_FAIL, EXIT_INPUT, EXIT_UNVERIFIED = 0, 1, 2, 3
EXIT_STATUS = {"pass": EXIT_PASS, "fail": EXIT_FAIL, "unverified": EXIT_UNVERIFIED}


class AuditInputError(ValueError):
    """The run directory cannot be audited at all (missing or unparsable run records): exit status 2."""


@dataclass
class Check:
    """One audit check: ``status`` is ``pass``, ``fail``, ``warn`` or ``skipped``; ``details`` say why."""

    name: str
    status: str = "pass"  # pass, fail, warn (a finding that does not fail the verdict) or skipped
    details: list[str] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)  # the details that failed it

    def fail(self, msg: str) -> None:
        self.status = "fail"
        self.details.append(msg)
        self.findings.append(msg)

    def note(self, msg: str) -> None:
        self.details.append(msg)

    def warn(self, msg: str) -> None:
        """A finding that does not fail the verdict (privacy held, the run did not do what it planned)."""
        if self.status == "pass":
            self.status = "warn"
        self.details.append(msg)
        self.findings.append(msg)

    def skip(self, msg: str) -> None:
        if self.status != "fail":
            self.status = "skipped"
        self.details.append(msg)

    def fill(self, found: tuple[list[str], list[str]], skip: str | None = None) -> Check:
        """Fail on each finding, note each note of a ``(findings, notes)`` pair (``skip``: nothing to check)."""
        for f in found[0]:
            self.fail(f)
        for n in found[1]:
            self.note(n)
        if skip is not None:
            self.skip(skip)
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "details": list(self.details),
                "findings": list(self.findings)}


@dataclass
class AuditResult:
    """Everything the audit found; :meth:`to_dict` is the ``audit.json`` body."""

    run_dir: Path
    run_id: str
    checks: list[Check]
    ledgers: dict[str, str]  # ledger name -> path
    settings: dict[str, Any]  # the privacy settings the checks used
    epsilon: dict[str, dict[str, Any]]  # party -> figures
    releases: list[dict[str, Any]]  # per release: seq, type, included, test figures
    flower_run_id: str | None = None  # Flower's id of the run: a detail (ledgers are keyed by it)
    witnessed: dict[str, str] = field(default_factory=dict)  # roster party -> "ledger" or "receipt"
    unwitnessed: list[str] = field(default_factory=list)  # roster parties with neither: the run is unverified

    @property
    def verdict(self) -> str:
        if self.failed:
            return "fail"
        return "unverified" if self.unwitnessed or not self.witnessed else "pass"

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS[self.verdict]

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if c.status == "fail"]

    @property
    def passed(self) -> bool:
        """Verified and no check failed (an unverified run never passes)."""
        return self.verdict == "pass"

    @property
    def warnings(self) -> list[str]:
        """Findings of checks that warn (e.g. a planned round that released nothing): not a failed verdict."""
        return [f"{c.name}: {w}" for c in self.checks if c.status == "warn" for w in c.findings]

    def check(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "flower_run_id": self.flower_run_id, "run_dir": str(self.run_dir),
                "verdict": self.verdict, "exit_status": self.exit_status, "verified": not self.unwitnessed
                and bool(self.witnessed), "witnessed": dict(self.witnessed), "unwitnessed": list(self.unwitnessed),
                "failed": self.failed, "warnings": self.warnings, "checks": [c.to_dict() for c in self.checks],
                "ledgers": dict(self.ledgers),
                "settings": dict(self.settings), "epsilon": self.epsilon, "releases": self.releases}
