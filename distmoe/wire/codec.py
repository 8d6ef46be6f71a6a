"""The codec: ``encode(payload) -> RecordDict`` and ``decode(RecordDict) -> payload``, plus the
message constructors. With its two kind modules (``records``: plain payloads, ``secagg_kinds``: the
SecAgg protocol messages) the only code that builds or reads Flower records and messages.

Driven by one table, ``schema.PAYLOADS``: each payload type lists its dataclass fields with the record
key they travel under and their kind; ``KINDS`` maps each kind to how it is written and read (the
``instruction`` kind, a phase instruction nested in a secure one, is the codec itself). Record
layout: a ``"meta"`` ConfigRecord with ``"payload"`` (the type tag) and the scalar fields; ArrayRecords
for weights, deltas and ``[L, E]`` arrays; a MetricRecord for scalar metrics; the SecAgg protocol
messages in their own records. Decoding checks the tag, that every record and every ConfigRecord key
present was read by a field (nothing more, nothing less), and that arrays are finite; anything else
raises ``WireError`` naming what was wrong. Encoding refuses what decoding would reject.

Must not: know about models, data or training.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flwr.app import ConfigRecord, Message, RecordDict

from distmoe.wire import packing
from distmoe.wire.records import BASIC_KINDS, In, Kind, Out, WireError
from distmoe.wire.schema import (  # noqa: F401  (MSG_* are part of the codec's interface)
    BY_CLASS,
    BY_TAG,
    EVAL_ROUTING_KEYS,
    MSG_CONSISTENCY,
    MSG_DIRECTORY,
    MSG_EVAL,
    MSG_RL,
    MSG_SETUP,
    MSG_SFT,
    MSG_STATS,
    MSG_UNMASK,
    PAYLOADS,
    RELEASES,
    RL_METRIC_KEYS,
    RL_SIM_METRIC_KEYS,
    TRAIN_METRIC_KEYS,
    EvalInstruction,
    PayloadType,
    SecureInstruction,
)
from distmoe.wire.secagg_kinds import SECAGG_KINDS

MESSAGE_TYPE = {pt.cls: pt.message_type for pt in PAYLOADS if pt.message_type}
LEDGER_RECORD = "ledger"  # the sender's ledger head, attached by the outbound guard; not part of the digest


def _put_instruction(out: Out, at: str, instr) -> None:
    # the secure instructions of one exchange wrap the same phase instruction (the same weights) in each party's own
    # round start: with the exchange's memo it is encoded once and its records shared (encoded records are never
    # changed; each message gets its own record dict)
    if out.memo is None:
        out.recs.update(encode(instr).items())
    else:
        out.recs.update(out.memo.once("encode", (instr,), lambda: encode(instr)).items())


def _take_instruction(inp: In, at: str, got: dict):
    inner = RecordDict({k: v for k, v in inp.content.items() if k not in inp.pt.records})
    for k in inner.keys():
        inp.used[k] = set(inner[k].keys()) if isinstance(inner[k], ConfigRecord) else set()
    instr = decode(inner)
    if not BY_CLASS[type(instr)].release:
        raise WireError(f"{inp.tag}: carries {type(instr).__name__}, not a phase instruction")
    return instr



KINDS: dict[str, Kind] = {**BASIC_KINDS, **SECAGG_KINDS, "instruction": Kind(_put_instruction, _take_instruction)}
assert {f.kind.rstrip("?") for pt in PAYLOADS for f in pt.fields} <= set(KINDS)


def encode(payload: object, memo=None) -> RecordDict:
    """``payload``'s record dict. ``memo``: the exchange's ``server_guard.ExchangeMemo`` (a phase instruction that
    several of its secure instructions wrap is encoded once, its records shared), or None."""
    pt = BY_CLASS.get(type(payload))
    if pt is None:
        raise WireError(f"not a wire payload: {type(payload).__name__}")
    out = Out(pt, payload, memo)
    if pt.tag:
        out.config("meta")["payload"] = pt.tag
    for f in pt.fields:
        v = getattr(payload, f.attr)
        if not (f.optional and v is None):
            KINDS[f.kind.rstrip("?")].put(out, f.at, v)
    return out.record_dict()


def decode(content: RecordDict, expected: type | None = None) -> object:
    """Payload of a record dict, packed as Flower carried it (``packing.unpack``) or not; a sender's ledger head
    record, if any, is checked and left aside (read it with :func:`ledger_head`)."""
    content = packing.unpack(content)
    if LEDGER_RECORD in content:
        ledger_head(content)
        content = strip_ledger(content)
    if expected is SecureInstruction and "sa" in content:
        pt, tag = BY_CLASS[SecureInstruction], "secure instruction"
    else:
        if "meta" not in content.config_records:
            raise WireError("record has no 'meta' ConfigRecord: not a distmoe payload")
        tag = content.config_records["meta"].get("payload")
        pt = BY_TAG.get(tag)
        if pt is None:
            raise WireError(f"unknown payload type {tag!r}")
        if expected is not None and pt.cls is not expected:
            want = BY_CLASS[expected].tag if expected in BY_CLASS else expected.__name__
            raise WireError(f"expected {want or 'a secure instruction'!r}, got {tag!r}")
    inp = In(content, pt, tag)
    try:
        if pt.tag:
            inp.value("meta.payload")
        got: dict = {}
        for f in pt.fields:
            if f.optional and not inp.has_at(f.at):  # an optional scalar: its key absent; else its record
                got[f.attr] = None
            else:
                got[f.attr] = KINDS[f.kind.rstrip("?")].take(inp, f.at, got)
        inp.finish()
        return pt.cls(**got)
    except WireError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"{tag}: malformed: {exc}") from None


def string_fields(direction: str) -> dict[str, set[str]]:
    """``{record: keys}`` of the ConfigRecord fields that may hold text or bytes in any payload of this
    direction (``"reply"``: what the guards pass to ``inspect.check_strings``); everything else is a number."""
    out: dict[str, set[str]] = {}
    for pt in PAYLOADS:
        if pt.direction != direction:
            continue
        if pt.tag:
            out.setdefault("meta", set()).add("payload")
        for f in pt.fields:
            for rec, keys in KINDS[f.kind.rstrip("?")].strings(f.at).items():
                out.setdefault(rec, set()).update(keys)
    return out


# ------------------------------------------------------------------------------------------------
# Messages
# ------------------------------------------------------------------------------------------------
def error_reply(to: Message, code: int, reason: str) -> Message:
    from flwr.app import Error

    return Message(Error(code=code, reason=reason[:ERROR_MAX_BYTES]), reply_to=to)


def message_type(msg: Message) -> str:
    return msg.metadata.message_type


# ------------------------------------------------------------------------------------------------
# Error replies: the only free text a party sends. The party's guard makes it printable ASCII of at most
# ERROR_TEXT_MAX characters, scans it for canaries, logs it and appends its ledger head as a fixed suffix;
# the server guard enforces the same form and ERROR_MAX_BYTES on arrival and anchors the head.
# ------------------------------------------------------------------------------------------------
ERROR_MAX_BYTES = 2048
ERROR_TEXT_MAX = 1024
_HEAD_SUFFIX = re.compile(r" \[ledger-head (\d{1,12}) ([0-9a-f]{64})\]\Z")


@dataclass(frozen=True)
class ErrorReply:
    """An error reply as a transport hands it to the server guard (Flower's ``Error`` reason and code)."""

    reason: str
    code: int = 0


def error_text(text: str) -> str:
    """The form a party's error text takes on the wire: printable ASCII (others -> '?'), <= ERROR_TEXT_MAX."""
    return "".join(ch if 32 <= ord(ch) < 127 else "?" for ch in str(text))[:ERROR_TEXT_MAX]


def with_error_head(text: str, seq: int, hash_hex: str) -> str:
    return f"{text} [ledger-head {int(seq)} {hash_hex}]"


def split_error(reason: str) -> tuple[str, tuple[int, str] | None]:
    """``(text, (seq, hash) or None)`` of an error reason (the head suffix removed when present)."""
    m = _HEAD_SUFFIX.search(reason)
    if m is None:
        return reason, None
    return reason[:m.start()], (int(m.group(1)), m.group(2))


def payload_tag(content: RecordDict) -> str:
    """The payload type of a record dict for ledgers: ``masked-input:<release>`` for masked inputs, the
    instruction's tag for a secure instruction, ``unknown`` if there is no readable tag."""
    try:
        meta = content.config_records["meta"]
        tag = str(meta["payload"])
        if tag == "masked-input":
            return f"{'masked-input' if meta['has_masked'] else 'late-keys'}:{meta['release']}"
        return tag
    except (KeyError, TypeError):
        return "unknown"


def shared(content: RecordDict) -> RecordDict:
    """A record dict of its own over ``content``'s records (never changed once encoded): one encoding sent to several
    nodes, each message with its own ledger head (``with_ledger_head`` adds a record to the dict)."""
    return RecordDict(dict(content.items()))


def with_ledger_head(content: RecordDict, seq: int, head: str) -> RecordDict:
    """Attach the sender's ledger head (``LEDGER_RECORD``) to an outbound record dict."""
    content[LEDGER_RECORD] = ConfigRecord({"seq": int(seq), "hash": str(head)})
    return content


def ledger_head(content: RecordDict) -> tuple[int, str] | None:
    """The sender's ``(seq, hash)`` ledger head of a record dict (packed as Flower carried it, or not), or None."""
    content = packing.unpack(content)
    if LEDGER_RECORD not in content:
        return None
    rec = content.config_records[LEDGER_RECORD]
    if set(rec.keys()) != {"seq", "hash"}:
        raise WireError(f"ledger head: fields {sorted(rec.keys())} != ['hash', 'seq']")
    h = str(rec["hash"])
    if not re.fullmatch(r"[0-9a-f]{64}", h):
        raise WireError("ledger head: hash is not 64 hex characters")
    return int(rec["seq"]), h


def strip_ledger(content: RecordDict) -> RecordDict:
    return RecordDict({k: v for k, v in content.items() if k != LEDGER_RECORD})


def reply_content(content: RecordDict, to: Message) -> Message:
    """A reply carrying an already encoded (and guarded) record dict, its arrays packed (``packing``)."""
    return Message(content=packing.pack(content), reply_to=to)


def instruction_content(content: RecordDict, node_id: int, message_type: str, memo=None) -> Message:
    """An instruction carrying an already encoded (and logged) record dict, its arrays packed (``packing``; ``memo``:
    the exchange's ``server_guard.ExchangeMemo``, so its instructions pack a record they share once)."""
    return Message(content=packing.pack(content, memo), dst_node_id=node_id, message_type=message_type)


def message_type_of(payload: object) -> str:
    inner = payload.instruction if isinstance(payload, SecureInstruction) else payload
    mtype = MESSAGE_TYPE.get(type(inner))
    if mtype is None:
        raise WireError(f"{type(inner).__name__} is not a server instruction")
    return mtype
