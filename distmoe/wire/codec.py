"""The codec: ``encode(payload) -> RecordDict`` and ``decode(RecordDict) -> payload``, plus the
message constructors. The only code that builds or reads Flower records and messages.

Driven by one table, ``schema.PAYLOADS``: each payload type lists its dataclass fields with the record
key they travel under and their kind; ``KINDS`` maps each kind to how it is written and read. Record
layout: a ``"meta"`` ConfigRecord with ``"payload"`` (the type tag) and the scalar fields; ArrayRecords
for weights, deltas and ``[L, E]`` arrays; a MetricRecord for scalar metrics; the SecAgg protocol
messages in their own records. Decoding checks the tag, that every record and every ConfigRecord key
present was read by a field (nothing more, nothing less), and that arrays are finite; anything else
raises ``WireError`` naming what was wrong. Encoding refuses what decoding would reject.

Must not: know about models, data or training.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from distmoe.privacy import secagg as sa
from distmoe.wire import inspect
from distmoe.wire.schema import (  # noqa: F401  (MSG_* are part of the codec's interface)
    BY_CLASS,
    BY_TAG,
    EVAL_ROUTING_KEYS,
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

_PARTY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
MESSAGE_TYPE = {pt.cls: pt.message_type for pt in PAYLOADS if pt.message_type}
LEDGER_RECORD = "ledger"  # the sender's ledger head, attached by the outbound guard; not part of the digest


class WireError(ValueError):
    """A record does not conform to the payload schema."""


def _arrays(d: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord(array_dict={k: Array(np.ascontiguousarray(v)) for k, v in sorted(d.items())})


def _read_arrays(rec: ArrayRecord, what: str) -> dict[str, np.ndarray]:
    """Every array parsed strictly (``inspect.check_array``: header equal to metadata, no trailing bytes,
    numeric dtypes only, finite floats) and copied out of the record."""
    out = {}
    for k, arr in rec.items():
        try:
            out[k] = np.array(inspect.check_array(arr, f"{what}: array {k!r}"))
        except inspect.InspectError as exc:
            raise WireError(str(exc)) from None
    return out


def _check_numeric(arrays: dict[str, np.ndarray], tag: str, field: str) -> None:
    """Refuse to encode what decode would reject: non-numeric or non-finite arrays."""
    for k, v in arrays.items():
        a = np.asarray(v)
        if a.dtype.kind not in "fiu":
            raise WireError(f"{tag}: array {field}.{k!r} has dtype {a.dtype}, expected a numeric array")
        if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
            raise WireError(f"{tag}: array {field}.{k!r} contains NaN or Inf")


def _party(name: str) -> str:
    if not isinstance(name, str) or not _PARTY_RE.match(name):
        raise WireError(f"party name {name!r} is not an identifier (letters, digits, '-', '_'; <= 64)")
    return name


def _finite_or_nan(v: float) -> float:
    v = float(v)
    return v if math.isfinite(v) else float("nan")


_EVAL_KEY_RE = re.compile(r"^(acc|loss|n)/[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_ROUTE_KEY_RE = re.compile(r"^route_disagree_l\d{1,3}$")


def _check_update_keys(kind: str, keys, tag: str) -> None:
    if kind == "sft":
        ok = set(keys) == set(TRAIN_METRIC_KEYS)
        allowed = ", ".join(TRAIN_METRIC_KEYS)
    elif kind == "rl":
        ok = set(RL_METRIC_KEYS) <= set(keys) and all(
            k in RL_METRIC_KEYS or k in RL_SIM_METRIC_KEYS or _ROUTE_KEY_RE.match(k) for k in keys)
        allowed = ", ".join(RL_METRIC_KEYS) + ", route_disagree_l<i>"
    else:
        raise WireError(f"{tag}: unknown update kind {kind!r} (sft, rl)")
    if not ok:
        raise WireError(f"{tag}: {kind} update metrics: metric keys {sorted(keys)} do not match the schema ({allowed})")


def _check_eval_keys(keys, tag: str) -> None:
    bad = sorted(k for k in keys if k not in EVAL_ROUTING_KEYS and not _EVAL_KEY_RE.match(k))
    if bad:
        raise WireError(f"{tag}: metric keys outside the schema: {bad[:5]} (allowed: acc|loss|n/<task>, "
                        f"{', '.join(EVAL_ROUTING_KEYS)})")


def _release(name: str, tag: str) -> str:
    if name not in RELEASES:
        raise WireError(f"{tag}: unknown release {name!r} (one of {', '.join(RELEASES)})")
    return name


# ------------------------------------------------------------------------------------------------
# The table-driven codec: an _Out collects records while encoding, an _In tracks what decoding read
# ------------------------------------------------------------------------------------------------
class _Out:
    def __init__(self, pt: PayloadType, payload: object):
        self.pt, self.payload, self.tag = pt, payload, pt.tag or "secure instruction"
        self.recs: dict[str, dict | ArrayRecord | MetricRecord | ConfigRecord] = {}

    def config(self, name: str) -> dict:
        return self.recs.setdefault(name, {})

    def record_dict(self) -> RecordDict:
        order = [k for k in self.recs if k not in self.pt.records] + [k for k in self.pt.records if k in self.recs]
        return RecordDict({k: ConfigRecord(v) if isinstance(v, dict) else v for k, v in
                           ((k, self.recs[k]) for k in order)})


class _In:
    def __init__(self, content: RecordDict, pt: PayloadType, tag: str):
        self.content, self.pt, self.tag = content, pt, tag
        self.used: dict[str, set[str]] = {}  # record -> the ConfigRecord keys read

    def has(self, name: str) -> bool:
        return name in self.content

    def record(self, name: str):
        if name not in self.content:
            raise WireError(f"{self.tag}: records {sorted(self.content.keys())} do not match the schema "
                            f"(missing [{name!r}])")
        self.used.setdefault(name, set())
        return self.content[name]

    def value(self, at: str):
        name, key = at.split(".", 1)
        rec = self.record(name)
        if not isinstance(rec, ConfigRecord):
            raise WireError(f"{self.tag}: record {name!r} is not a ConfigRecord")
        if key not in rec:
            raise WireError(f"{self._what(name)}: missing field {key!r} (fields {sorted(rec.keys())})")
        self.used[name].add(key)
        return rec[key]

    def arrays(self, name: str, keys: set[str] | None = None) -> dict[str, np.ndarray]:
        rec = self.record(name)
        if not isinstance(rec, ArrayRecord):
            raise WireError(f"{self.tag}: record {name!r} is not an ArrayRecord")
        out = _read_arrays(rec, self.tag if name in ("arrays", "ref") else f"{self.tag}: {name}")
        if keys is not None and set(out) != keys:
            raise WireError(f"{self.tag}: {name} arrays {sorted(out)} != {sorted(keys)}")
        return out

    def metrics(self, name: str) -> dict[str, float]:
        rec = self.record(name)
        if not isinstance(rec, MetricRecord):
            raise WireError(f"{self.tag}: record {name!r} is not a MetricRecord")
        return {k: float(v) for k, v in rec.items()}

    def _what(self, name: str) -> str:
        return self.tag if name == "meta" else f"{self.tag}: {name}"

    def finish(self) -> None:
        extra = sorted(set(self.content.keys()) - set(self.used))
        if extra:
            raise WireError(f"{self.tag}: records {sorted(self.content.keys())} do not match the schema "
                            f"(unexpected {extra})")
        for name, keys in self.used.items():
            rec = self.content[name]
            if isinstance(rec, ConfigRecord) and set(rec.keys()) != keys:
                raise WireError(f"{self._what(name)}: fields {sorted(rec.keys())} != {sorted(keys)} "
                                f"(unexpected {sorted(set(rec.keys()) - keys)})")


@dataclass(frozen=True)
class Kind:
    """How one field kind is written (``put(out, at, value)``) and read (``take(inp, at, got)``; ``got``
    holds the fields decoded so far); ``strings(at)`` names the ConfigRecord keys that hold text or bytes."""

    put: Callable
    take: Callable
    strings: Callable = lambda at: {}


def _scalar(enc: Callable, dec: Callable | None = None, text: bool = False) -> Kind:
    """A ConfigRecord value: ``enc(value, tag, key)`` on the way out, ``dec(raw, tag, key)`` on the way in."""
    dec = dec or enc

    def put(out: _Out, at: str, v) -> None:
        name, key = at.split(".", 1)
        out.config(name)[key] = enc(v, out.tag, key)

    def take(inp: _In, at: str, got: dict):
        return dec(inp.value(at), inp.tag, at.split(".", 1)[1])

    return Kind(put, take, (lambda at: {at.split(".", 1)[0]: {at.split(".", 1)[1]}}) if text else (lambda at: {}))


def _count(v, tag: str, key: str) -> int:
    n = int(v)
    if n < 0:
        raise WireError(f"{tag}: negative {key} {n}")
    return n


def _key32(v, tag: str, key: str) -> bytes:
    b = bytes(v)
    if len(b) != 32:
        raise WireError(f"{tag}: {key} must be 32 bytes")
    return b


def _hex64(v, tag: str, key: str) -> str:
    if not isinstance(v, str) or not re.fullmatch(r"[0-9a-f]{64}", v):
        raise WireError(f"{tag}: {key} must be 64 lowercase hex characters")
    return v


def _weights(dtype=None) -> Kind:
    def put(out: _Out, at: str, v) -> None:
        _check_numeric(v, out.tag, at)
        out.recs[at] = _arrays(v if dtype is None else {k: np.asarray(a, dtype) for k, a in v.items()})

    return Kind(put, lambda inp, at, got: inp.arrays(at))


def _single(key: str, dtype) -> Kind:
    def put(out: _Out, at: str, v) -> None:
        _check_numeric({key: v}, out.tag, at)
        out.recs[at] = _arrays({key: np.asarray(v, dtype)})

    return Kind(put, lambda inp, at, got: inp.arrays(at, {key})[key])


def _metrics(check: Callable) -> Kind:
    def put(out: _Out, at: str, v) -> None:
        check(out.payload, v, out.tag)
        out.recs[at] = MetricRecord({k: _finite_or_nan(x) for k, x in sorted(v.items())})

    def take(inp: _In, at: str, got: dict) -> dict[str, float]:
        m = inp.metrics(at)
        check(got, m, inp.tag)
        return m

    return Kind(put, take)


def _kind_of(p) -> str:
    return p["kind"] if isinstance(p, dict) else p.kind


def _logical_run(value, tag: str) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{0,128}", value):
        raise WireError(f"{tag}: logical_run must be up to 128 of [A-Za-z0-9_.:-], got {str(value)[:40]!r}")
    return value


def _epoch(value, tag: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1_000_000:
        raise WireError(f"{tag}: epoch must be an int in [0, 1e6), got {value!r}")
    return value



_SA_ENVELOPES = {"ids": "uint64", "nonces": "uint8", "cts": "uint8"}


def _u64(values) -> np.ndarray:
    return np.asarray(list(values), dtype=np.uint64).reshape(-1)


def _u8(rows: list[bytes], width: int) -> np.ndarray:
    if not rows:
        return np.zeros((0, width), np.uint8)
    return np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), width).copy()


def _rows(a: np.ndarray, width: int, what: str) -> list[bytes]:
    if a.dtype != np.uint8 or a.ndim != 2 or a.shape[1] != width:
        raise WireError(f"{what}: expected uint8 [n, {width}], got {a.dtype} {a.shape}")
    return [bytes(r) for r in a]


def _ids(a: np.ndarray, what: str) -> tuple[int, ...]:
    if a.dtype != np.uint64 or a.ndim != 1:
        raise WireError(f"{what}: expected uint64 [n], got {a.dtype} {a.shape}")
    return tuple(int(v) for v in a)


def _envelopes(shares, peer_of) -> ArrayRecord:
    """EncryptedShares -> arrays: peer ids [n], nonces [n, 12], ciphertexts [n, 148]."""
    return _arrays({"ids": _u64(peer_of(e) for e in shares), "nonces": _u8([e.nonce for e in shares], 12),
                    "cts": _u8([e.ciphertext for e in shares], sa.messages.SHARE_CIPHERTEXT_BYTES)})


def _read_envelopes(rec: ArrayRecord, what: str, make) -> tuple:
    arrays = _read_arrays(rec, what)
    if set(arrays) != set(_SA_ENVELOPES):
        raise WireError(f"{what}: arrays {sorted(arrays)} != {sorted(_SA_ENVELOPES)}")
    ids = _ids(arrays["ids"], what)
    nonces = _rows(arrays["nonces"], 12, what)
    cts = _rows(arrays["cts"], sa.messages.SHARE_CIPHERTEXT_BYTES, what)
    if not len(ids) == len(nonces) == len(cts):
        raise WireError(f"{what}: {len(ids)} ids, {len(nonces)} nonces, {len(cts)} ciphertexts")
    return tuple(make(i, n, c) for i, n, c in zip(ids, nonces, cts, strict=True))


# ------------------------------------------------------------------------------------------------
# Secure aggregation protocol messages (privacy.mode = "secagg") as field kinds
# ------------------------------------------------------------------------------------------------
def _put_share_keys(out: _Out, prefix: str, k) -> None:
    out.recs[prefix] = ConfigRecord({"round": k.round, "sender": k.sender, "s_pk": k.s_pk, "b_commit": k.b_commit})
    out.recs[f"{prefix}_shares"] = _envelopes(k.shares, lambda e: e.recipient)


def _take_share_keys(inp: _In, prefix: str):
    sender, rnd = int(inp.value(f"{prefix}.sender")), int(inp.value(f"{prefix}.round"))
    s_pk, b_commit = bytes(inp.value(f"{prefix}.s_pk")), bytes(inp.value(f"{prefix}.b_commit"))
    shares = _read_envelopes(inp.record(f"{prefix}_shares"), f"{inp.tag}: {prefix}_shares",
                             lambda i, n, c: sa.EncryptedShares(sender, i, rnd, n, c))
    return sa.ShareKeys(sender, rnd, s_pk, b_commit, shares)


def _share_key_strings(at: str) -> dict[str, set[str]]:
    return {at: {"s_pk", "b_commit"}}


def _put_directory(out: _Out, at: str, d) -> None:
    out.config("meta")["secagg_run"] = d.run_id
    out.recs[at] = _arrays({"ids": _u64(cid for cid, _ in d.keys), "keys": _u8([k for _, k in d.keys], 32)})


def _take_directory(inp: _In, at: str, got: dict):
    run = bytes(inp.value("meta.secagg_run"))
    arrays = inp.arrays(at, {"ids", "keys"})
    ids, keys = _ids(arrays["ids"], inp.tag), _rows(arrays["keys"], 32, inp.tag)
    if len(ids) != len(keys):
        raise WireError(f"{inp.tag}: {len(ids)} ids, {len(keys)} keys")
    return sa.KeyDirectory(run, tuple(zip(ids, keys, strict=True)))


def _put_roster(out: _Out, at: str, names) -> None:
    by_id = dict(names)
    out.config("meta")[at.split(".", 1)[1]] = [_party(by_id[cid]) for cid, _ in out.payload.directory.keys]


def _take_roster(inp: _In, at: str, got: dict):
    names = [_party(str(n)) for n in inp.value(at)]
    ids = [cid for cid, _ in got["directory"].keys]
    if len(ids) != len(names):
        raise WireError(f"{inp.tag}: {len(ids)} ids, {len(names)} names")
    return tuple(zip(ids, names, strict=True))


def _put_instruction(out: _Out, at: str, instr) -> None:
    out.recs.update(encode(instr).items())


def _take_instruction(inp: _In, at: str, got: dict):
    inner = RecordDict({k: v for k, v in inp.content.items() if k not in inp.pt.records})
    for k in inner.keys():
        inp.used[k] = set(inner[k].keys()) if isinstance(inner[k], ConfigRecord) else set()
    instr = decode(inner)
    if not BY_CLASS[type(instr)].release:
        raise WireError(f"{inp.tag}: carries {type(instr).__name__}, not a phase instruction")
    return instr


def _put_start(out: _Out, at: str, st) -> None:
    meta = out.config(at)
    meta["has_start"] = st is not None
    if st is not None:
        meta.update(round=int(st.round), recipient=int(st.recipient), length=int(st.length))
        out.recs["sa_parts"] = _arrays({"ids": _u64(v for v, _ in st.participants),
                                        "s_pks": _u8([k for _, k in st.participants], 32)})
        out.recs["sa_shares"] = _envelopes(st.shares, lambda e: e.sender)


def _take_start(inp: _In, at: str, got: dict):
    if not bool(inp.value(f"{at}.has_start")):
        return None
    rnd, rcpt = int(inp.value(f"{at}.round")), int(inp.value(f"{at}.recipient"))
    parts = inp.arrays("sa_parts", {"ids", "s_pks"})
    ids, pks = _ids(parts["ids"], inp.tag), _rows(parts["s_pks"], 32, inp.tag)
    if len(ids) != len(pks):
        raise WireError(f"{inp.tag}: {len(ids)} participants, {len(pks)} keys")
    shares = _read_envelopes(inp.record("sa_shares"), f"{inp.tag}: sa_shares",
                             lambda i, n, c: sa.EncryptedShares(i, rcpt, rnd, n, c))
    return sa.RoundStart(rnd, rcpt, tuple(zip(ids, pks, strict=True)), shares, int(inp.value(f"{at}.length")))


def _put_masked(out: _Out, at: str, m) -> None:
    out.config("meta")["has_masked"] = m is not None
    if m is None:
        return
    if m.y.dtype != np.uint64:
        raise WireError(f"{out.tag}: y must be uint64 (Z_2^64)")
    out.recs[at] = ConfigRecord({"round": int(m.round), "sender": int(m.sender)})
    out.recs[f"{at}_y"] = _arrays({"y": m.y})
    if m.next_keys is not None:
        _put_share_keys(out, "next", m.next_keys)


def _take_masked(inp: _In, at: str, got: dict):
    if not bool(inp.value("meta.has_masked")):
        return None
    sender, rnd = int(inp.value(f"{at}.sender")), int(inp.value(f"{at}.round"))
    y = inp.arrays(f"{at}_y", {"y"})["y"]
    if y.dtype != np.uint64 or y.ndim != 1:
        raise WireError(f"{inp.tag}: y must be uint64 [length], got {y.dtype} {y.shape}")
    nxt = _take_share_keys(inp, "next") if inp.has("next") else None
    return sa.MaskedInput(sender, rnd, y, nxt)


def _put_late_keys(out: _Out, at: str, keys) -> None:
    if (out.payload.masked is None) == (keys is None):
        raise WireError(f"{out.tag}: exactly one of a masked input and late share keys")
    if keys is not None:
        _put_share_keys(out, at, keys)


def _take_late_keys(inp: _In, at: str, got: dict):
    return _take_share_keys(inp, at) if got["masked"] is None else None


def _put_unmask_request(out: _Out, at: str, r) -> None:
    out.config("meta")["round"] = int(r.round)
    out.recs[at] = _arrays({"alive": _u64(r.alive), "dead": _u64(r.dead)})


def _take_unmask_request(inp: _In, at: str, got: dict):
    a = inp.arrays(at, {"alive", "dead"})
    return sa.UnmaskRequest(int(inp.value("meta.round")), _ids(a["alive"], inp.tag), _ids(a["dead"], inp.tag))


def _put_unmask_response(out: _Out, at: str, r) -> None:
    w = sa.shamir.SHARE_BYTES
    out.config("meta").update(round=int(r.round), sender=int(r.sender))
    out.recs[at] = _arrays({"b_owner": _u64(o for o, _ in r.b_shares), "b_share": _u8([s for _, s in r.b_shares], w),
                            "s_owner": _u64(o for o, _ in r.s_shares), "s_share": _u8([s for _, s in r.s_shares], w)})


def _take_unmask_response(inp: _In, at: str, got: dict):
    rnd, sender = int(inp.value("meta.round")), int(inp.value("meta.sender"))
    a = inp.arrays(at, {"b_owner", "b_share", "s_owner", "s_share"})
    w = sa.shamir.SHARE_BYTES
    bo, bs = _ids(a["b_owner"], inp.tag), _rows(a["b_share"], w, inp.tag)
    so, ss = _ids(a["s_owner"], inp.tag), _rows(a["s_share"], w, inp.tag)
    if len(bo) != len(bs) or len(so) != len(ss):
        raise WireError(f"{inp.tag}: owners and shares differ in number")
    return sa.UnmaskResponse(sender, rnd, tuple(zip(bo, bs, strict=True)), tuple(zip(so, ss, strict=True)))


def _text(v, tag: str, key: str) -> str:
    return str(v)


KINDS: dict[str, Kind] = {
    "int": _scalar(lambda v, tag, key: int(v)),
    "count": _scalar(_count),
    "float": _scalar(lambda v, tag, key: float(v)),
    "str": _scalar(_text, text=True),
    "bytes": _scalar(lambda v, tag, key: bytes(v), text=True),
    "key32": _scalar(_key32, text=True),
    "hex64": _scalar(_hex64, lambda v, tag, key: _hex64(str(v), tag, key), text=True),
    "party": _scalar(lambda v, tag, key: _party(v), lambda v, tag, key: _party(str(v)), text=True),
    "tasks": _scalar(lambda v, tag, key: list(v), lambda v, tag, key: tuple(v), text=True),
    "release": _scalar(lambda v, tag, key: _release(v, tag), lambda v, tag, key: _release(str(v), tag), text=True),
    "logical-run": _scalar(lambda v, tag, key: _logical_run(v, tag), text=True),
    "epoch": _scalar(lambda v, tag, key: _epoch(v, tag)),
    "weights": _weights(),
    "deltas": _weights(np.float32),
    "probs": _single("probs", np.float32),
    "sums": _single("sums", np.float64),
    "update-metrics": _metrics(lambda p, m, tag: _check_update_keys(_kind_of(p), m, tag)),
    "eval-metrics": _metrics(lambda p, m, tag: _check_eval_keys(m, tag)),
    "key-directory": Kind(_put_directory, _take_directory),
    "roster": Kind(_put_roster, _take_roster, lambda at: {"meta": {"names"}}),
    "share-keys": Kind(lambda out, at, k: _put_share_keys(out, at, k), lambda inp, at, got: _take_share_keys(inp, at),
                       _share_key_strings),
    "instruction": Kind(_put_instruction, _take_instruction),
    "round-start": Kind(_put_start, _take_start),
    "masked-input": Kind(_put_masked, _take_masked, lambda at: _share_key_strings("next")),
    "late-keys": Kind(_put_late_keys, _take_late_keys, _share_key_strings),
    "unmask-request": Kind(_put_unmask_request, _take_unmask_request),
    "unmask-response": Kind(_put_unmask_response, _take_unmask_response),
}
assert {f.kind.rstrip("?") for pt in PAYLOADS for f in pt.fields} <= set(KINDS)


def encode(payload: object) -> RecordDict:
    pt = BY_CLASS.get(type(payload))
    if pt is None:
        raise WireError(f"not a wire payload: {type(payload).__name__}")
    out = _Out(pt, payload)
    if pt.tag:
        out.config("meta")["payload"] = pt.tag
    for f in pt.fields:
        v = getattr(payload, f.attr)
        if not (f.optional and v is None):
            KINDS[f.kind.rstrip("?")].put(out, f.at, v)
    return out.record_dict()


def decode(content: RecordDict, expected: type | None = None) -> object:
    """Payload of a record dict; a sender's ledger head record, if any, is checked and left aside
    (read it with :func:`ledger_head`)."""
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
    inp = _In(content, pt, tag)
    try:
        if pt.tag:
            inp.value("meta.payload")
        got: dict = {}
        for f in pt.fields:
            if f.optional and not inp.has(f.record):
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


def with_ledger_head(content: RecordDict, seq: int, head: str) -> RecordDict:
    """Attach the sender's ledger head (``LEDGER_RECORD``) to an outbound record dict."""
    content[LEDGER_RECORD] = ConfigRecord({"seq": int(seq), "hash": str(head)})
    return content


def ledger_head(content: RecordDict) -> tuple[int, str] | None:
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
    """A reply carrying an already encoded (and guarded) record dict."""
    return Message(content=content, reply_to=to)


def instruction_content(content: RecordDict, node_id: int, message_type: str) -> Message:
    return Message(content=content, dst_node_id=node_id, message_type=message_type)


def message_type_of(payload: object) -> str:
    inner = payload.instruction if isinstance(payload, SecureInstruction) else payload
    mtype = MESSAGE_TYPE.get(type(inner))
    if mtype is None:
        raise WireError(f"{type(inner).__name__} is not a server instruction")
    return mtype
