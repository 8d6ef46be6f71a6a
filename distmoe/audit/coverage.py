"""The audit's ``schedule-coverage`` check: every round the schedule planned released what it planned.

Owns: ``check_schedule(meta, coord_entries) -> (warnings, notes)``. The schedule comes from ``run.json``
(``schedule``: phase labels such as ``sft:lookup*5``, ``stats:lookup``, ``eval``); each played round
(up to the round of the coordinator's ``run-end`` entry; the last one only when the run completed) must
have an applied release entry of its phase's type in the coordinator's ledger (``release:model-update``
for ``sft`` and ``dpo``, ``release:rl-update`` for ``rl``, ``release:router-stats`` for ``stats``, ``release:eval``
for ``eval``). A round without one, or whose release was rejected (``info.applied`` false), is a
*warning*, not a privacy violation: nothing was released, so privacy held, but the run did not do what
it planned (e.g. parties refused a release over their ``epsilon-max``: no anchor was built). The
coordinator's own ``run.json`` warnings about skipped rounds are listed next to it; a skipped round the
ledger shows but ``run.json`` does not mention is named as such.

Must not: import ``flwr``, read anything but the run record and the ledger entries it is given, or write.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

CHECK = "schedule-coverage"
RELEASE_OF = {
    "sft": "release:model-update",
    "dpo": "release:model-update",  # a dpo round's update is released like an sft one
    "rl": "release:rl-update",
    "stats": "release:router-stats",
    "eval": "release:eval",
}
_LABEL = re.compile(r"(?P<kind>[a-z]+)(?::[^*]*)?(?:\*(?P<n>\d{1,6}))?\Z")


def planned_rounds(schedule: Sequence[Any]) -> list[tuple[int, str, str]] | None:
    """``[(round, phase label, release type)]`` from ``run.json``'s ``schedule``; None when unreadable."""
    out: list[tuple[int, str, str]] = []
    for item in schedule:
        m = _LABEL.match(str(item))
        if m is None or m.group("kind") not in RELEASE_OF:
            return None
        label = str(item).split("*", 1)[0]
        for _ in range(int(m.group("n") or 1)):
            out.append((len(out) + 1, label, RELEASE_OF[m.group("kind")]))
    return out


def check_schedule(meta: Mapping[str, Any], entries: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[str]]:
    """``(warnings, notes)`` of the ``schedule-coverage`` check (module docstring)."""
    schedule = meta.get("schedule")
    plan = planned_rounds(schedule) if isinstance(schedule, list) else None
    if plan is None:
        return [], [f"run.json has no readable schedule ({str(schedule)[:80]!r}): rounds cannot be checked"]
    end = next((e for e in reversed(entries) if e.get("payload_type") == "run-end"), None)
    info = end.get("info") if isinstance(end, Mapping) and isinstance(end.get("info"), dict) else {}
    last = end.get("round") if isinstance(end, Mapping) and isinstance(end.get("round"), int) else 0
    if info.get("status") != "completed":
        last -= 1  # the round a failed or interrupted run stopped in is not judged
    applied: dict[int, set[str]] = {}
    for e in entries:
        pt, rnd = str(e.get("payload_type", "")), e.get("round")
        e_info = e.get("info") if isinstance(e.get("info"), dict) else {}
        if pt.startswith("release:") and isinstance(rnd, int) and e_info.get("applied", True) is not False:
            applied.setdefault(rnd, set()).add(pt)
    recorded = " ".join(str(w) for w in meta.get("warnings") or [])
    warnings = []
    for rnd, label, release in plan:
        if rnd > last:
            break
        if release not in applied.get(rnd, set()):
            said = f"round {rnd} " in recorded
            warnings.append(
                f"round {rnd} ({label}): no applied {release[len('release:') :]} release in the "
                "coordinator's ledger: the round released nothing"
                + ("" if said else " (and run.json does not warn about it)")
            )
    notes = [f"{min(last, len(plan))} of {len(plan)} planned rounds checked against the coordinator's releases"]
    return warnings, notes
