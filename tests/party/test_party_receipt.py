"""The party's run receipt (``distmoe.party.receipt``): the facts of its own ledger, for one run."""

from __future__ import annotations

import json

from distmoe.deploy.receipt import read_receipt
from distmoe.ledger import Ledger, describe_payload, generate_signing_key, public_key_hex
from distmoe.party.receipt import receipt_body


def _ledger(tmp_path):
    key = generate_signing_key(tmp_path / "p.pem")
    led = Ledger(tmp_path / "p.jsonl", key)
    d = describe_payload(b"x")

    def add(run, rnd, direction, ptype, **kw):
        return led.append(run=run, round=rnd, phase="stats", direction=direction, payload_type=ptype, keys=[],
                          shapes={}, **d, verdict=kw.pop("verdict", "accepted"), **kw)

    add("old", 1, "in", "stats-instruction", anchor={"node": "coordinator", "seq": 3, "hash": "c" * 64})
    add("old", 1, "out", "masked-input:router-stats", dp={"epsilon": 5.0, "budget": 8.0})
    add("r1", 2, "in", "stats-instruction", anchor={"node": "coordinator", "seq": 7, "hash": "d" * 64})
    add("r1", 2, "out", "masked-input:router-stats", dp={"epsilon": 6.5, "budget": 7.0})
    add("r1", 2, "in", "unmask-request", anchor={"node": "coordinator", "seq": 11, "hash": "e" * 64})
    add("r1", 2, "out", "unmask-response")
    add("r1", 3, "in", "eval-instruction", anchor={"node": "coordinator", "seq": 15, "hash": "f" * 64})
    last = add("r1", 3, "out", "masked-input:eval", dp={"epsilon": 7.25, "budget": 7.0})
    return key, [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()], last


def test_the_body_is_this_runs_facts_of_the_party_ledger(tmp_path):
    key, entries, last = _ledger(tmp_path)
    body = receipt_body(entries, "r1", "party-0", 1e-6, 8.0, "pin-digest")
    assert body["ledger_head"] == {"seq": last["seq"], "hash": last["hash"]}  # the head the coordinator anchors
    assert body["coordinator_head"] == {"seq": 15, "hash": "f" * 64}  # the last instruction received
    assert body["epsilon"] == 7.25 and body["budget"] == 7.0  # the accountant's cumulative charge, not the old run's
    assert body["charged"] == [[2, "router-stats"], [3, "eval"]] and body["unmasked"] == [2]
    assert body["code_pin"] == "pin-digest"


def test_a_signed_body_verifies_under_the_party_key(tmp_path):
    from distmoe.deploy.receipt import sign_receipt

    key, entries, _ = _ledger(tmp_path)
    obj = sign_receipt(receipt_body(entries, "r1", "party-0", 1e-6, 8.0, None), key)
    assert read_receipt(json.loads(json.dumps(obj)), public_key_hex(key))["party"] == "party-0"


def _whole(path, run):
    """The facts folded over every line of the ledger file, as a receipt computed from scratch."""
    entries = []
    for raw in path.read_bytes().split(b"\n"):
        if raw.strip():
            try:
                e = json.loads(raw)
            except ValueError:
                continue
            if isinstance(e, dict):
                entries.append(e)
    return receipt_body(entries, run, "party-0", 1e-6, 8.0, None)


def _rounds(led, run, start, n, d):
    """``n`` secure rounds' worth of entries (instruction in, masked input out, unmask in and out), run ``run``."""
    for r in range(start, start + n):
        led.append(run=run, round=r, phase="sft", direction="in", payload_type="sft-instruction", keys=[],
                   shapes={}, **d, verdict="accepted", anchor={"node": "coordinator", "seq": 4 * r, "hash": "a" * 64})
        eps = 1e300 if r == 7 else 0.5 * r  # the largest charge comes early
        led.append(run=run, round=r, phase="sft", direction="out", payload_type="masked-input:update", keys=[],
                   shapes={}, **d, verdict="accepted", dp={"epsilon": eps, "budget": 100.0 - r})
        led.append(run=run, round=r, phase="sft", direction="in", payload_type="unmask-request", keys=[],
                   shapes={}, **d, verdict="accepted")
        led.append(run=run, round=r, phase="sft", direction="out", payload_type="unmask-response", keys=[],
                   shapes={}, **d, verdict="accepted" if r % 3 else "rejected: test")


