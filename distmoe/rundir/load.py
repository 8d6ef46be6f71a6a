"""The one reader of a finished or partial run directory: what the report, the audit, resume, rollback and export
read of a run.

Each file is read once, and a file a reader needs that is missing or bad is an error that names it.

Owns: :func:`load_run` and its :class:`LoadedRun` (the run record ``run.json``, the metrics rows of
``metrics.jsonl``, the server's accountants ``privacy/ledger.json``, the coordinator's ledger and the party ledgers
found under ``work/``), the lenient parse of a ledger file into a :class:`LedgerFile` (entries as written, a
run's own entries only when asked; its integrity is judged by ``distmoe.ledger.verify``, not here),
:func:`read_json` and the errors :class:`RunFileError` / :class:`MissingRunFile`.

A partial run is normal: every file is read when first asked for, so a run that stopped before its first
checkpoint, its ledger or its accountants still loads; only the reader that needs a missing file gets the error.

Must not: judge a run (the report shows, the audit checks), write anything, import torch or ``flwr``, or know
a name of the layout (``distmoe.rundir.layout`` does).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from distmoe.rundir.layout import COORDINATOR, RunDir
from distmoe.rundir.metrics import MetricsRecords, read_metrics


class RunFileError(ValueError):
    """A file of a run that a reader needs is unreadable: ``path: <what> <why>``, e.g. ``RUN/run.json: the run
    record is not a JSON object``."""

    def __init__(self, path: str | os.PathLike[str], why: str, what: str = ""):
        self.path, self.why, self.what = Path(path), why, what
        super().__init__(f"{self.path}: " + " ".join(s for s in (what, why) if s))

    @property
    def brief(self) -> str:
        """``run.json missing``: the file's name and what is wrong, for a note inside a run's own report."""
        return f"{self.path.name} {self.why.removeprefix('is ')}"


class MissingRunFile(RunFileError, FileNotFoundError):
    """A file of a run that a reader needs does not exist (or the run directory itself)."""

    def __init__(self, path: str | os.PathLike[str], what: str = "", why: str = "is missing"):
        super().__init__(path, why, what)


def read_json(path: str | os.PathLike[str], what: str, *, obj: bool = False) -> Any:
    """The JSON value in ``path`` (``what`` names it in errors); with ``obj``, it must be a JSON object.
    Raises :class:`MissingRunFile` or :class:`RunFileError`."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MissingRunFile(path, what) from None
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RunFileError(path, f"is not valid JSON: {exc}" if isinstance(exc, ValueError) else
                           f"is unreadable: {exc}", what) from None
    if obj and not isinstance(value, dict):
        raise RunFileError(path, "is not a JSON object", what)
    return value


@dataclass
class LedgerFile:
    """One ledger as parsed: its entries as written (integrity is judged by ``verify_ledger``, not here)."""

    name: str
    path: Path
    pub_path: Path
    pub: str | None  # the published public key (hex), None when absent or unreadable
    entries: list[dict[str, Any]]
    by_seq: dict[int, dict[str, Any]]


def read_ledger(name: str, path: str | os.PathLike[str], run_ids: Iterable[str] | None = None) -> LedgerFile:
    """Parse what can be parsed of the ledger ``path`` (and its ``.pub`` beside it); with ``run_ids``, keep the
    entries of those runs only (a party's ledger is the owner's across runs). Raises :class:`MissingRunFile`."""
    path = Path(path)
    keep = None if run_ids is None else set(run_ids)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise MissingRunFile(path, f"the ledger of {name}") from None
    entries: list[dict[str, Any]] = []
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(obj, dict) and (keep is None or str(obj.get("run")) in keep):
            entries.append(obj)
    by_seq: dict[int, dict[str, Any]] = {}
    for e in entries:
        if isinstance(e.get("seq"), int):
            by_seq.setdefault(e["seq"], e)
    pub_path = path.with_suffix(".pub")
    try:
        pub = pub_path.read_text(encoding="ascii").strip() or None
    except (OSError, UnicodeDecodeError):
        pub = None
    return LedgerFile(name, path, pub_path, pub, entries, by_seq)


class LoadedRun:
    """A run directory as its readers see it; each file is read once, when first asked for (module docstring)."""

    def __init__(self, root: str | os.PathLike[str]):
        self.layout = RunDir(root)
        if not self.layout.root.is_dir():
            raise MissingRunFile(self.layout.root, "no such run directory", "")

    @property
    def root(self) -> Path:
        return self.layout.root

    @cached_property
    def record(self) -> dict[str, Any]:
        """``run.json``, a JSON object; :class:`RunFileError` when missing or not one."""
        return read_json(self.layout.record, "the run record", obj=True)

    @property
    def record_problem(self) -> str | None:
        """Why the run record cannot be read (``run.json missing``), None when it can."""
        try:
            _ = self.record
        except RunFileError as exc:
            return exc.brief
        return None

    @cached_property
    def metrics(self) -> MetricsRecords:
        """Every row of ``metrics.jsonl`` (a torn last line skipped and counted in ``skipped``);
        :class:`MissingRunFile` without the log, ``ValueError`` naming the line of a corrupt one before the last."""
        if not self.layout.metrics.is_file():
            raise MissingRunFile(self.layout.metrics, "the run's metrics log")
        return read_metrics(self.layout.metrics)

    @cached_property
    def accounts(self) -> Any:
        """The server's accountants (``privacy/ledger.json``) as parsed, None when the run has none yet;
        :class:`RunFileError` when the file is not JSON."""
        if not self.layout.accounts.exists():
            return None
        return read_json(self.layout.accounts, "the server's privacy ledger")

    @cached_property
    def coordinator_ledger(self) -> LedgerFile:
        """The coordinator's ledger, every entry; :class:`MissingRunFile` when the run has none."""
        if not self.layout.ledger.is_file():
            raise MissingRunFile(self.layout.ledger, "the coordinator ledger")
        return read_ledger(COORDINATOR, self.layout.ledger)

    def run_ids(self) -> set[str]:
        """The ids this run's entries carry: the run-start's and every session's (each session's parties log under its
        own Flower run id: ``session`` of the coordinator's run-start and ``run-resume`` entries)."""
        entries = self.coordinator_ledger.entries
        ids = {str(e.get("run")) for e in entries}
        ids |= {str(s) for e in entries if e.get("payload_type") in ("policy", "run-resume")
                and (s := (e.get("info") if isinstance(e.get("info"), dict) else {}).get("session")) is not None}
        return ids

    def party_ledgers(self, paths: Iterable[str | os.PathLike[str]] | None = None) -> dict[str, LedgerFile]:
        """The party ledgers given (else those found under ``work/``), each named by its file's stem and holding
        this run's entries only; :class:`RunFileError` for a missing one or a second ledger of one node."""
        found = self.layout.party_ledgers() if paths is None else [Path(p) for p in paths]
        seen: set[str] = {COORDINATOR}
        for p in found:
            if not p.is_file():
                raise MissingRunFile(p, "a party ledger")
            if p.stem in seen:
                raise RunFileError(p, f"a second ledger for node {p.stem!r}")
            seen.add(p.stem)
        ids = self.run_ids() if found else set()  # which entries are this run's: the coordinator ledger says
        return {p.stem: read_ledger(p.stem, p, ids) for p in found}


def load_run(root: str | os.PathLike[str]) -> LoadedRun:
    """The run in ``root``, to be read (nothing is read yet); :class:`MissingRunFile` when there is no such
    directory."""
    return LoadedRun(root)
