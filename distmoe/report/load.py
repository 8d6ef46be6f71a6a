"""The run report's reading of a run directory: records loaded once, values made safe to show.

Owns: the report's view of a run: the metrics rows, the run record and the server's accountants, read through
the one reader of a run (``distmoe.rundir.load_run``), in one ``_Run`` (events by kind, in round order; anything
unknown ignored), the value helpers (``fmt``: ints as is, floats to 4 significant digits, "–" for missing), the
Markdown table helper, the aggregate train rows (derived from party rows where no aggregate was logged) and
:func:`summarise` (the final aggregate eval metrics, reused by results tables).

Must not: import ``flwr`` or ``torch``, read models, checkpoints, anchors or data, or crash on a run that
stopped halfway (missing keys, ``null`` values, absent events). The only hard errors are a missing
``metrics.jsonl`` and a corrupt line in its middle.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distmoe.io import sanitize
from distmoe.report.progress import noisy
from distmoe.rundir import LoadedRun, RunFileError, load_run

log = logging.getLogger(__name__)

AGG = "all"
HEALTHY_LOAD_CV = 0.2
DASH = "–"
FIGSIZE = (6.0, 3.5)
FIGSIZE_WIDE = (8.0, 3.5)
DPI = 110
MAX_PARTY_LEGEND = 8  # more parties than this share one legend entry
RETENTION_COLLAPSE = 0.5  # retention below this: the task is mostly forgotten (named in the report)
RELEASE_KINDS = ("router-stats", "model-update", "rl-update", "eval")  # labels of the accountant's events
REFUSAL_REASONS = {"too-few-contributors": "fewer contributing parties than privacy.min-parties"}
PARTY_LOG = "`<work-dir>/metrics/<party>.jsonl`"  # where a party keeps its own training metrics
_LABEL = re.compile(r"[A-Za-z0-9_.:/*+-]{1,64}\Z")


def _count(v: Any) -> int | float | None:
    """An int stays an int (shown without decimals); other numbers as :func:`_num`."""
    return v if isinstance(v, int) and not isinstance(v, bool) else _num(v)

def _num(v: Any) -> float | None:
    """A finite float, or None for anything else (null, NaN, strings, bools)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None

def _round_of(ev: Mapping[str, Any]) -> int | None:
    r = _num(ev.get("round"))
    return int(r) if r is not None else None

def _party_of(ev: Mapping[str, Any]) -> str:
    p = ev.get("party", AGG)
    return AGG if p is None else str(p)

def fmt(v: Any) -> str:
    """Format for the report: ints as is, floats to 4 significant digits, missing as "–"."""
    if v is None:
        return DASH
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else DASH
    s = str(v)
    return s if s else DASH

def _slot(row: Mapping[str, Any], key: str) -> Any:
    """A released training-metric slot's mean (``key``); under update noise (``<key>_sd`` in the row) with its noise
    std, ``0.812 ± 0.041``, or ``≈ 0 (within noise)`` within one std of 0."""
    v, sd = _num(row.get(key)), _num(row.get(f"{key}_sd"))
    return v if v is None or sd is None else noisy(v, sd, 3)

def _cell(v: Any) -> str:
    return fmt(v).replace("|", "\\|").replace("\n", " ")

def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out

def _arrow(a: Any, b: Any) -> str:
    if _num(a) is None and _num(b) is None:
        return DASH
    return f"{fmt(_num(a))} → {fmt(_num(b))}"

@dataclass
class _Run:
    run_dir: Path
    record: dict[str, Any]
    record_problem: str | None
    events: list[dict[str, Any]]
    skipped_lines: int
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    stats: list[dict[str, Any]] = field(default_factory=list)
    rl: list[dict[str, Any]] = field(default_factory=list)
    party_errors: list[dict[str, Any]] = field(default_factory=list)
    probes: list[dict[str, Any]] = field(default_factory=list)  # the routing probe, aggregate rows (every round)
    accounts: dict[str, Any] = field(default_factory=dict)  # privacy/ledger.json, {} when absent or unreadable

    @property
    def run_id(self) -> str:
        """The run's one id: ``run.name`` (``distmoe simulate`` sets it to the directory's name), else the
        directory's name, the id every command takes (``report``, ``audit``, ``--resume``)."""
        name = self.record.get("name")
        return str(name) if isinstance(name, str) and _LABEL.match(name) else self.run_dir.name

    @property
    def flower_run_id(self) -> str | None:
        """Flower's id of the run (a detail: the ledger and the parties' accountants are keyed by it)."""
        rid = self.record.get("run_id")
        if not rid:
            rid = next((e.get("run_id") for e in self.events if e.get("event") == "run_start"), None)
        return str(rid) if rid else None

    @property
    def secure(self) -> bool:
        """Secure aggregation: from the run record, else from the train rows (``contributors``, not examples)."""
        priv = self.record.get("privacy")
        if isinstance(priv, Mapping) and isinstance(priv.get("secure_aggregation"), bool):
            return priv["secure_aggregation"]
        return any("contributors" in e for e in self.train + self.rl)

    @property
    def status(self) -> str:
        st = self.record.get("status")
        if st:
            return str(st)
        end = next((e for e in reversed(self.events) if e.get("event") == "run_end"), None)
        if end is not None:
            return str(end.get("status") or "ended")
        return "unknown"

    def agg_evals(self) -> list[dict[str, Any]]:
        return [e for e in self.evals if _party_of(e) == AGG]

    def parties(self) -> list[str]:
        seen: dict[str, None] = {}
        for e in self.train + self.evals:
            p = _party_of(e)
            if p != AGG:
                seen.setdefault(p, None)
        return sorted(seen, key=_natural_key)

    def tasks(self) -> list[str]:
        """Tasks in training order, then any seen only in eval keys."""
        seen: dict[str, None] = {}
        for e in self.train:
            t = e.get("task")
            if t:
                seen.setdefault(str(t), None)
        for e in self.evals:
            for k in e:
                prefix, sep, task = k.partition("/")
                if sep and task and prefix in ("acc", "loss", "n", "retention"):
                    seen.setdefault(task, None)
        return list(seen)