def test_the_carried_receipt_after_every_reply_equals_the_one_folded_over_the_whole_ledger(tmp_path):
    from distmoe.party.receipt import refresh_facts

    key, _, _ = _ledger(tmp_path)  # an older run's entries and r1's before this run's
    led, d = Ledger(tmp_path / "p.jsonl", key), describe_payload(b"y")
    path, state = tmp_path / "p.jsonl", tmp_path / "state"
    for start in range(1, 30, 3):
        _rounds(led, "r2", start, 3, d)
        _rounds(led, "other", start, 1, d)  # another run's entries in between count for the head only
        facts, _ = refresh_facts(path, state, "r2", key)
        assert facts.body("party-0", 1e-6, 8.0, None, None) == _whole(path, "r2")
    body = facts.body("party-0", 1e-6, 8.0, None, None)
    assert body["epsilon"] == 1e300 and body["budget"] == 100.0 - 30 and len(body["charged"]) == 30
    # a second run's receipt in the same ledger carries its own state
    facts, _ = refresh_facts(path, tmp_path / "state-r1", "r1", key)
    assert facts.body("party-0", 1e-6, 8.0, None, None) == _whole(path, "r1")


def test_the_receipts_per_reply_reading_does_not_grow_with_the_ledger(tmp_path):
    from distmoe.party.receipt import CARRY_EVERY, refresh_facts

    key, _, _ = _ledger(tmp_path)
    led, d = Ledger(tmp_path / "p.jsonl", key), describe_payload(b"y")
    path, state = tmp_path / "p.jsonl", tmp_path / "state"
    read = []
    for r in range(1, 201):
        _rounds(led, "r2", r, 1, d)
        read.append(refresh_facts(path, state, "r2", key)[1])
    # the whole (short) ledger until CARRY_EVERY lines are folded, then never more than the round's 4 entries and
    # the fewer than CARRY_EVERY lines since the state was last carried: at round 200 as at round 10
    assert read[:6] == [12, 16, 20, 24, 28, 32]
    assert max(read[100:]) == max(read[10:100]) <= 4 + CARRY_EVERY and min(read[10:]) == 4
    assert refresh_facts(path, state, "r2", key)[1] < CARRY_EVERY  # no new entry: only what is not carried yet


def test_an_edited_or_mismatched_receipt_state_is_never_trusted(tmp_path):
    from distmoe.party.receipt import refresh_facts

    key, _, _ = _ledger(tmp_path)
    led, d = Ledger(tmp_path / "p.jsonl", key), describe_payload(b"y")
    path, state = tmp_path / "p.jsonl", tmp_path / "state"
    _rounds(led, "r2", 1, 10, d)  # more than CARRY_EVERY lines: the state is carried
    refresh_facts(path, state, "r2", key)
    n_lines = len(path.read_bytes().splitlines())
    # lower the carried epsilon, keeping the old signature: ignored, the whole ledger is folded again
    sig, payload = state.read_bytes().split(b"\n", 1)
    state.write_bytes(sig + b"\n" + payload.replace(b'"eps":1e+300', b'"eps":0.1'))
    facts, read = refresh_facts(path, state, "r2", key)
    assert read == n_lines and facts.eps == 1e300
    # a state signed by another key (another party's): ignored
    refresh_facts(path, state, "r2", generate_signing_key(tmp_path / "other.pem"))
    facts, read = refresh_facts(path, state, "r2", key)
    assert read == n_lines and facts.body("party-0", 1e-6, 8.0, None, None) == _whole(path, "r2")
    # the ledger no longer holds the line the state ends after (rewritten): folded again from the start
    raw = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(raw[:-1]) + raw[-1].replace(b'"accepted"', b'"rejected: else"'))
    facts, read = refresh_facts(path, state, "r2", key)
    assert read == n_lines and facts.body("party-0", 1e-6, 8.0, None, None) == _whole(path, "r2")


def test_a_trailing_line_without_its_newline_counts_as_in_a_fresh_fold_but_is_not_carried(tmp_path):
    from distmoe.party.receipt import refresh_facts

    key, _, _ = _ledger(tmp_path)
    path, state = tmp_path / "p.jsonl", tmp_path / "state"
    _rounds(Ledger(path, key), "r1", 4, 10, describe_payload(b"y"))  # more than CARRY_EVERY lines: carried
    refresh_facts(path, state, "r1", key)
    raw = path.read_bytes()
    lines = raw.splitlines(keepends=True)
    path.write_bytes(raw + lines[-3].rstrip(b"\n"))  # a complete (charged) entry whose newline is not yet written
    facts, _ = refresh_facts(path, state, "r1", key)
    assert facts.body("party-0", 1e-6, 8.0, None, None) == _whole(path, "r1")
    assert len(facts.charged) == 13 and facts.charged[-2:] == [[13, "update"], [13, "update"]]
    path.write_bytes(raw + b'{"seq": 9, "run": "r1", "torn')  # a torn line: counted by neither
    facts, read = refresh_facts(path, state, "r1", key)
    assert read == 1 and facts.body("party-0", 1e-6, 8.0, None, None) == _whole(path, "r1")
