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
