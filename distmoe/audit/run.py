"""The audit's view of a run directory: what it loads and the small readers every check shares.

Owns: :class:`Run` (``run.json``, ``ledger/coordinator.jsonl`` + ``.pub``, the party ledgers
``work/<party>/ledger/<party>.jsonl`` + ``.pub`` or the ones given, the receipts given, ``privacy/ledger.json``,
each read through the one reader of a run directory, ``distmoe.rundir.load_run``; the settings a check reads from
the signed run-start entry), and the helpers ``info_of``, ``loc`` (where an entry is, for findings),
``included_of``, ``flat_get`` and ``close_to``.

A party ledger is the owner's across runs (one work directory, one ledger): its ``entries`` and ``by_seq`` here are
those of the audited run (the ids of the coordinator's entries, a resumed session's included: ``Run.run_ids``), so
no check mistakes another run's entries for this one's; the chain itself is verified over the whole file
(``distmoe.audit.integrity``).

Must not: judge anything (the check modules do), read models, checkpoints or party data, or write anything.
Unusable input (no run directory, no ``run.json`` or coordinator ledger, unparsable records, a receipt that is
not JSON) raises :class:`~distmoe.audit.result.AuditInputError`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from distmoe.audit.result import AuditInputError, Check
from distmoe.rundir import COORDINATOR, LedgerFile, RunDir, RunFileError, load_run, read_json

__all__ = ["COORDINATOR", "LedgerFile", "Run", "close_to", "flat_get", "included_of", "info_of", "loc"]
REL_TOL = 1e-6  # agreement between a recomputed number and the one the ledger claims


def flat_get(cfg: Mapping[str, Any], key: str) -> Any:
    """``cfg["a.b"]`` for a flat config, else ``cfg["a"]["b"]`` for a nested one; None if absent."""
    if key in cfg:
        return cfg[key]
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def info_of(e: Mapping[str, Any]) -> dict[str, Any]:
    i = e.get("info")
    return i if isinstance(i, dict) else {}


def loc(lf: LedgerFile | str, e: Mapping[str, Any]) -> str:
    name = lf if isinstance(lf, str) else lf.name
    rnd = e.get("round")
    return f"{name}#{e.get('seq')} {e.get('payload_type')}" + (f" (round {rnd})" if rnd is not None else "")


def close_to(a: Any, b: float) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and math.isclose(float(a), b, rel_tol=REL_TOL,
                                                                                     abs_tol=1e-12)


class Run:
    """A run directory as the checks read it: run records, the coordinator ledger, the party ledgers and
    receipts given (or found under ``work/``), the server's privacy ledger."""

    def __init__(self, run_dir: Path, party_ledgers: Sequence[str | os.PathLike[str]] | None,
                 canaries: str | os.PathLike[str] | None,
                 receipts: Sequence[str | os.PathLike[str]] | None = None):
        self.dir = Path(run_dir)
        self.layout = RunDir(self.dir)
        try:  # an unusable input is the audit's exit 2, never a verdict
            files = load_run(self.dir)
            self.meta = files.record
            self.coord = files.coordinator_ledger
            self.parties: dict[str, LedgerFile] = files.party_ledgers(party_ledgers)
            self.server_privacy = files.accounts
            self.receipts: list[tuple[Path, Any]] = [  # (path, parsed JSON): judged by distmoe.audit.receipts
                (p, read_json(p, "receipt")) for p in map(Path, receipts or ())]
        except RunFileError as exc:
            raise AuditInputError(str(exc)) from exc
        self._run_ids = files.run_ids()
        self.config = self.meta.get("config") if isinstance(self.meta.get("config"), dict) else {}
        self.run_parties = self.meta.get("parties") if isinstance(self.meta.get("parties"), dict) else {}
        self.canaries_arg = Path(canaries) if canaries is not None else None
        if self.canaries_arg is not None and not self.canaries_arg.is_file():
            raise AuditInputError(f"{self.canaries_arg}: no such canary list")
        self.start = self.coord.by_seq.get(0, {})
        self.releases = [e for e in self.coord.entries if str(e.get("payload_type", "")).startswith("release:")]
        self.stats_releases = [e for e in self.releases if e.get("payload_type") == "release:router-stats"]
        self.settings: dict[str, Any] = {}

    def run_ids(self) -> set[str]:
        """The ids this run's entries carry (``distmoe.rundir.LoadedRun.run_ids``)."""
        return set(self._run_ids)

    @property
    def ledgers(self) -> list[LedgerFile]:
        return [self.coord, *self.parties.values()]

    def setting(self, key: str, check: Check) -> Any:
        """A ``privacy.<key>`` setting: the signed run-start record first, run.json's config second;
        a disagreement between the two fails ``check``."""
        signed = info_of(self.start).get("privacy")
        signed = signed if isinstance(signed, dict) else {}
        a = signed.get(f"privacy.{key}", signed.get(key))
        b = flat_get(self.config, f"privacy.{key}")
        if a is not None and b is not None and a != b:
            check.fail(f"privacy.{key}: the run-start ledger entry says {a!r}, run.json says {b!r}")
        value = a if a is not None else b
        self.settings[f"privacy.{key}"] = value
        return value

    def all_parties(self) -> list[str]:
        names = set(self.run_parties) | set(self.parties)
        for r in self.releases:
            names.update(included_of(r))
        return sorted(names)


def included_of(rel: Mapping[str, Any]) -> list[str]:
    inc = info_of(rel).get("included")
    return [str(p) for p in inc] if isinstance(inc, list) else []
