"""The receipts of a resumed run: one receipt per party and session, each judged against its own session's entries.

A resumed deployed run has one session per Flower run: the first under the run id the coordinator ledger's
run-start entry carries, each later one under the ``session`` its ``run-resume`` entry records, and each owner's
party writes one signed receipt per session (``<party>-<session>.json``). The runs here are real signed ledgers
(``distmoe.ledger.Ledger``) of two sessions and two parties, written as the coordinator and the parties write them,
and the receipts are built from each party's own ledger and signed with its ledger key, as the party does
(``distmoe.party.receipt.receipt_body``, ``distmoe.deploy.receipt.sign_receipt``). Attacks: a receipt of a session
the coordinator does not record (signed by the owner's own key), the same session's receipt given twice, a
session's receipt withheld, and a coordinator ledger cut in its second session.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from distmoe.audit import audit_run
from distmoe.audit.integrity import pins
from distmoe.audit.receipts import check_receipts, sessions
from distmoe.audit.run import Run
from distmoe.deploy.receipt import sign_receipt
from distmoe.ledger import Ledger, describe_payload, generate_signing_key, load_signing_key
from distmoe.party.receipt import receipt_body

PARTIES = ("party-0", "party-1")
RUN, SESSION2 = "7001", "7002"  # the first session's Flower run id (the run's) and the resumed session's
DELTA, BUDGET = 1e-6, 8.0


def _resumed_run(root: Path, first: str | None = None, second: str = SESSION2, redo: tuple[int, ...] = (1, 2)) -> Path:
    """A run interrupted after round 1 and resumed (rounds 1 and 2 again) under ``SESSION2``; each party's receipts
    of both sessions under ``root/receipts``. The coordinator's entries carry the run id, the parties' their
    session's (as in a deployment). ``first``: the first session's Flower run id, recorded in the run-start entry,
    when it is not the run id (a resumed run whose interrupted session never opened its ledger); None: a ledger
    that records no session at run-start (the run id is the first session's). ``second``: the resumed session's id
    (the first's again: a resume in process under the id it interrupted); ``redo``: the rounds it runs."""
    run = root / "run"
    coord = Ledger(run / "ledger" / "coordinator.jsonl", generate_signing_key(root / "keys" / "coordinator.pem"))
    (run / "ledger" / "coordinator.pub").write_text(coord.public_key_hex + "\n")
    led = {p: Ledger(root / p / f"{p}.jsonl", generate_signing_key(root / "keys" / f"{p}.pem")) for p in PARTIES}
    eps = dict.fromkeys(PARTIES, 0.0)

    def entry(ptype: str, rnd: int, **kw) -> dict:
        return {"round": rnd, "phase": "stats", "payload_type": ptype, "keys": [], "shapes": {},
                **describe_payload(f"{ptype}/{rnd}/{kw.get('peer')}".encode()), "verdict": "accepted", **kw}

    def exchange(session: str, rnd: int, ask: str, answer: str, dp: bool = False, info: dict | None = None) -> None:
        for p in PARTIES:
            ce = coord.append(run=RUN, **entry(ask, rnd, direction="out", peer=p))
            led[p].append(run=session, **entry(ask, rnd, direction="in", peer="coordinator",
                                               anchor={"node": "coordinator", "seq": ce["seq"], "hash": ce["hash"]}))
            if dp:
                eps[p] += 1.0  # the party's accountant carries over across sessions
            pe = led[p].append(run=session, **entry(answer, rnd, direction="out", peer="coordinator",
                                                    dp={"epsilon": eps[p], "budget": BUDGET} if dp else None))
            coord.append(run=RUN, **entry(answer, rnd, direction="in", peer=p, info={
                **(info or {}), **({"ledger_public_key": led[p].public_key_hex} if answer == "key-advert" else {})},
                anchor={"node": p, "seq": pe["seq"], "hash": pe["hash"]}))

    def session(sid: str, rounds: tuple[int, ...]) -> None:
        exchange(sid, 0, "setup-request", "key-advert")
        for rnd in rounds:
            exchange(sid, rnd, "stats-instruction", "masked-input:router-stats", dp=True)
            exchange(sid, rnd, "unmask-request", "unmask-response")
            coord.append(run=RUN, **entry("release:router-stats", rnd, direction="in", peer="all",
                                          info={"included": list(PARTIES)}))
        for p in PARTIES:  # the party refreshes its receipt after every reply: this is its last
            entries = [json.loads(x) for x in led[p].path.read_text().splitlines()]
            body = receipt_body(entries, sid, p, DELTA, BUDGET, None)
            (root / "receipts").mkdir(exist_ok=True)
            (root / "receipts" / f"{p}-{sid}.json").write_text(json.dumps(sign_receipt(
                body, load_signing_key(root / "keys" / f"{p}.pem"))))

    coord.append(run=RUN, **entry("policy", 0, phase="run-start", direction="out", peer="all",
                                  info={"session": first} if first else {}))
    session(first or RUN, (1,))
    coord.append(run=RUN, **entry("run-end", 1, phase="run-end", direction="out", peer="all",
                                  info={"status": "interrupted"}))
    coord.append(run=RUN, **entry("run-resume", 0, phase="run-resume", direction="out", peer="all",
                                  info={"session": second, "epoch": 1}))
    session(second, redo)
    coord.append(run=RUN, **entry("run-end", 2, phase="run-end", direction="out", peer="all",
                                  info={"status": "completed"}))
    (run / "run.json").write_text(json.dumps({"run_id": RUN, "status": "completed", "config": {},
                                              "resumes": [{"epoch": 1, "session": second}]}))
    return run


def _receipts(run: Path, *names: str) -> list[Path]:
    return [run.parent / "receipts" / f"{n}.json" for n in names]


ALL = tuple(f"{p}-{s}" for p in PARTIES for s in (RUN, SESSION2))


def _judge(run: Path, files: list[Path]):
    result = audit_run(run, party_ledgers=[], receipt_files=files)  # the owners give receipts, not their ledgers
    return result.check("receipts"), result


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> Path:
    return _resumed_run(tmp_path_factory.mktemp("resumed"))


def test_the_sessions_are_the_run_start_and_each_run_resume(resumed):
    got = sessions(Run(resumed, [], None))
    assert [s.run for s in got] == [RUN, SESSION2]
    assert got[0].first == 0 and got[0].end == got[1].first and got[1].end == float("inf")


def test_one_receipt_per_session_witnesses_a_resumed_run(resumed):
    check, result = _judge(resumed, _receipts(resumed, *ALL))
    assert check.status == "pass", check.findings
    assert result.witnessed == dict.fromkeys(PARTIES, "receipt") and result.unwitnessed == []
    run = Run(resumed, [], None, _receipts(resumed, *ALL))
    _, charges, _, _ = check_receipts(run, pins(run))  # what the epsilon check folds in
    assert charges["party-0"] == (3.0, f"receipt party-0-{SESSION2}.json")  # the largest: the last session's


def test_a_receipt_of_a_session_the_coordinator_does_not_record_is_a_violation(resumed, tmp_path):
    """The owner's own key signs a receipt of a foreign session (another run of the same owner, or a forgery): the
    audit judges it against none of this run's sessions and fails."""
    obj = json.loads(_receipts(resumed, f"party-0-{SESSION2}")[0].read_text())
    body = {k: v for k, v in obj["body"].items() if k != "public_key"}
    forged = tmp_path / "party-0-9999.json"
    forged.write_text(json.dumps(sign_receipt({**body, "run": "9999"},
                                              load_signing_key(resumed.parent / "keys" / "party-0.pem"))))
    check, result = _judge(resumed, [*_receipts(resumed, *ALL), forged])
    assert check.status == "fail" and "party-0" not in result.witnessed
    assert any("a receipt of run '9999', a session the coordinator ledger does not record" in f
               for f in check.findings), check.findings


def test_two_receipts_of_one_session_are_a_violation(resumed, tmp_path):
    dup = tmp_path / "copy.json"
    dup.write_text(_receipts(resumed, f"party-1-{RUN}")[0].read_text())
    check, result = _judge(resumed, [*_receipts(resumed, *ALL), dup])
    assert check.status == "fail" and "party-1" not in result.witnessed
    assert any(f"a second receipt for party-1 of session {RUN}" in f for f in check.findings), check.findings


@pytest.mark.parametrize("withheld", [RUN, SESSION2])
def test_a_withheld_sessions_receipt_is_a_violation(resumed, withheld):
    files = _receipts(resumed, *(n for n in ALL if n != f"party-0-{withheld}"))
    check, result = _judge(resumed, files)
    assert check.status == "fail" and "party-0" not in result.witnessed
    assert any(f"party-0: no receipt of session {withheld}" in f for f in check.findings), check.findings


def test_a_cut_second_session_is_caught_by_its_receipts(resumed, tmp_path):
    """The coordinator cuts its ledger within the second session (the first session's receipts still match): each
    second-session receipt names a last instruction the ledger no longer holds."""
    run = tmp_path / "run"
    shutil.copytree(resumed, run)
    shutil.copytree(resumed.parent / "receipts", tmp_path / "receipts")
    path = run / "ledger" / "coordinator.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-9]))  # round 2 of the second session and the run end
    check, _ = _judge(run, _receipts(run, *ALL))
    assert check.status == "fail"
    for p in PARTIES:
        assert any(f.startswith(f"{p}-{SESSION2}.json:") and "the coordinator ledger was cut" in f
                   for f in check.findings), check.findings
        assert not any(f.startswith(f"{p}-{RUN}.json:") for f in check.findings), check.findings


def test_a_first_session_receipt_is_judged_against_its_own_session_only(resumed, tmp_path):
    """The first session's receipt heads precede the second session's anchors: judged against the whole ledger it
    would look stale; judged against its session it matches. Presented as the second session's, it is caught."""
    obj = json.loads(_receipts(resumed, f"party-0-{RUN}")[0].read_text())
    body = {k: v for k, v in obj["body"].items() if k != "public_key"}
    relabelled = tmp_path / f"party-0-{SESSION2}.json"
    relabelled.write_text(json.dumps(sign_receipt({**body, "run": SESSION2},
                                                  load_signing_key(resumed.parent / "keys" / "party-0.pem"))))
    files = [*_receipts(resumed, *(n for n in ALL if n != f"party-0-{SESSION2}")), relabelled]
    check, _ = _judge(resumed, files)
    assert check.status == "fail"
    assert any("outside that session's entries" in f for f in check.findings), check.findings


def test_the_first_sessions_id_recorded_at_run_start_names_its_receipts(tmp_path):
    """The run-start entry records its session's Flower run id: where it is not the run id (the interrupted session
    never opened the ledger), that session's receipts are accepted and a receipt under the run id is not."""
    run = _resumed_run(tmp_path, first="7000")
    assert [s.run for s in sessions(Run(run, [], None))] == ["7000", SESSION2]
    check, result = _judge(run, _receipts(run, *(f"{p}-{s}" for p in PARTIES for s in ("7000", SESSION2))))
    assert check.status == "pass" and result.witnessed == dict.fromkeys(PARTIES, "receipt"), check.findings
    obj = json.loads(_receipts(run, "party-0-7000")[0].read_text())
    body = {k: v for k, v in obj["body"].items() if k != "public_key"}
    (tmp_path / "receipts" / "as-run.json").write_text(json.dumps(sign_receipt(
        {**body, "run": RUN}, load_signing_key(tmp_path / "keys" / "party-0.pem"))))
    check, _ = _judge(run, [*_receipts(run, "party-0-" + SESSION2, "as-run")])
    assert check.status == "fail" and any(f"a receipt of run '{RUN}', a session the coordinator ledger does not "
                                          "record" in f for f in check.findings), check.findings


def test_a_resume_under_the_interrupted_sessions_id_is_judged_against_both_of_its_spans(tmp_path):
    """A run resumed in process under the run id it was interrupted under (``bench_files.run_prepared``, the resume
    tests: the transport's run id is the caller's) records two sessions of one id: each party's one receipt of that
    id covers its entries of both (round 1, kept by the checkpoint, and round 2 after the resume), so the audit judges
    it against both spans of the coordinator ledger (judged against the last span only, round 1's unmasking named no
    release and an honest run failed)."""
    run = _resumed_run(tmp_path, second=RUN, redo=(2,))
    assert [s.run for s in sessions(Run(run, [], None))] == [RUN]
    check, result = _judge(run, _receipts(run, *(f"{p}-{RUN}" for p in PARTIES)))
    assert check.status == "pass" and result.witnessed == dict.fromkeys(PARTIES, "receipt"), check.findings
