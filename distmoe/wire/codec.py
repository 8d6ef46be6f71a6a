"""The codec: ``encode(payload) -> RecordDict`` and ``decode(RecordDict) -> payload``, plus the
message constructors. The only code that builds or reads Flower records and messages.

Record layout (every payload): ``"meta"`` ConfigRecord with ``"payload"`` (the type tag) and the
payload's scalar fields; ``"arrays"`` ArrayRecord for weights or deltas; ``"ref"`` ArrayRecord for
reference weights; ``"anchor"`` / ``"stats"`` ArrayRecords for ``[L, E]`` arrays; ``"metrics"``
MetricRecord for scalar metrics. Decoding checks the tag, the exact set of records and keys, and
that arrays are finite; anything else raises ``WireError`` naming what was wrong.

Must not: know about models, data or training.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from distmoe.privacy import secagg as sa
from distmoe.wire import inspect
from distmoe.wire.schema import (
    EVAL_ROUTING_KEYS,
    PAYLOAD_TAGS,
    RELEASES,
    RL_METRIC_KEYS,
    RL_SIM_METRIC_KEYS,
    TRAIN_METRIC_KEYS,
    DirectoryRequest,
    EvalInstruction,
    EvalReply,
    KeyAdvertReply,
    MaskedReply,
    ModelUpdate,
    RlInstruction,
    RouterStats,
    SecureInstruction,
    SetupRequest,
    SftInstruction,
    ShareKeysReply,
    StatsInstruction,
    UnmaskRequestMsg,
    UnmaskResponseMsg,
)

_PARTY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
TAG_TO_TYPE = {v: k for k, v in PAYLOAD_TAGS.items()}

# message types (Flower's "train.<action>" / "evaluate")
MSG_SFT = "train.sft"
MSG_STATS = "train.stats"
MSG_RL = "train.rl"
MSG_EVAL = "evaluate"
MSG_SETUP = "query.setup"
MSG_DIRECTORY = "query.directory"
MSG_UNMASK = "query.unmask"
MESSAGE_TYPE = {SftInstruction: MSG_SFT, RlInstruction: MSG_RL, StatsInstruction: MSG_STATS,
                EvalInstruction: MSG_EVAL, SetupRequest: MSG_SETUP, DirectoryRequest: MSG_DIRECTORY,
                UnmaskRequestMsg: MSG_UNMASK}
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


def encode(payload: object) -> RecordDict:
    if type(payload) in _SECURE_ENCODERS:
        return _SECURE_ENCODERS[type(payload)](payload)
    tag = PAYLOAD_TAGS.get(type(payload))
    if tag is None:
        raise WireError(f"not a wire payload: {type(payload).__name__}")
    _audit(payload, tag)
    meta: dict = {"payload": tag}
    rd: dict = {}
    p = payload
    if isinstance(p, SftInstruction):
        meta.update(round=p.round, task=p.task, base_hash=p.base_hash, seed=p.seed,
                    anchor_version=p.anchor_version)
        rd["arrays"] = _arrays(p.weights)
        if p.anchor is not None:
            rd["anchor"] = _arrays({"probs": np.asarray(p.anchor, np.float32)})
    elif isinstance(p, StatsInstruction):
        meta.update(round=p.round, task=p.task, base_hash=p.base_hash)
        rd["arrays"] = _arrays(p.weights)
    elif isinstance(p, EvalInstruction):
        meta.update(round=p.round, tasks=list(p.tasks), new_task=p.new_task, base_hash=p.base_hash,
                    anchor_version=p.anchor_version)
        rd["arrays"] = _arrays(p.weights)
        if p.ref_weights is not None:
            rd["ref"] = _arrays(p.ref_weights)
        if p.anchor is not None:
            rd["anchor"] = _arrays({"probs": np.asarray(p.anchor, np.float32)})
    elif isinstance(p, RlInstruction):
        meta.update(round=p.round, task=p.task, base_hash=p.base_hash, seed=p.seed)
        rd["arrays"] = _arrays(p.weights)
    elif isinstance(p, ModelUpdate):
        _check_update_keys(p.kind, p.metrics, tag)
        meta.update(num_examples=int(p.num_examples), party=_party(p.party), kind=p.kind)
        rd["arrays"] = _arrays({k: np.asarray(v, np.float32) for k, v in p.delta.items()})
        rd["metrics"] = MetricRecord({k: _finite_or_nan(v) for k, v in sorted(p.metrics.items())})
    elif isinstance(p, RouterStats):
        rd["stats"] = _arrays({"sums": np.asarray(p.sums, np.float64)})
    elif isinstance(p, EvalReply):
        meta.update(party=_party(p.party))
        rd["metrics"] = MetricRecord({k: _finite_or_nan(v) for k, v in sorted(p.metrics.items())})
    rd["meta"] = ConfigRecord(meta)
    return RecordDict(rd)


def _audit(p: object, tag: str) -> None:
    """Refuse to encode what decode would reject: non-finite arrays, negative counts, stray keys."""
    arrays: dict[str, np.ndarray] = {}
    for field_name in ("weights", "ref_weights", "delta"):
        arrays.update({f"{field_name}.{k}": v for k, v in (getattr(p, field_name, None) or {}).items()})
    for field_name in ("anchor", "sums"):
        if getattr(p, field_name, None) is not None:
            arrays[field_name] = getattr(p, field_name)
    for k, v in arrays.items():
        a = np.asarray(v)
        if a.dtype.kind not in "fiu":
            raise WireError(f"{tag}: array {k!r} has dtype {a.dtype}, expected a numeric array")
        if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
            raise WireError(f"{tag}: array {k!r} contains NaN or Inf")
    if isinstance(p, ModelUpdate) and p.num_examples < 0:
        raise WireError(f"{tag}: negative num_examples {p.num_examples}")
    if isinstance(p, EvalReply):
        _check_eval_keys(p.metrics, tag)


def _party(name: str) -> str:
    if not isinstance(name, str) or not _PARTY_RE.match(name):
        raise WireError(f"party name {name!r} is not an identifier (letters, digits, '-', '_'; <= 64)")
    return name


def _finite_or_nan(v: float) -> float:
    v = float(v)
    return v if math.isfinite(v) else float("nan")


def _expect_records(content: RecordDict, required: set[str], optional: set[str], tag: str) -> None:
    present = set(content.keys())
    missing = required - present
    extra = present - required - optional
    if missing or extra:
        raise WireError(f"{tag}: records {sorted(present)} do not match the schema "
                        f"(missing {sorted(missing)}, unexpected {sorted(extra)})")


META_KEYS = {
    SftInstruction: {"payload", "round", "task", "base_hash", "seed", "anchor_version"},
    RlInstruction: {"payload", "round", "task", "base_hash", "seed"},
    StatsInstruction: {"payload", "round", "task", "base_hash"},
    EvalInstruction: {"payload", "round", "tasks", "new_task", "base_hash", "anchor_version"},
    ModelUpdate: {"payload", "num_examples", "party", "kind"},
    RouterStats: {"payload"},
    EvalReply: {"payload", "party"},
}
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


def _single(rec: ArrayRecord, key: str, tag: str) -> np.ndarray:
    arrays = _read_arrays(rec, tag)
    if set(arrays) != {key}:
        raise WireError(f"{tag}: arrays {sorted(arrays)} != [{key!r}]")
    return arrays[key]


def decode(content: RecordDict, expected: type | None = None) -> object:
    """Payload of a record dict; a sender's ledger head record, if any, is checked and left aside
    (read it with :func:`ledger_head`)."""
    if LEDGER_RECORD in content:
        ledger_head(content)
        content = strip_ledger(content)
    if "meta" not in content.config_records:
        raise WireError("record has no 'meta' ConfigRecord: not a distmoe payload")
    meta = content.config_records["meta"]
    tag = meta.get("payload")
    if expected is SecureInstruction and "sa" in content:
        return _decode_secure_instruction(content)
    typ = TAG_TO_TYPE.get(tag)
    if typ is None:
        raise WireError(f"unknown payload type {tag!r}")
    if expected is not None and typ is not expected:
        raise WireError(f"expected {PAYLOAD_TAGS[expected]!r}, got {tag!r}")
    if typ in _SECURE_DECODERS:
        try:
            return _SECURE_DECODERS[typ](content, meta, tag)
        except KeyError as exc:
            raise WireError(f"{tag}: missing field {exc}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, WireError):
                raise
            raise WireError(f"{tag}: malformed: {exc}") from None
    extra_meta = sorted(set(meta.keys()) - META_KEYS[typ])
    if extra_meta:
        raise WireError(f"{tag}: unexpected meta fields {extra_meta}")
    try:
        if typ is SftInstruction:
            _expect_records(content, {"meta", "arrays"}, {"anchor"}, tag)
            anchor = _single(content.array_records["anchor"], "probs", tag) if "anchor" in content else None
            return SftInstruction(round=int(meta["round"]), task=str(meta["task"]),
                                  weights=_read_arrays(content.array_records["arrays"], tag),
                                  base_hash=str(meta["base_hash"]), seed=int(meta["seed"]),
                                  anchor=anchor, anchor_version=int(meta["anchor_version"]))
        if typ is RlInstruction:
            _expect_records(content, {"meta", "arrays"}, set(), tag)
            return RlInstruction(round=int(meta["round"]), task=str(meta["task"]),
                                 weights=_read_arrays(content.array_records["arrays"], tag),
                                 base_hash=str(meta["base_hash"]), seed=int(meta["seed"]))
        if typ is StatsInstruction:
            _expect_records(content, {"meta", "arrays"}, set(), tag)
            return StatsInstruction(round=int(meta["round"]), task=str(meta["task"]),
                                    weights=_read_arrays(content.array_records["arrays"], tag),
                                    base_hash=str(meta["base_hash"]))
        if typ is EvalInstruction:
            _expect_records(content, {"meta", "arrays"}, {"ref", "anchor"}, tag)
            anchor = _single(content.array_records["anchor"], "probs", tag) if "anchor" in content else None
            ref = _read_arrays(content.array_records["ref"], tag) if "ref" in content else None
            return EvalInstruction(round=int(meta["round"]), tasks=tuple(meta["tasks"]),
                                   new_task=str(meta["new_task"]),
                                   weights=_read_arrays(content.array_records["arrays"], tag),
                                   base_hash=str(meta["base_hash"]), ref_weights=ref, anchor=anchor,
                                   anchor_version=int(meta["anchor_version"]))
        if typ is ModelUpdate:
            _expect_records(content, {"meta", "arrays", "metrics"}, set(), tag)
            metrics = dict(content.metric_records["metrics"])
            kind = str(meta["kind"])
            _check_update_keys(kind, metrics, tag)
            n = int(meta["num_examples"])
            if n < 0:
                raise WireError(f"{tag}: negative num_examples {n}")
            return ModelUpdate(party=_party(str(meta["party"])),
                               delta=_read_arrays(content.array_records["arrays"], tag), num_examples=n,
                               metrics={k: float(v) for k, v in metrics.items()}, kind=kind)
        if typ is RouterStats:
            _expect_records(content, {"meta", "stats"}, set(), tag)
            return RouterStats(sums=_single(content.array_records["stats"], "sums", tag))
        if typ is EvalReply:
            _expect_records(content, {"meta", "metrics"}, set(), tag)
            metrics = {k: float(v) for k, v in content.metric_records["metrics"].items()}
            _check_eval_keys(metrics, tag)
            return EvalReply(party=_party(str(meta["party"])), metrics=metrics)
    except KeyError as exc:
        raise WireError(f"{tag}: missing field {exc}") from None
    raise WireError(f"unhandled payload type {tag!r}")  # pragma: no cover


# ------------------------------------------------------------------------------------------------
# Messages
# ------------------------------------------------------------------------------------------------
def instruction(payload: object, node_id: int) -> Message:
    mtype = MESSAGE_TYPE.get(type(payload))
    if mtype is None:
        raise WireError(f"{type(payload).__name__} is not a server instruction")
    return Message(content=encode(payload), dst_node_id=node_id, message_type=mtype)


def reply(payload: object, to: Message) -> Message:
    return Message(content=encode(payload), reply_to=to)


def error_reply(to: Message, code: int, reason: str) -> Message:
    from flwr.app import Error

    return Message(Error(code=code, reason=reason[:ERROR_MAX_BYTES]), reply_to=to)


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


def read_instruction(msg: Message, expected: type) -> object:
    return decode(msg.content, expected)


def read_reply(msg: Message, expected: type) -> tuple[int, object]:
    """``(source node id, payload)``; raises WireError for an error reply or a malformed one."""
    node = msg.metadata.src_node_id
    if msg.has_error():
        raise WireError(f"node {node} replied with an error: {msg.error.reason}")
    return node, decode(msg.content, expected)


def message_type(msg: Message) -> str:
    return msg.metadata.message_type


# ------------------------------------------------------------------------------------------------
# Secure aggregation payloads (privacy.mode = "secagg"): protocol messages of distmoe.privacy.secagg
# ------------------------------------------------------------------------------------------------
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


def _share_keys_records(k, prefix: str) -> dict:
    meta = ConfigRecord({"round": k.round, "sender": k.sender, "s_pk": k.s_pk, "b_commit": k.b_commit})
    return {f"{prefix}": meta, f"{prefix}_shares": _envelopes(k.shares, lambda e: e.recipient)}


def _read_share_keys(content: RecordDict, prefix: str, tag: str):
    m = content.config_records[prefix]
    _exact_keys(m, {"round", "sender", "s_pk", "b_commit"}, f"{tag}: {prefix}")
    sender, rnd = int(m["sender"]), int(m["round"])
    shares = _read_envelopes(content.array_records[f"{prefix}_shares"], f"{tag}: {prefix}_shares",
                             lambda i, n, c: sa.EncryptedShares(sender, i, rnd, n, c))
    return sa.ShareKeys(sender, rnd, bytes(m["s_pk"]), bytes(m["b_commit"]), shares)


def _exact_keys(rec, keys: set[str], what: str) -> None:
    if set(rec.keys()) != keys:
        raise WireError(f"{what}: fields {sorted(rec.keys())} != {sorted(keys)}")


def _release(name: str, tag: str) -> str:
    if name not in RELEASES:
        raise WireError(f"{tag}: unknown release {name!r} (one of {', '.join(RELEASES)})")
    return name


def _enc_setup(p: SetupRequest) -> RecordDict:
    return RecordDict({"meta": ConfigRecord({
        "payload": "setup-request", "secagg_run": p.secagg_run, "threshold": int(p.threshold),
        "max_length": int(p.max_length), "n_invited": int(p.n_invited),
        "noise_multiplier": float(p.noise_multiplier), "update_noise_multiplier": float(p.update_noise_multiplier),
        "logical_run": _logical_run(p.logical_run, "setup-request"), "epoch": _epoch(p.epoch, "setup-request")})})


def _logical_run(value, tag: str) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{0,128}", value):
        raise WireError(f"{tag}: logical_run must be up to 128 of [A-Za-z0-9_.:-], got {str(value)[:40]!r}")
    return value


def _epoch(value, tag: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1_000_000:
        raise WireError(f"{tag}: epoch must be an int in [0, 1e6), got {value!r}")
    return value


def _dec_setup(content, meta, tag) -> SetupRequest:
    _expect_records(content, {"meta"}, set(), tag)
    _exact_keys(meta, {"payload", "secagg_run", "threshold", "max_length", "n_invited", "noise_multiplier",
                       "update_noise_multiplier", "logical_run", "epoch"}, tag)
    return SetupRequest(bytes(meta["secagg_run"]), int(meta["threshold"]), int(meta["max_length"]),
                        int(meta["n_invited"]), float(meta["noise_multiplier"]), float(meta["update_noise_multiplier"]),
                        _logical_run(meta["logical_run"], tag), _epoch(meta["epoch"], tag))


def _enc_advert(p: KeyAdvertReply) -> RecordDict:
    if not re.fullmatch(r"[0-9a-f]{64}", p.ledger_public_key):
        raise WireError("key-advert: ledger_public_key must be 64 lowercase hex characters")
    return RecordDict({"meta": ConfigRecord({"payload": "key-advert", "party": _party(p.party), "c_pk": p.c_pk,
                                             "ledger_public_key": p.ledger_public_key})})


def _dec_advert(content, meta, tag) -> KeyAdvertReply:
    _expect_records(content, {"meta"}, {LEDGER_RECORD}, tag)
    _exact_keys(meta, {"payload", "party", "c_pk", "ledger_public_key"}, tag)
    pk = str(meta["ledger_public_key"])
    if not re.fullmatch(r"[0-9a-f]{64}", pk):
        raise WireError(f"{tag}: ledger_public_key is not 64 hex characters")
    c_pk = bytes(meta["c_pk"])
    if len(c_pk) != 32:
        raise WireError(f"{tag}: c_pk must be 32 bytes")
    return KeyAdvertReply(_party(str(meta["party"])), c_pk, pk)


def _enc_directory(p: DirectoryRequest) -> RecordDict:
    d = p.directory
    names = dict(p.names)
    ids = [cid for cid, _ in d.keys]
    return RecordDict({
        "meta": ConfigRecord({"payload": "key-directory", "secagg_run": d.run_id, "first_round": int(p.first_round),
                              "names": [_party(names[i]) for i in ids]}),
        "dir": _arrays({"ids": _u64(ids), "keys": _u8([k for _, k in d.keys], 32)})})


def _dec_directory(content, meta, tag) -> DirectoryRequest:
    _expect_records(content, {"meta", "dir"}, set(), tag)
    _exact_keys(meta, {"payload", "secagg_run", "first_round", "names"}, tag)
    arrays = _read_arrays(content.array_records["dir"], tag)
    if set(arrays) != {"ids", "keys"}:
        raise WireError(f"{tag}: arrays {sorted(arrays)} != ['ids', 'keys']")
    ids, keys = _ids(arrays["ids"], tag), _rows(arrays["keys"], 32, tag)
    names = [_party(str(n)) for n in meta["names"]]
    if not len(ids) == len(keys) == len(names):
        raise WireError(f"{tag}: {len(ids)} ids, {len(keys)} keys, {len(names)} names")
    return DirectoryRequest(sa.KeyDirectory(bytes(meta["secagg_run"]), tuple(zip(ids, keys, strict=True))),
                            int(meta["first_round"]), tuple(zip(ids, names, strict=True)))


def _enc_share_keys(p: ShareKeysReply) -> RecordDict:
    return RecordDict({"meta": ConfigRecord({"payload": "share-keys"}), **_share_keys_records(p.keys, "keys")})


def _dec_share_keys(content, meta, tag) -> ShareKeysReply:
    _expect_records(content, {"meta", "keys", "keys_shares"}, {LEDGER_RECORD}, tag)
    _exact_keys(meta, {"payload"}, tag)
    return ShareKeysReply(_read_share_keys(content, "keys", tag))


def _enc_secure_instruction(p: SecureInstruction) -> RecordDict:
    rd = encode(p.instruction)
    st = p.start
    sa_meta = {"release": _release(p.release, "secure instruction"), "has_start": st is not None}
    if st is not None:
        sa_meta.update(round=int(st.round), recipient=int(st.recipient), length=int(st.length))
        rd["sa_parts"] = _arrays({"ids": _u64(v for v, _ in st.participants),
                                  "s_pks": _u8([k for _, k in st.participants], 32)})
        rd["sa_shares"] = _envelopes(st.shares, lambda e: e.sender)
    rd["sa"] = ConfigRecord(sa_meta)
    return rd


def _decode_secure_instruction(content: RecordDict) -> SecureInstruction:
    m = content.config_records["sa"]
    tag = "secure instruction"
    try:
        has = bool(m["has_start"])
        _exact_keys(m, {"release", "has_start"} | ({"round", "recipient", "length"} if has else set()), tag)
        release = _release(str(m["release"]), tag)
        inner = RecordDict({k: v for k, v in content.items() if k not in ("sa", "sa_parts", "sa_shares")})
        if not has and ("sa_parts" in content or "sa_shares" in content):
            raise WireError(f"{tag}: protocol arrays without a round start")
        instr = decode(inner)
        if type(instr) not in MESSAGE_TYPE or type(instr) in (SetupRequest, DirectoryRequest, UnmaskRequestMsg):
            raise WireError(f"{tag}: carries {type(instr).__name__}, not a phase instruction")
        start = None
        if has:
            rnd, rcpt = int(m["round"]), int(m["recipient"])
            parts = _read_arrays(content.array_records["sa_parts"], tag)
            if set(parts) != {"ids", "s_pks"}:
                raise WireError(f"{tag}: sa_parts arrays {sorted(parts)} != ['ids', 's_pks']")
            ids, pks = _ids(parts["ids"], tag), _rows(parts["s_pks"], 32, tag)
            if len(ids) != len(pks):
                raise WireError(f"{tag}: {len(ids)} participants, {len(pks)} keys")
            shares = _read_envelopes(content.array_records["sa_shares"], f"{tag}: sa_shares",
                                     lambda i, n, c: sa.EncryptedShares(i, rcpt, rnd, n, c))
            start = sa.RoundStart(rnd, rcpt, tuple(zip(ids, pks, strict=True)), shares, int(m["length"]))
        return SecureInstruction(instr, start, release)
    except KeyError as exc:
        raise WireError(f"{tag}: missing field {exc}") from None


def _enc_masked(p: MaskedReply) -> RecordDict:
    rd: dict = {"meta": ConfigRecord({"payload": "masked-input", "release": _release(p.release, "masked-input"),
                                      "has_masked": p.masked is not None})}
    if p.masked is not None:
        m = p.masked
        if m.y.dtype != np.uint64:
            raise WireError("masked-input: y must be uint64 (Z_2^64)")
        rd["masked"] = ConfigRecord({"round": int(m.round), "sender": int(m.sender)})
        rd["masked_y"] = _arrays({"y": m.y})
        if m.next_keys is not None:
            rd.update(_share_keys_records(m.next_keys, "next"))
    if p.late_keys is not None:
        rd.update(_share_keys_records(p.late_keys, "next"))
    if (p.masked is None) == (p.late_keys is None):
        raise WireError("masked-input: exactly one of a masked input and late share keys")
    return RecordDict(rd)


def _dec_masked(content, meta, tag) -> MaskedReply:
    _exact_keys(meta, {"payload", "release", "has_masked"}, tag)
    release = _release(str(meta["release"]), tag)
    has = bool(meta["has_masked"])
    req = {"meta"} | ({"masked", "masked_y"} if has else {"next", "next_shares"})
    _expect_records(content, req, {"next", "next_shares", LEDGER_RECORD} if has else {LEDGER_RECORD}, tag)
    nxt = _read_share_keys(content, "next", tag) if "next" in content else None
    if not has:
        return MaskedReply(release, None, nxt)
    m = content.config_records["masked"]
    _exact_keys(m, {"round", "sender"}, f"{tag}: masked")
    y = _single(content.array_records["masked_y"], "y", tag)
    if y.dtype != np.uint64 or y.ndim != 1:
        raise WireError(f"{tag}: y must be uint64 [length], got {y.dtype} {y.shape}")
    return MaskedReply(release, sa.MaskedInput(int(m["sender"]), int(m["round"]), y, nxt), None)


def _enc_unmask_req(p: UnmaskRequestMsg) -> RecordDict:
    r = p.request
    return RecordDict({"meta": ConfigRecord({"payload": "unmask-request", "round": int(r.round)}),
                       "lists": _arrays({"alive": _u64(r.alive), "dead": _u64(r.dead)})})


def _dec_unmask_req(content, meta, tag) -> UnmaskRequestMsg:
    _expect_records(content, {"meta", "lists"}, set(), tag)
    _exact_keys(meta, {"payload", "round"}, tag)
    arrays = _read_arrays(content.array_records["lists"], tag)
    if set(arrays) != {"alive", "dead"}:
        raise WireError(f"{tag}: arrays {sorted(arrays)} != ['alive', 'dead']")
    return UnmaskRequestMsg(sa.UnmaskRequest(int(meta["round"]), _ids(arrays["alive"], tag), _ids(arrays["dead"], tag)))


def _enc_unmask_resp(p: UnmaskResponseMsg) -> RecordDict:
    r = p.response
    w = sa.shamir.SHARE_BYTES
    return RecordDict({
        "meta": ConfigRecord({"payload": "unmask-response", "round": int(r.round), "sender": int(r.sender)}),
        "shares": _arrays({"b_owner": _u64(o for o, _ in r.b_shares), "b_share": _u8([s for _, s in r.b_shares], w),
                           "s_owner": _u64(o for o, _ in r.s_shares), "s_share": _u8([s for _, s in r.s_shares], w)})})


def _dec_unmask_resp(content, meta, tag) -> UnmaskResponseMsg:
    _expect_records(content, {"meta", "shares"}, {LEDGER_RECORD}, tag)
    _exact_keys(meta, {"payload", "round", "sender"}, tag)
    a = _read_arrays(content.array_records["shares"], tag)
    if set(a) != {"b_owner", "b_share", "s_owner", "s_share"}:
        raise WireError(f"{tag}: arrays {sorted(a)} != ['b_owner', 'b_share', 's_owner', 's_share']")
    w = sa.shamir.SHARE_BYTES
    bo, bs = _ids(a["b_owner"], tag), _rows(a["b_share"], w, tag)
    so, ss = _ids(a["s_owner"], tag), _rows(a["s_share"], w, tag)
    if len(bo) != len(bs) or len(so) != len(ss):
        raise WireError(f"{tag}: owners and shares differ in number")
    return UnmaskResponseMsg(sa.UnmaskResponse(int(meta["sender"]), int(meta["round"]),
                                               tuple(zip(bo, bs, strict=True)), tuple(zip(so, ss, strict=True))))


_SECURE_ENCODERS = {SetupRequest: _enc_setup, KeyAdvertReply: _enc_advert, DirectoryRequest: _enc_directory,
                    ShareKeysReply: _enc_share_keys, SecureInstruction: _enc_secure_instruction,
                    MaskedReply: _enc_masked, UnmaskRequestMsg: _enc_unmask_req, UnmaskResponseMsg: _enc_unmask_resp}
_SECURE_DECODERS = {SetupRequest: _dec_setup, KeyAdvertReply: _dec_advert, DirectoryRequest: _dec_directory,
                    ShareKeysReply: _dec_share_keys, MaskedReply: _dec_masked, UnmaskRequestMsg: _dec_unmask_req,
                    UnmaskResponseMsg: _dec_unmask_resp}


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
    _exact_keys(rec, {"seq", "hash"}, "ledger head")
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