def _natural_key(s: str) -> tuple[Any, ...]:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s))

_EVENT_LISTS = {"train": "train", "eval": "evals", "stats": "stats", "rl": "rl", "party_error": "party_errors",
                "probe": "probes"}  # metrics.jsonl's event -> the _Run list that holds it
_BY_ROUND = ("train", "rl", "evals", "stats", "probes")  # sorted by round; party errors keep the log's order

def _by_round(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events with a round, sorted by round (stable: a later duplicate stays later)."""
    return sorted((e for e in events if _round_of(e) is not None), key=lambda e: _round_of(e))

def _load(run_dir: Path) -> _Run:
    files: LoadedRun = load_run(run_dir)
    events = files.metrics  # the one hard error: no metrics log (or a corrupt line before its last)
    problem = files.record_problem
    run = _Run(files.root, {} if problem else files.record, problem, list(events), events.skipped)
    for e in run.events:
        kind = e.get("event")
        if isinstance(kind, str) and kind in _EVENT_LISTS:
            getattr(run, _EVENT_LISTS[kind]).append(e)
    for name in _BY_ROUND:
        setattr(run, name, _by_round(getattr(run, name)))
    try:
        accounts = files.accounts
        run.accounts = accounts if isinstance(accounts, dict) else {}
    except RunFileError as exc:
        log.warning("%s", exc)
    return run

def _last_agg_eval(run: _Run) -> dict[str, Any] | None:
    ev = run.agg_evals()
    return ev[-1] if ev else None

def summarise(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The final aggregate eval metrics: a copy of the last ``eval`` event with ``party == "all"``.

    Non-finite numbers come back as ``None``; an empty dict means the run never evaluated.
    Raises FileNotFoundError when ``metrics.jsonl`` is missing.
    """
    last = _last_agg_eval(_load(Path(run_dir)))
    return sanitize(last) if last else {}

def _config_value(run: _Run, key: str) -> Any:
    cfg = run.record.get("config")
    return cfg.get(key) if isinstance(cfg, Mapping) else None

def _weighted(rows: list[dict[str, Any]], key: str) -> float | None:
    pairs = [(_num(r.get(key)), _num(r.get("num_examples"))) for r in rows]
    pairs = [(v, w if w and w > 0 else 1.0) for v, w in pairs if v is not None]
    if not pairs:
        return None
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total

def _train_rows(run: _Run) -> tuple[list[dict[str, Any]], bool]:
    """One aggregate row per round; the flag says whether any row was derived from party events."""
    agg: dict[int, dict[str, Any]] = {}
    parties: dict[int, list[dict[str, Any]]] = {}
    for e in run.train:
        r = _round_of(e)
        if _party_of(e) == AGG:
            agg[r] = e  # a later duplicate (e.g. a resumed round) wins
        else:
            parties.setdefault(r, []).append(e)
    derived = False
    rows = []
    for r in sorted(set(agg) | set(parties)):
        if r in agg:
            rows.append(dict(agg[r], _derived=False))
            continue
        prs = parties[r]
        skipped = [s for s in (_num(p.get("skipped_steps")) for p in prs) if s is not None]
        rows.append(
            {
                "round": r,
                "phase_label": prs[0].get("phase_label"),
                "task": prs[0].get("task"),
                "loss": _weighted(prs, "loss"),
                "loss_first": _weighted(prs, "loss_first"),
                "loss_last": _weighted(prs, "loss_last"),
                "aux_loss": _weighted(prs, "aux_loss"),
                "anchor_kl": _weighted(prs, "anchor_kl"),
                "skipped_steps": int(sum(skipped)) if skipped else None,
                "num_examples": int(sum(_num(p.get("num_examples")) or 0 for p in prs)),
                "_derived": True,
            }
        )
        derived = True
    return rows, derived
