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

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from distmoe.wire.schema import (
    EVAL_ROUTING_KEYS,
    PAYLOAD_TAGS,
    RL_METRIC_KEYS,
    RL_SIM_METRIC_KEYS,
    TRAIN_METRIC_KEYS,
    EvalInstruction,
    EvalReply,
    ModelUpdate,
    RlInstruction,
    RouterStats,
    SftInstruction,
    StatsInstruction,
)

_PARTY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
TAG_TO_TYPE = {v: k for k, v in PAYLOAD_TAGS.items()}

# message types (Flower's "train.<action>" / "evaluate")
MSG_SFT = "train.sft"
MSG_STATS = "train.stats"
MSG_RL = "train.rl"
MSG_EVAL = "evaluate"
MESSAGE_TYPE = {SftInstruction: MSG_SFT, RlInstruction: MSG_RL, StatsInstruction: MSG_STATS,
                EvalInstruction: MSG_EVAL}


class WireError(ValueError):
    """A record does not conform to the payload schema."""


def _arrays(d: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord(array_dict={k: Array(np.ascontiguousarray(v)) for k, v in sorted(d.items())})


def _read_arrays(rec: ArrayRecord, what: str) -> dict[str, np.ndarray]:
    out = {}
    for k, arr in rec.items():
        a = arr.numpy()
        if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
            raise WireError(f"{what}: array {k!r} contains NaN or Inf")
        out[k] = a
    return out


def encode(payload: object) -> RecordDict:
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
    if "meta" not in content.config_records:
        raise WireError("record has no 'meta' ConfigRecord: not a distmoe payload")
    meta = content.config_records["meta"]
    tag = meta.get("payload")
    typ = TAG_TO_TYPE.get(tag)
    if typ is None:
        raise WireError(f"unknown payload type {tag!r}")
    if expected is not None and typ is not expected:
        raise WireError(f"expected {PAYLOAD_TAGS[expected]!r}, got {tag!r}")
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

    return Message(Error(code=code, reason=reason[:2000]), reply_to=to)


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
