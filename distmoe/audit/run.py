"""The audit's view of a run directory: what it loads and the small readers every check shares.

Owns: :class:`Run` (``run.json``, ``ledger/coordinator.jsonl`` + ``.pub``, the party ledgers
``work/<party>/ledger/<party>.jsonl`` + ``.pub`` or the ones given, the receipts given, ``privacy/ledger.json``,
the settings a check reads from the signed run-start entry), :class:`LedgerFile`, and the helpers ``info_of``,
``loc`` (where an entry is, for findings), ``included_of``, ``flat_get`` and ``close_to``.

A party ledger is the owner's across runs (one work directory, one ledger): its ``entries`` and ``by_seq`` here are
those of the audited run (the ids of the coordinator's entries, a resumed session's included: ``Run.run_ids``), so
no check mistakes another run's entries for this one's; the chain itself is verified over the whole file
(``distmoe.audit.integrity``).

Must not: judge anything (the check modules do), read models, checkpoints or party data, or write anything.
Unusable input (no run directory, no ``run.json`` or coordinator ledger, unparsable records, a receipt that is
not JSON) raises :class:`~distmoe.audit.result.AuditInputError`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distmoe.audit.result import AuditInputError, Check

COORDINATOR = "coordinator"
REL_TOL = 1e-6  # agreement between a recomputed number and the one the ledger claims


@dataclass
class LedgerFile:
    """One ledger as parsed (integrity is judged by ``verify_ledger``, not here)."""

    name: str
    path: Path
    pub_path: Path
    pub: str | None
    entries: list[dict[str, Any]]
    by_seq: dict[int, dict[str, Any]]


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise AuditInputError(f"{path}: no {what}") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise AuditInputError(f"{path}: {what} is not valid JSON: {exc}") from exc


def _load_ledger(name: str, path: Path, pub_path: Path, run_ids: set[str] | None = None) -> LedgerFile:
    """Parse what can be parsed (integrity is judged by ``verify_ledger``, not here); with ``run_ids``, keep the
    entries of those runs only."""
    entries: list[dict[str, Any]] = []
    for raw in path.read_bytes().split(b"\n"):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(obj, dict) and (run_ids is None or str(obj.get("run")) in run_ids):
            entries.append(obj)
    by_seq: dict[int, dict[str, Any]] = {}
    for e in entries:
        if isinstance(e.get("seq"), int):
            by_seq.setdefault(e["seq"], e)
    try:
        pub = pub_path.read_text(encoding="ascii").strip() or None
    except (OSError, UnicodeDecodeError):
        pub = None
    return LedgerFile(name, path, pub_path, pub, entries, by_seq)


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
        self.dir = run_dir
        if not run_dir.is_dir():
            raise AuditInputError(f"{run_dir}: no such run directory")
        meta = _read_json(run_dir / "run.json", "run.json")
        if not isinstance(meta, dict):
            raise AuditInputError(f"{run_dir / 'run.json'}: expected a JSON object")
        self.meta = meta
        self.config = meta.get("config") if isinstance(meta.get("config"), dict) else {}
        self.run_parties = meta.get("parties") if isinstance(meta.get("parties"), dict) else {}
        cpath = run_dir / "ledger" / f"{COORDINATOR}.jsonl"
        if not cpath.is_file():
            raise AuditInputError(f"{cpath}: no coordinator ledger")
        self.coord = _load_ledger(COORDINATOR, cpath, cpath.with_suffix(".pub"))
        if party_ledgers is None:
            paths = sorted(run_dir.glob("work/*/ledger/*.jsonl"))
        else:
            paths = [Path(p) for p in party_ledgers]
            for p in paths:
                if not p.is_file():
                    raise AuditInputError(f"{p}: no such party ledger")
        self.parties: dict[str, LedgerFile] = {}
        for p in paths:
            name = p.stem
            if name in self.parties or name == COORDINATOR:
                raise AuditInputError(f"{p}: a second ledger for node {name!r}")
            self.parties[name] = _load_ledger(name, p, p.with_suffix(".pub"), self.run_ids())
        server = run_dir / "privacy" / "ledger.json"
        self.server_privacy = _read_json(server, "privacy ledger") if server.exists() else None
        self.canaries_arg = Path(canaries) if canaries is not None else None
        if self.canaries_arg is not None and not self.canaries_arg.is_file():
            raise AuditInputError(f"{self.canaries_arg}: no such canary list")
        self.receipts: list[tuple[Path, Any]] = []  # (path, parsed JSON): judged by distmoe.audit.receipts
        for p in map(Path, receipts or ()):
            self.receipts.append((p, _read_json(p, "receipt")))
        self.start = self.coord.by_seq.get(0, {})
        self.releases = [e for e in self.coord.entries if str(e.get("payload_type", "")).startswith("release:")]
        self.stats_releases = [e for e in self.releases if e.get("payload_type") == "release:router-stats"]
        self.settings: dict[str, Any] = {}

    def run_ids(self) -> set[str]:
        """The ids this run's entries carry: the run-start's and every session's after a resume (each resumed
        session's parties log under its own id: ``session`` of the coordinator's ``run-resume`` entries)."""
        ids = {str(e.get("run")) for e in self.coord.entries}
        ids |= {str((e.get("info") or {}).get("session")) for e in self.coord.entries
                if e.get("payload_type") == "run-resume"}
        return ids

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
