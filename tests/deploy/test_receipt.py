"""The run receipt's format (``distmoe.deploy.receipt``): signed over its canonical body, under the owner's key only."""

from __future__ import annotations

import pytest

from distmoe.deploy.receipt import ReceiptError, read_receipt, sign_receipt
from distmoe.ledger import generate_signing_key, public_key_hex

BODY = {"run": "r1", "party": "party-0", "ledger_head": {"seq": 9, "hash": "a" * 64},
        "coordinator_head": {"seq": 40, "hash": "b" * 64}, "epsilon": 7.9, "delta": 1e-6, "budget": 8.0,
        "charged": [[3, "router-stats"]], "unmasked": [3], "code_pin": None, "owner_policy": None}


def test_a_signed_receipt_reads_back_under_its_key_only(tmp_path):
    key = generate_signing_key(tmp_path / "k.pem")
    obj = sign_receipt(BODY, key)
    assert read_receipt(obj, public_key_hex(key)) == {**BODY, "public_key": public_key_hex(key)}
    other = public_key_hex(generate_signing_key(tmp_path / "o.pem"))
    with pytest.raises(ReceiptError, match="not this party's key"):
        read_receipt(obj, other)
    forged = {**obj, "body": {**obj["body"], "public_key": other}}  # claims the other key, signed with the first
    with pytest.raises(ReceiptError, match="does not verify"):
        read_receipt(forged, other)


@pytest.mark.parametrize("edit", [{"epsilon": 1.0}, {"unmasked": []}, {"coordinator_head": None},
                                  {"ledger_head": {"seq": 10, "hash": "a" * 64}}])
def test_any_edit_of_a_signed_receipt_breaks_its_signature(tmp_path, edit):
    key = generate_signing_key(tmp_path / "k.pem")
    obj = sign_receipt(BODY, key)
    obj["body"].update(edit)
    with pytest.raises(ReceiptError, match="does not verify"):
        read_receipt(obj, public_key_hex(key))


@pytest.mark.parametrize("obj, needle", [
    ({}, "not a distmoe-receipt/1"),
    ({"format": "distmoe-receipt/1", "body": {**BODY, "extra": 1}, "signature": ""}, "exactly the keys"),
    ({"format": "distmoe-receipt/1", "body": {**BODY, "public_key": "k", "ledger_head": {"seq": 1}},
      "signature": ""}, "ledger_head"),
    ({"format": "distmoe-receipt/1", "body": {**BODY, "public_key": "k", "owner_policy": {"sha256": "a" * 64}},
      "signature": ""}, "owner_policy"),
])
def test_a_malformed_receipt_is_named(obj, needle):
    with pytest.raises(ReceiptError, match=needle):
        read_receipt(obj, "00" * 32)
