"""The audit's checks that the coordinator's ledger is whole: nothing cut off, rewritten or left out.

Owns: ``check_run_end``, ``check_heads`` and ``check_coverage`` (each ``-> (findings, notes)``;
``distmoe.audit.engine`` turns them into the checks ``run-end``, ``coordinator-heads`` and
``release-coverage``), and ``party_charges`` / ``fold_party_charges``, which make each party's epsilon the
larger of the coordinator's figure and the party's own signed charges (in the ``epsilon`` check).

Why: the coordinator holds its own ledger key, so alone its ledger proves nothing about what is *not*
in it. Dropping its tail (``head -n``, no key needed) or deleting a release and re-signing the chain
with the run's key both left a ledger that verifies and charges epsilon = 0. The witnesses are the
parties: every instruction carries the coordinator's ledger head after its own "out" entry
(``distmoe.wire.server_guard``), and each party records that head in the "in" entry of its own signed
ledger (``anchor`` with node ``coordinator``: ``distmoe.wire.party_guard``).

- ``run-end``: the coordinator ledger ends with a ``run-end`` entry (written by
  ``distmoe.coordinator.plane.close`` however the run ended: ``info.status`` is ``completed``,
  ``failed``, ``stopped`` or ``interrupted``, the last for Ctrl-C). A ledger without it is incomplete:
  a run that was killed without closing (or is still running), or a ledger cut after its last entry. It
  fails: resume the run (``--resume``), which continues and closes the same ledger. A run that ended
  ``failed`` or ``interrupted`` is judged on what it released (the status is reported).
- ``coordinator-heads``: every "in" entry of every party ledger carries a coordinator head; that head
  is in the coordinator ledger (same seq, same hash: a cut ledger no longer holds it, a re-signed
  rewrite has other hashes from the first change on), it is the "out" entry of the very instruction the
  party logged (payload type and sha256), and each party's heads increase (nothing reordered).
- ``release-coverage``: a round with unmask replies (accepted by the coordinator, or sent according to a
  party's ledger) has a release entry; each DP masked input a party sent that the coordinator logged
  as received is in a release of its round and type that names the party, with the noise multiplier
  the party used.
- party charges: each party's own signed cumulative epsilon (``dp.epsilon`` of its "out" entries, from
  its accountant) is a lower bound on what it spent, whatever the coordinator's ledger says.

What it cannot see: without party ledgers, a coordinator that holds its key can rewrite its ledger
into any self-consistent story (only a cut without the key is caught, by ``run-end``; the parties' signed
receipts, ``distmoe.audit.receipts``, witness it instead, and without either the verdict is unverified); a round whose
unmasking honestly failed after replies (more dropouts during unmasking than the threshold allows)
fails ``release-coverage`` like a deleted release (``docs/privacy.md`` §6).

Must not: import ``flwr``, read anything but the ledger entries it is given, or write anything.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from distmoe.rundir import COORDINATOR

CHECKS = ("run-end", "coordinator-heads", "release-coverage")
END_STATUSES = ("completed", "failed", "stopped", "interrupted")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

Entries = Sequence[Mapping[str, Any]]


def _info(e: Mapping[str, Any]) -> Mapping[str, Any]:
    i = e.get("info")
    return i if isinstance(i, dict) else {}


def _where(name: str, e: Mapping[str, Any]) -> str:
    rnd = e.get("round")
    return f"{name}#{e.get('seq')} {e.get('payload_type')}" + (f" (round {rnd})" if rnd is not None else "")


def _by_seq(entries: Entries) -> dict[int, Mapping[str, Any]]:
    out: dict[int, Mapping[str, Any]] = {}
    for e in entries:
        if isinstance(e.get("seq"), int):
            out.setdefault(e["seq"], e)
    return out


# ------------------------------------------------------------------------------------------------ run-end
def check_run_end(coord: Entries) -> tuple[list[str], list[str]]:
    """The coordinator ledger ends with a ``run-end`` entry (module docstring)."""
    if not coord:
        return ["the coordinator ledger is empty: no run-end entry"], []
    last = coord[-1]
    ends = [e for e in coord if e.get("payload_type") == "run-end"]
    if last.get("payload_type") != "run-end":
        tail = f"it ends at {_where(COORDINATOR, last)}"
        if ends:
            return [
                f"entries follow the last run-end ({_where(COORDINATOR, ends[-1])}) and no run-end closes them; "
                f"{tail}: the run is incomplete"
            ], []
        return [
            f"the coordinator ledger has no run-end entry; {tail}: the run did not finish (killed, or still "
            "running) or the ledger was cut; resume the run to close it (an incomplete ledger cannot back "
            "the epsilon it shows)"
        ], []
    status = _info(last).get("status")
    if status not in END_STATUSES:
        return [f"{_where(COORDINATOR, last)}: status {status!r} is not one of {', '.join(END_STATUSES)}"], []
    notes = [f"the coordinator ledger is closed by {_where(COORDINATOR, last)}: status {status}"]
    if status != "completed":
        notes.append(f"the run ended {status}: the audit judges what it released up to its end")
    return [], notes


# ---------------------------------------------------------------------------------------- coordinator heads
def check_heads(coord: Entries, parties: Mapping[str, Entries]) -> tuple[list[str], list[str]]:
    """Every coordinator head a party recorded is in the coordinator ledger, as that instruction, in order."""
    by_seq = _by_seq(coord)
    end = coord[-1].get("seq") if coord else -1
    findings: list[str] = []
    notes: list[str] = []
    for name, entries in sorted(parties.items()):
        matched, last = 0, -1
        for e in entries:
            if e.get("direction") != "in":
                continue
            w = _where(name, e)
            a = e.get("anchor")
            if not (
                isinstance(a, dict)
                and a.get("node") == COORDINATOR
                and isinstance(a.get("seq"), int)
                and not isinstance(a.get("seq"), bool)
                and isinstance(a.get("hash"), str)
                and _HEX64.match(a["hash"])
            ):
                findings.append(f"{w}: records no coordinator ledger head")
                continue
            seq = a["seq"]
            if seq <= last:
                findings.append(f"{w}: coordinator head seq {seq} after seq {last}: entries were reordered")
            last = max(last, seq)
            ce = by_seq.get(seq)
            if ce is None:
                findings.append(
                    f"{w}: coordinator head seq {seq} is not in the coordinator ledger (it ends at seq "
                    f"{end}): the coordinator ledger was cut"
                )
                continue
            if ce.get("hash") != a["hash"]:
                findings.append(
                    f"{w}: coordinator#{seq} has another hash than the head {name} recorded: the "
                    "coordinator ledger was rewritten"
                )
                continue
            if (
                ce.get("direction") != "out"
                or ce.get("payload_type") != e.get("payload_type")
                or ce.get("sha256") != e.get("sha256")
            ):
                findings.append(
                    f"{w}: coordinator#{seq} ({ce.get('direction')} {ce.get('payload_type')}) is not the "
                    f"instruction {name} received"
                )
                continue
            matched += 1
        notes.append(f"{name}: {matched} coordinator heads found in the coordinator ledger, in order")
    return findings, notes


# ---------------------------------------------------------------------------------------- release coverage
def _releases(coord: Entries) -> dict[int, list[Mapping[str, Any]]]:
    out: dict[int, list[Mapping[str, Any]]] = {}
    for e in coord:
        if str(e.get("payload_type", "")).startswith("release:") and isinstance(e.get("round"), int):
            out.setdefault(e["round"], []).append(e)
    return out


def check_coverage(coord: Entries, parties: Mapping[str, Entries]) -> tuple[list[str], list[str]]:
    """Unmask replies imply a release; a DP input the coordinator received is in a release naming the party."""
    releases = _releases(coord)
    findings: list[str] = []
    unmasked: dict[int, list[str]] = {}  # round -> where the unmask replies are
    received: dict[tuple[str, int], int] = {}  # (party, party seq) -> coordinator seq that logged it
    for e in coord:
        if e.get("direction") != "in" or e.get("verdict") != "accepted":
            continue
        if e.get("payload_type") == "unmask-response" and isinstance(e.get("round"), int):
            unmasked.setdefault(e["round"], []).append(_where(COORDINATOR, e))
        a = e.get("anchor")
        if isinstance(a, dict) and isinstance(a.get("seq"), int):
            received[(str(a.get("node")), a["seq"])] = e.get("seq")
    n_dp = 0
    for name, entries in sorted(parties.items()):
        for e in entries:
            if e.get("direction") != "out" or e.get("verdict") != "accepted" or not isinstance(e.get("round"), int):
                continue
            rnd, pt = e["round"], str(e.get("payload_type"))
            if pt == "unmask-response":
                unmasked.setdefault(rnd, []).append(_where(name, e))
            dp = e.get("dp")
            if not isinstance(dp, dict) or not pt.startswith("masked-input:"):
                continue
            n_dp += 1
            cseq = received.get((name, e.get("seq")))
            if cseq is None:
                continue  # never logged as received (a straggler's late reply): the party's own charge counts
            kind = "release:" + pt.split(":", 1)[1]
            rel = [r for r in releases.get(rnd, []) if r.get("payload_type") == kind]
            mine = [r for r in rel if name in (_info(r).get("included") or [])]
            if not mine:
                findings.append(
                    f"{_where(name, e)}: a DP input the coordinator received (coordinator#{cseq}) is in "
                    f"no {kind} entry of round {rnd} naming {name}"
                )
                continue
            z_party, z_rel = dp.get("noise_multiplier"), (mine[-1].get("dp") or {}).get("noise_multiplier")
            if (
                isinstance(z_party, (int, float))
                and isinstance(z_rel, (int, float))
                and not math.isclose(float(z_party), float(z_rel), rel_tol=1e-9)
            ):
                findings.append(
                    f"{_where(name, e)}: noise multiplier {z_party} but coordinator#{mine[-1].get('seq')} "
                    f"records {z_rel}"
                )
    for rnd, where in sorted(unmasked.items()):
        if rnd not in releases:
            findings.append(
                f"round {rnd}: {len(where)} unmask replies ({', '.join(where[:3])}"
                f"{', ...' if len(where) > 3 else ''}) but no release entry: a release was deleted, or "
                "the unmasking failed after the replies"
            )
    notes = [
        f"{len(unmasked)} rounds with unmask replies, each with a release; {n_dp} DP inputs in the party "
        f"ledgers checked against the releases"
    ]
    if not parties:
        notes.append("no party ledgers: only the coordinator's own unmask replies are checked")
    return findings, notes


# ------------------------------------------------------------------------------------------ party charges
def party_charges(parties: Mapping[str, Entries]) -> dict[str, tuple[float, str]]:
    """Per party: the largest cumulative epsilon its accountant signed (``dp.epsilon`` of an "out" entry, sent
    or blocked: the charge is made before anything leaves) and where."""
    out: dict[str, tuple[float, str]] = {}
    for name, entries in parties.items():
        for e in entries:
            dp = e.get("dp")
            eps = dp.get("epsilon") if isinstance(dp, dict) else None
            if e.get("direction") != "out" or isinstance(eps, bool) or not isinstance(eps, (int, float)):
                continue
            eps = float(eps) if math.isfinite(float(eps)) else math.inf
            if name not in out or eps > out[name][0]:
                out[name] = (eps, _where(name, e))
    return out


def fold_party_charges(
    table: dict[str, dict[str, Any]], charges: Mapping[str, tuple[float, str]], budget: float
) -> tuple[list[str], list[str]]:
    """Make each row's ``epsilon`` the larger of the coordinator's figure and the party's signed charge."""
    findings: list[str] = []
    notes: list[str] = []
    for p, row in table.items():
        row["coordinator_epsilon"] = row["epsilon"]
        eps, where = charges.get(p, (None, ""))
        row["party_epsilon"] = eps
        if eps is None or eps <= row["epsilon"]:
            continue
        row["epsilon"] = eps
        notes.append(
            f"{p}: its own signed charges ({where}: epsilon {eps:.4f}) exceed the coordinator's figure "
            f"{row['coordinator_epsilon']:.4f}; epsilon is the larger"
        )
        if eps > budget:
            row["status"] = "fail"
            findings.append(
                f"{p}: its own signed charges reach epsilon {eps:.4f} ({where}), over the budget {budget:g}"
            )
    return findings, notes
