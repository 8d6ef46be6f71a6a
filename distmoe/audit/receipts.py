"""The audit's ``receipts`` check and who witnesses the run: without the parties, a coordinator's ledger proves nothing.

The coordinator signs its own ledger, so it can delete every entry of a round, re-chain and re-sign: the forgery
verifies. Only the parties hold witnesses it cannot forge: their own signed ledgers, or the small signed receipt
each party writes at run end (``distmoe.deploy.receipt``, ``distmoe.party.receipt``). A run is **verified** only
when every party of the roster (the parties whose ledger keys the coordinator ledger or ``run.json`` pins) is
witnessed by its ledger or by a receipt; otherwise the verdict is ``unverified`` (``distmoe.audit.result``).

Owns: ``check_receipts(run, pins) -> (Check, charges, witnessed, unwitnessed)`` and ``sessions(run)``. Each
receipt given must:

- be signed under the ledger key the key directory pins for its party (a party outside the roster, or another
  key, is a violation);
- name a session the coordinator ledger records (``sessions``: the run-start's run id, then the ``session`` of each
  ``run-resume`` entry: a resumed run's parties write one receipt per session, under that session's Flower run id),
  be the only receipt of its party for that session, and be judged against that session's entries only (from its
  run-start or run-resume entry to the next session's; every such span of a session id recorded twice, as a run
  resumed in process under the id it was interrupted under records it); a party that gives receipts gives one for
  every session whose entries instruct it (a withheld session's receipt is a violation, not a gap);
- hold a ``coordinator_head`` (the last instruction the party received) that is in the coordinator ledger with the
  same hash and is an instruction to that party: the chain commits to every entry before it, so a deletion,
  insertion or reordering up to that instruction is caught;
- agree with the coordinator's anchors of that party's replies: none beyond its ``ledger_head``, and the anchor at
  that seq (if any) with its hash; with the party's ledger given too, that ledger holds the receipt's head;
- have a release naming the party for every round it revealed unmask shares for (``unmasked``);
- name an owner policy whose sha256 is that of its canonical JSON, and a code pin unless that policy records the
  owner's opt-out (``allow_unpinned``, ``distmoe deploy supernode --unpinned``): a policy-bound party without a pin
  and without the opt-out ran code the owner never reviewed;
- with the party's ledger given, name the same policy digest and code pin as the ledger recorded in **this run's**
  setup (the ``key-advert`` ``out`` entries of the receipt's run, ``info.owner_policy``, ``info.code_pin``,
  ``distmoe.party.policy.ledger_facts``): a setup run under a weaker policy or other code than the receipt names,
  or a ledger without this run's setup, is a violation.

A party's largest receipt epsilon (its accountant carries over across sessions) is a lower bound on what it
spent, whatever the coordinator ledger holds: ``charges`` feed the ``epsilon`` check as the party ledgers' signed
charges do (``distmoe.audit.ledgers``).

Must not: import ``flwr``, read party data, or write anything.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, NamedTuple

from distmoe.audit.result import Check
from distmoe.audit.run import Run, included_of, info_of
from distmoe.deploy.receipt import ReceiptError, read_receipt
from distmoe.ledger import canonical_json

CHECK = "receipts"


def _roster(run: Run, pins: dict[str, list[tuple[str, str]]]) -> list[str]:
    names = set(pins)
    for r in run.releases:
        names.update(included_of(r))
    return sorted(names)


class Session(NamedTuple):
    """One session of the run in the coordinator ledger: its Flower run id and its entries' seqs ``[first, end)``,
    with ``also`` the further spans ``[a, b)`` recorded under the same id (a run resumed in process under the id it
    was interrupted under: its parties' one receipt of that id covers their entries of every span)."""

    run: str
    first: int
    end: float
    also: tuple[tuple[int, float], ...] = ()

    def holds(self, seq: Any) -> bool:
        return isinstance(seq, int) and any(a <= seq < b for a, b in ((self.first, self.end), *self.also))


def sessions(run: Run) -> list[Session]:
    """The run's sessions in ledger order: the run-start's (``info.session``, else its ``run``), then one per
    ``run-resume`` entry (its ``info.session``), a later span under an id already seen joined to that session's
    ``also``; empty when the ledger names no run."""
    first = info_of(run.start).get("session") or run.start.get("run")
    if first is None:
        return []
    starts = [(str(first), 0)]
    starts += [(str(info_of(e).get("session")), e["seq"]) for e in run.coord.entries
               if e.get("payload_type") == "run-resume" and isinstance(e.get("seq"), int) and e["seq"] > 0]
    out: dict[str, Session] = {}
    for i, (sid, a) in enumerate(starts):
        b = starts[i + 1][1] if i + 1 < len(starts) else math.inf
        s = out.get(sid)
        out[sid] = Session(sid, a, b) if s is None else s._replace(also=(*s.also, (a, b)))
    return list(out.values())


def _had(run: Run, s: Session, party: str) -> bool:
    """Whether session ``s`` sent ``party`` an instruction (then its receipt of ``s`` is due)."""
    return any(s.holds(e.get("seq")) and e.get("direction") == "out" and e.get("peer") == party
               for e in run.coord.entries)


def _anchors(run: Run, party: str, s: Session | None) -> list[tuple[int, str, Any]]:
    out = []
    for e in run.coord.entries:
        if s is not None and not s.holds(e.get("seq")):
            continue
        a = e.get("anchor")
        if isinstance(a, dict) and a.get("node") == party and isinstance(a.get("seq"), int):
            out.append((a["seq"], str(a.get("hash")), e.get("seq")))
    return out


def _judge(run: Run, body: dict[str, Any], s: Session | None, c: Check, where: str) -> None:
    """Judge one receipt against the entries of its session ``s`` (None: a ledger that names no run)."""
    party = body["party"]
    ch = body["coordinator_head"]
    if ch is not None:
        ce = run.coord.by_seq.get(ch["seq"])
        end = run.coord.entries[-1].get("seq") if run.coord.entries else -1
        if s is not None and ce is not None and not s.holds(ch["seq"]):
            c.fail(f"{where}: the last instruction {party} received in session {s.run} is coordinator#{ch['seq']}, "
                   f"outside that session's entries (from seq {s.first}): a receipt of another session")
        elif ce is None:
            c.fail(f"{where}: the last instruction {party} received is coordinator#{ch['seq']}, which the coordinator "
                   f"ledger does not hold (it ends at seq {end}): the coordinator ledger was cut")
        elif ce.get("hash") != ch["hash"]:
            c.fail(f"{where}: coordinator#{ch['seq']} has another hash than the head {party} signed: the coordinator "
                   "ledger was rewritten at or before that entry (deleted, inserted or reordered entries)")
        elif ce.get("direction") != "out" or ce.get("peer") != party:
            c.fail(f"{where}: coordinator#{ch['seq']} is not an instruction to {party}")
    head = body["ledger_head"]
    for seq, h, cseq in _anchors(run, party, s):
        if seq > head["seq"]:
            c.fail(f"{where}: coordinator#{cseq} anchors {party}'s head seq {seq}, beyond the receipt's final head "
                   f"seq {head['seq']} (a stale receipt, or an anchor the party never signed)")
        elif seq == head["seq"] and h != head["hash"]:
            c.fail(f"{where}: coordinator#{cseq} anchors {party}#{seq} with another hash than the receipt's")
    lf = run.parties.get(party)
    if lf is not None:
        pe = lf.by_seq.get(head["seq"])
        if pe is None or pe.get("hash") != head["hash"]:
            c.fail(f"{where}: {party}'s ledger given here does not hold the receipt's head seq {head['seq']}")
    released = {(r.get("round"), p) for r in run.releases for p in included_of(r)
                if s is None or s.holds(r.get("seq"))}
    for rnd in body["unmasked"]:
        if (rnd, party) not in released:
            c.fail(f"{where}: {party} revealed its unmask shares for round {rnd}, but no release of that round in "
                   f"session {s.run if s else '-'} of the coordinator ledger names it (a release deleted, or the "
                   "unmasking failed after the replies)")


def _digest(facts: Any) -> str | None:
    return facts.get("sha256") if isinstance(facts, dict) else None


def _judge_setup(run: Run, body: dict[str, Any], c: Check, where: str) -> None:
    """The receipt's owner policy and code pin: sound on their own, and those of this run's setup in the party's
    ledger when it is given."""
    party, pol, pin = body["party"], body["owner_policy"], body["code_pin"]
    if pol is not None:
        if hashlib.sha256(canonical_json(pol["policy"]).encode("ascii")).hexdigest() != pol["sha256"]:
            c.fail(f"{where}: the owner policy's sha256 is not that of the policy it names")
        elif pin is None and pol["policy"].get("allow_unpinned") is not True:
            c.fail(f"{where}: {party} ran without a code pin, and its owner policy {pol['sha256'][:16]} records no "
                   "opt-out (policy-allow-unpinned): code the owner never reviewed answered this run")
    lf = run.parties.get(party)
    if lf is None:
        return
    setups = [e for e in lf.entries if e.get("payload_type") == "key-advert" and e.get("direction") == "out"
              and str(e.get("run")) == body["run"]]
    if not setups:
        c.fail(f"{where}: {party}'s ledger given here holds no setup (key-advert) of run {body['run']!r}: the ledger "
               "was cut, or is another run's, so the receipt's owner policy and code pin are unwitnessed")
    for e in setups:
        info = e.get("info") if isinstance(e.get("info"), dict) else {}
        got_pol, got_pin = _digest(info.get("owner_policy")), info.get("code_pin")
        if got_pol != _digest(pol):
            c.fail(f"{where}: {party}#{e.get('seq')} set this run up under owner policy {str(got_pol)[:16]}, the "
                   f"receipt names {str(_digest(pol))[:16]}: the party did not run under the policy its receipt names")
        if got_pin != pin:
            c.fail(f"{where}: {party}#{e.get('seq')} set this run up under code pin {str(got_pin)[:16]}, the receipt "
                   f"names {str(pin)[:16]}: the party's code changed within the run")


def check_receipts(run: Run, pins: dict[str, list[tuple[str, str]]]
                   ) -> tuple[Check, dict[str, tuple[float, str]], dict[str, str], list[str]]:
    """The ``receipts`` check, the receipts' signed charges (party -> (largest epsilon, where)), the witnessed
    roster parties (-> ``ledger`` or ``receipt``) and the unwitnessed ones."""
    c = Check(CHECK)
    charges: dict[str, tuple[float, str]] = {}
    witnessed = {p: "ledger" for p in run.parties}
    by_run = {s.run: s for s in sessions(run)}
    seen: dict[tuple[str, str | None], str] = {}  # (party, session) -> the receipt's file name
    judged: dict[str, list[str]] = {}  # party -> its receipts' file names; a party with a finding is dropped
    bad: set[str] = set()
    for path, obj in run.receipts:
        where = path.name
        body = obj.get("body") if isinstance(obj, dict) else None
        party = body.get("party") if isinstance(body, dict) else None
        if not isinstance(party, str) or party not in pins:
            c.fail(f"{where}: a receipt of {party!r}, a party whose key is not in the run's key directory")
            continue
        key = next((k for w, k in pins[party] if "key-advert" in w), pins[party][0][1])
        try:
            body = read_receipt(obj, key)
        except ReceiptError as exc:
            c.fail(f"{where}: {party}: {exc}")
            bad.add(party)
            continue
        before = len(c.findings)
        s = by_run.get(body["run"]) if by_run else None
        if by_run and s is None:
            c.fail(f"{where}: a receipt of run {body['run']!r}, a session the coordinator ledger does not record "
                   f"(its sessions: {', '.join(by_run)}): a receipt of another run")
            bad.add(party)
            continue
        if (party, body["run"]) in seen:
            c.fail(f"{where}: a second receipt for {party} of session {body['run']} (the first: "
                   f"{seen[party, body['run']]})")
            bad.add(party)
            continue
        seen[party, body["run"]] = where
        _judge(run, body, s, c, where)
        _judge_setup(run, body, c, where)
        eps = float(body["epsilon"]) if math.isfinite(float(body["epsilon"])) else math.inf
        if eps >= charges.get(party, (-1.0, ""))[0]:
            charges[party] = (eps, f"receipt {where}")
        judged.setdefault(party, []).append(where)
        if len(c.findings) > before:
            bad.add(party)
            continue
        pin = f", code pin {body['code_pin'][:16]}" if body["code_pin"] else ", no code pin"
        pol = _digest(body["owner_policy"])
        pin += f", owner policy {pol[:16]}" if pol else ", no owner policy"
        c.note(f"{party}: receipt {where} matches session {body['run']} of the coordinator ledger (charged epsilon "
               f"{eps:.4f}{pin})")
    for party in sorted(judged):
        for s in by_run.values():
            if (party, s.run) not in seen and _had(run, s, party):
                c.fail(f"{party}: no receipt of session {s.run} (coordinator entries from seq {s.first} instruct "
                       f"{party}), though its receipts of other sessions are given: this one was withheld or never "
                       "written")
                bad.add(party)
        if party not in bad:
            witnessed.setdefault(party, "receipt")
    roster = _roster(run, pins)
    unwitnessed = [p for p in roster if p not in witnessed]
    if unwitnessed:
        c.note("not witnessed (no party ledger, no receipt): " + ", ".join(unwitnessed) + ": the run is UNVERIFIED; "
               "a coordinator holding its key can rewrite its ledger into any self-consistent story")
    if not run.receipts:
        c.skip("no receipts given" + ("" if unwitnessed else "; every party's ledger was given"))
    return c, charges, {p: w for p, w in witnessed.items() if p in roster}, unwitnessed
