"""A data owner's run receipt: a small signed file that pins what its party's own ledger says about a run.

Owns: the receipt's format (``FORMAT``), its canonical signed body, :func:`sign_receipt` and
:func:`read_receipt` (the structure and the Ed25519 signature, under the key it must be checked against).
The party writes one into its work directory (``<work-dir>/receipts/<party>-<run>.json``,
``distmoe.party.receipt``) and refreshes it after every message it answers, so that at run end it holds the
final state; the owner publishes it, and ``distmoe audit RUN --receipt FILE`` (``distmoe.audit.receipts``)
checks it against the coordinator's ledger.

Body (every field is a fact of the party's own signed ledger or setup, nothing of its data):

- ``run``: the run id the party's ledger entries carry; ``party``: its name;
- ``ledger_head``: ``{seq, hash}`` of the party ledger's last entry (what the coordinator anchors from its
  replies: the coordinator's last anchored head of this party must not be beyond it or differ at it);
- ``coordinator_head``: ``{seq, hash}`` of the last coordinator ledger head the party recorded (from its last
  instruction), or null: the coordinator's ledger is a hash chain, so this one head binds every coordinator
  entry up to it: a deletion, insertion or reordering before it changes that hash;
- ``epsilon``: the largest cumulative epsilon the party's accountant charged in this run (``dp.epsilon`` of its
  ``out`` entries), ``delta``, ``budget``; ``charged``: ``[round, release]`` of every release it charged;
- ``unmasked``: the rounds for which it revealed its unmask shares (a release may exist for each);
- ``code_pin``: the digest of the owner's code pin the party runs under, or null;
- ``owner_policy``: the owner policy the party holds run configs to, ``{"policy": canonical dict, "sha256"}`` as
  its ledger records it at setup (``distmoe.party.policy.policy_facts``), or null (no policy: a simulation);
- ``public_key``: the ledger public key it is signed with (the audit checks it against the key directory).

Must not: read party data, or decide whether a receipt matches a run (the audit does).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from distmoe.ledger import canonical_json, load_public_key, public_key_hex

FORMAT = "distmoe-receipt/1"
DOMAIN = b"distmoe-receipt-v1:"  # signatures of a receipt are never valid as ledger-entry signatures
BODY_KEYS = {"run", "party", "ledger_head", "coordinator_head", "epsilon", "delta", "budget", "charged",
             "unmasked", "code_pin", "owner_policy", "public_key"}


class ReceiptError(ValueError):
    """A receipt that is malformed, or whose signature does not verify."""


def _message(body: Mapping[str, Any]) -> bytes:
    return DOMAIN + canonical_json(dict(body)).encode("ascii")


def sign_receipt(body: Mapping[str, Any], key: Ed25519PrivateKey) -> dict[str, Any]:
    """The receipt file's JSON object: ``{"format", "body", "signature"}`` (``body`` gets ``public_key``)."""
    body = {**body, "public_key": public_key_hex(key)}
    if set(body) != BODY_KEYS:
        raise ReceiptError(f"receipt body keys {sorted(set(body) ^ BODY_KEYS)} differ from the format's")
    return {"format": FORMAT, "body": body, "signature": key.sign(_message(body)).hex()}


def _head(v: Any, what: str, nullable: bool = False) -> None:
    if v is None and nullable:
        return
    if not (isinstance(v, dict) and set(v) == {"seq", "hash"} and isinstance(v["seq"], int)
            and not isinstance(v["seq"], bool) and isinstance(v["hash"], str) and len(v["hash"]) == 64):
        raise ReceiptError(f"{what} is not a ledger head {{seq, hash}}")


def read_receipt(obj: Any, public_key: str) -> dict[str, Any]:
    """The verified body of a receipt object, signed by ``public_key`` (hex); ``ReceiptError`` otherwise."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT or set(obj) != {"format", "body", "signature"}:
        raise ReceiptError(f"not a {FORMAT} receipt")
    body, sig = obj["body"], obj["signature"]
    if not isinstance(body, dict) or set(body) != BODY_KEYS:
        raise ReceiptError(f"the receipt body must have exactly the keys {sorted(BODY_KEYS)}")
    for k in ("run", "party", "public_key"):
        if not isinstance(body[k], str) or not body[k]:
            raise ReceiptError(f"receipt field {k!r} is not a non-empty string")
    _head(body["ledger_head"], "ledger_head")
    _head(body["coordinator_head"], "coordinator_head", nullable=True)
    for k in ("epsilon", "delta", "budget"):
        if isinstance(body[k], bool) or not isinstance(body[k], (int, float)):
            raise ReceiptError(f"receipt field {k!r} is not a number")
    if not (isinstance(body["charged"], list) and all(isinstance(x, list) and len(x) == 2 for x in body["charged"])):
        raise ReceiptError("receipt field 'charged' is not a list of [round, release]")
    if not (isinstance(body["unmasked"], list) and all(isinstance(r, int) for r in body["unmasked"])):
        raise ReceiptError("receipt field 'unmasked' is not a list of rounds")
    if body["code_pin"] is not None and not isinstance(body["code_pin"], str):
        raise ReceiptError("receipt field 'code_pin' is not a digest or null")
    pol = body["owner_policy"]
    if pol is not None and not (isinstance(pol, dict) and set(pol) == {"policy", "sha256"}
                                and isinstance(pol["policy"], dict) and isinstance(pol["sha256"], str)):
        raise ReceiptError("receipt field 'owner_policy' is not {policy, sha256} or null")
    if body["public_key"] != public_key:
        raise ReceiptError("signed with a key that is not this party's key in the key directory")
    try:
        load_public_key(public_key).verify(bytes.fromhex(str(sig)), _message(body))
    except (InvalidSignature, ValueError, TypeError):
        raise ReceiptError("the signature does not verify under this party's key in the key directory") from None
    return body
