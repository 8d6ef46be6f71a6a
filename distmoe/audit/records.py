"""The audit's ``release-records`` check: the run's other records tell the same release story as its ledger.

Owns: the cross-check of ``privacy/ledger.json`` (the coordinator's accountants: one event per DP release and
party, labelled ``<release> round <n>``), ``metrics.jsonl`` (a ``stats``, ``eval``, ``train`` or ``rl`` row of
a round, not marked ``skipped``, exists only after that round's release of the matching type), ``run.json``
(``privacy.epsilon_spent`` is the ``run-end`` entry's ``epsilon``) and so the report (``report.md`` must be what
``distmoe report`` renders from ``metrics.jsonl`` and ``run.json``: ``server-files``) against the release
entries of the coordinator ledger. A release found in one and not in the other is a violation: a coordinator
that deletes a release from its ledger and re-signs the chain, but leaves the records that show it, is caught
here even without the parties' ledgers or receipts (a thorough forger rewrites these too: then only the
parties' ledgers or receipts catch it, ``distmoe.audit.receipts``).

Must not: import ``flwr``, read party data, or write anything.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from distmoe.audit.result import Check
from distmoe.audit.run import Run, included_of, info_of, loc

CHECK = "release-records"
ROW_RELEASE = {"stats": "release:router-stats", "eval": "release:eval", "train": "release:model-update",
               "rl": "release:rl-update"}  # metrics.jsonl event -> the release that must precede its row
EPS_TOL = 1e-9


def _label(rel: Mapping[str, Any]) -> str:
    return f"{str(rel.get('payload_type'))[len('release:'):]} round {rel.get('round')}"


def _server_labels(run: Run, c: Check) -> dict[str, list[str]] | None:
    sp = run.server_privacy
    parties = sp.get("parties") if isinstance(sp, dict) else None
    if not isinstance(parties, dict):
        return None
    out: dict[str, list[str]] = {}
    for p, st in parties.items():
        evs = st.get("events") if isinstance(st, dict) else None
        if not isinstance(evs, list):
            c.fail(f"privacy/ledger.json: party {p} has no event list")
            continue
        out[str(p)] = sorted(str(e.get("label", "")) if isinstance(e, dict) else "" for e in evs)
    return out


def _check_privacy_ledger(run: Run, c: Check) -> None:
    ledger: dict[str, list[str]] = {}
    for r in run.releases:
        if isinstance(r.get("dp"), dict):
            for p in included_of(r):
                ledger.setdefault(p, []).append(_label(r))
    server = _server_labels(run, c)
    if server is None:
        if ledger:
            c.fail("privacy/ledger.json is missing or has no per-party accountants, but the coordinator ledger "
                   f"holds {sum(map(len, ledger.values()))} DP release charges: the records do not agree")
        else:
            c.note("no privacy/ledger.json and no DP release: nothing to compare")
        return
    for p in sorted(set(ledger) | set(server)):
        a, b = sorted(ledger.get(p, [])), server.get(p, [])
        only_server = [x for x in b if x not in a or b.count(x) > a.count(x)]
        only_ledger = [x for x in a if x not in b or a.count(x) > b.count(x)]
        for x in sorted(set(only_server)):
            c.fail(f"{p}: privacy/ledger.json charges the release '{x}' that the coordinator ledger does not hold "
                   "(a release deleted from the ledger)")
        for x in sorted(set(only_ledger)):
            c.fail(f"{p}: the coordinator ledger's release '{x}' is not charged in privacy/ledger.json")
    c.note(f"privacy/ledger.json: {sum(map(len, server.values()))} charges, the same releases as the coordinator "
           "ledger" if c.status == "pass" else "privacy/ledger.json compared with the coordinator ledger")


def _check_metrics(run: Run, c: Check) -> None:
    path = run.layout.metrics
    if not path.is_file():
        c.note("no metrics.jsonl: nothing to compare")
        return
    have = {(str(r.get("payload_type")), r.get("round")) for r in run.releases}
    rows = 0
    for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # server-files names an unparsable line
        if not isinstance(row, dict) or row.get("event") not in ROW_RELEASE or row.get("skipped") is True:
            continue
        if row.get("party", "all") != "all":
            continue
        rows += 1
        kind = ROW_RELEASE[row["event"]]
        if (kind, row.get("round")) not in have:
            c.fail(f"metrics.jsonl:{i}: a {row['event']} row of round {row.get('round')} but the coordinator ledger "
                   f"holds no {kind} of that round (a release deleted from the ledger)")
    c.note(f"metrics.jsonl: {rows} release rows, each with its release in the coordinator ledger"
           if c.status == "pass" else "metrics.jsonl compared with the coordinator ledger")


def _eps_map(v: Any) -> dict[str, float] | None:
    if not isinstance(v, dict):
        return None
    out = {}
    for p, x in v.items():
        if isinstance(x, dict):
            vals = [float(y) for y in x.values() if isinstance(y, (int, float)) and not isinstance(y, bool)]
            out[str(p)] = max(vals) if vals else math.nan
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            out[str(p)] = float(x)
    return out


def _check_run_json(run: Run, c: Check) -> None:
    priv = run.meta.get("privacy") if isinstance(run.meta.get("privacy"), dict) else {}
    spent = _eps_map(priv.get("epsilon_spent"))
    ends = [e for e in run.coord.entries if e.get("payload_type") == "run-end"]
    end = _eps_map(info_of(ends[-1]).get("epsilon")) if ends else None
    if spent is None:
        if end:
            c.fail(f"run.json has no privacy.epsilon_spent, the run-end entry ({loc(run.coord, ends[-1])}) records "
                   "one")
        return
    if end is None:
        c.fail("run.json records privacy.epsilon_spent but the coordinator ledger's run-end entry records none")
        return
    for p in sorted(set(spent) | set(end)):
        a, b = spent.get(p), end.get(p)
        if a is None or b is None or not math.isclose(a, b, rel_tol=EPS_TOL, abs_tol=EPS_TOL):
            c.fail(f"{p}: run.json's epsilon_spent {a!r} differs from the run-end entry's {b!r}")
    if c.status == "pass":
        c.note("run.json's epsilon_spent is the run-end entry's")


def check_records(run: Run) -> Check:
    c = Check(CHECK)
    if info_of(run.start).get("mode") != "secagg":
        return c.fill(([], []), "not a secure-aggregation run (no-plaintext judges it)")
    _check_privacy_ledger(run, c)
    _check_metrics(run, c)
    _check_run_json(run, c)
    return c
