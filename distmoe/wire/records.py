"""The field kinds of the wire codec: how each kind of dataclass field is written into Flower records
and read back strictly. Part of the codec (``distmoe.wire.codec`` drives it from ``schema.PAYLOADS``).

Owns: ``WireError``; the encoder/decoder state (``Out`` collects records, ``In`` tracks what decoding
read, so that anything left unread is rejected); ``Kind`` and the kinds of plain payloads (scalars,
arrays, metrics: ``BASIC_KINDS``); the checks every value passes (party names, metric keys, releases,
numeric and finite arrays parsed by ``inspect.check_array``). The SecAgg protocol's kinds are
``distmoe.wire.secagg_kinds``.

Must not: know about models, data or training, or be used outside ``distmoe.wire``.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from distmoe.wire import inspect
from distmoe.wire.schema import (
    EVAL_ROUTING_KEYS,
    OBJECTIVES,
    RELEASES,
    RL_METRIC_KEYS,
    RL_SIM_METRIC_KEYS,
    TRAIN_METRIC_KEYS,
    PayloadType,
    ProbePart,
)

_PARTY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


class WireError(ValueError):
    """A record does not conform to the payload schema. ``reason``: the name of the closed reason table
    (``distmoe.wire.errors.ALL_REASONS``) the server guard files it under (``rejected`` unless said)."""

    def __init__(self, *args, reason: str = "rejected"):
        super().__init__(*args)
        self.reason = reason


def npy_bytes(a: np.ndarray) -> bytes:
    """Exactly ``np.save``'s bytes of the C-contiguous ``a`` (format 1.0 header + data) in one allocation and one
    copy. Flower's ``Array(ndarray)`` runs ``np.save`` into a ``BytesIO``, which writes 16 MiB pieces into a
    growing buffer: 25 ms instead of 3 ms for a 28.5 MB update vector, most of it fresh memory (a test pins the
    bytes to ``np.save``'s)."""
    hdr = io.BytesIO()
    np.lib.format.write_array_header_1_0(hdr, np.lib.format.header_data_from_array_1_0(a))
    return b"".join((hdr.getvalue(), a.reshape(-1).view(np.uint8) if a.size else b""))


def _array(v: np.ndarray) -> Array:
    a = np.ascontiguousarray(v)
    return Array(dtype=str(a.dtype), shape=tuple(a.shape), stype=inspect.STYPE, data=npy_bytes(a))


def _arrays(d: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord(array_dict={k: _array(v) for k, v in sorted(d.items())})


def _read_arrays(rec: ArrayRecord, what: str, copy: bool = True) -> dict[str, np.ndarray]:
    """Every array parsed strictly (``inspect.check_array``: header equal to metadata, no trailing bytes,
    numeric dtypes only, finite floats) and copied out of the record; ``copy=False``: read-only views of the
    record's bytes instead (for a large vector its readers only read: no copy into fresh memory per decode)."""
    out = {}
    for k, arr in rec.items():
        try:
            view = inspect.check_array(arr, f"{what}: array {k!r}")
            out[k] = np.array(view) if copy else view
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


def _objective(name: str, tag: str) -> str:
    if name not in OBJECTIVES:
        raise WireError(f"{tag}: unknown objective {name!r} (absent = sft, or one of {', '.join(OBJECTIVES)})")
    return name


def _release(name: str, tag: str) -> str:
    if name not in RELEASES:
        raise WireError(f"{tag}: unknown release {name!r} (one of {', '.join(RELEASES)})")
    return name


# ------------------------------------------------------------------------------------------------
# The table-driven codec: an Out collects records while encoding, an In tracks what decoding read
# ------------------------------------------------------------------------------------------------
class Out:
    def __init__(self, pt: PayloadType, payload: object, memo=None):
        self.pt, self.payload, self.tag = pt, payload, pt.tag or "secure instruction"
        self.memo = memo  # the exchange's memo (``server_guard.ExchangeMemo``) or None: what its messages share
        self.recs: dict[str, dict | ArrayRecord | MetricRecord | ConfigRecord] = {}

    def config(self, name: str) -> dict:
        return self.recs.setdefault(name, {})

    def record_dict(self) -> RecordDict:
        order = [k for k in self.recs if k not in self.pt.records] + [k for k in self.pt.records if k in self.recs]
        return RecordDict({k: ConfigRecord(v) if isinstance(v, dict) else v for k, v in
                           ((k, self.recs[k]) for k in order)})


class In:
    def __init__(self, content: RecordDict, pt: PayloadType, tag: str):
        self.content, self.pt, self.tag = content, pt, tag
        self.used: dict[str, set[str]] = {}  # record -> the ConfigRecord keys read

    def has(self, name: str) -> bool:
        return name in self.content

    def has_at(self, at: str) -> bool:
        """Is ``at`` (``"<record>"`` or ``"<record>.<key>"`` of a ConfigRecord) on the wire?"""
        name, _, key = at.partition(".")
        if name not in self.content:
            return False
        rec = self.content[name]
        return not key or (isinstance(rec, ConfigRecord) and key in rec)

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

    def arrays(self, name: str, keys: set[str] | None = None, *, copy: bool = True) -> dict[str, np.ndarray]:
        rec = self.record(name)
        if not isinstance(rec, ArrayRecord):
            raise WireError(f"{self.tag}: record {name!r} is not an ArrayRecord")
        out = _read_arrays(rec, self.tag if name in ("arrays", "ref") else f"{self.tag}: {name}", copy)
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

    def put(out: Out, at: str, v) -> None:
        name, key = at.split(".", 1)
        out.config(name)[key] = enc(v, out.tag, key)

    def take(inp: In, at: str, got: dict):
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
    def put(out: Out, at: str, v) -> None:
        _check_numeric(v, out.tag, at)
        out.recs[at] = _arrays(v if dtype is None else {k: np.asarray(a, dtype) for k, a in v.items()})

    return Kind(put, lambda inp, at, got: inp.arrays(at))


def _single(key: str, dtype) -> Kind:
    def put(out: Out, at: str, v) -> None:
        _check_numeric({key: v}, out.tag, at)
        out.recs[at] = _arrays({key: np.asarray(v, dtype)})

    return Kind(put, lambda inp, at, got: inp.arrays(at, {key})[key])


def _metrics(check: Callable) -> Kind:
    def put(out: Out, at: str, v) -> None:
        check(out.payload, v, out.tag)
        out.recs[at] = MetricRecord({k: _finite_or_nan(x) for k, x in sorted(v.items())})

    def take(inp: In, at: str, got: dict) -> dict[str, float]:
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



def _epsilon_cap(value, tag: str) -> float:
    """A party's declared budget cap (node config ``epsilon-max``): a finite float >= 0, 0 = no cap."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= float(value) < 1e6:
        raise WireError(f"{tag}: epsilon_max must be a number in [0, 1e6) (0 = no cap), got {value!r}")
    return float(value)


def _prompts(v, tag: str) -> tuple[str, ...]:
    """The public probe prompts of a probe instruction: 1..256 strings of at most 2000 characters."""
    items = tuple(v) if isinstance(v, (list, tuple)) else None
    if not items or len(items) > 256 or not all(isinstance(p, str) and 0 < len(p) <= 2000 for p in items):
        raise WireError(f"{tag}: prompts must be 1..256 strings of 1..2000 characters")
    return items


PROBE_ROW_TOL = 1e-3  # a carried probe's routing rows are distributions: each sums to 1 within this


def probe_part_problem(routing: np.ndarray, top1: np.ndarray) -> str | None:
    """None if a carried probe's arrays are what a probe can produce: ``routing`` a finite float64 ``[L, E]`` of
    distributions (entries in [0, 1], rows summing to 1), ``top1`` an int32 ``[L, N]``, ``N >= 1``, of expert indices
    in ``[0, E)``; else the reason. The shapes against the model and the prompts: each guard (``check_probe_part``)."""
    r, t = np.asarray(routing), np.asarray(top1)
    if r.dtype != np.float64 or r.ndim != 2 or 0 in r.shape or not np.all(np.isfinite(r)):
        return f"probe routing must be a finite float64 [L, E] array, got {r.dtype} {list(r.shape)}"
    if np.any(r < 0) or np.any(r > 1) or np.any(np.abs(r.sum(1) - 1) > PROBE_ROW_TOL):
        return "probe routing rows must be distributions (entries in [0, 1], each row summing to 1)"
    if t.dtype != np.int32 or t.ndim != 2 or t.shape[0] != r.shape[0] or t.shape[1] < 1:
        return f"probe top1 must be an int32 [L, N] array with L = {r.shape[0]}, got {t.dtype} {list(t.shape)}"
    if np.any(t < 0) or np.any(t >= r.shape[1]):
        return f"probe top1 holds values outside the experts [0, {r.shape[1]})"
    return None


def _probe_part() -> Kind:
    """A carried routing probe (``schema.ProbePart``) in the records ``probe`` (``routing``) and ``top1``."""
    def put(out: Out, at: str, v) -> None:
        why = probe_part_problem(np.asarray(v.routing), np.asarray(v.top1))
        if why:
            raise WireError(f"{out.tag}: {why}")
        out.recs[at] = _arrays({"routing": np.asarray(v.routing)})
        out.recs["top1"] = _arrays({"top1": np.asarray(v.top1)})

    def take(inp: In, at: str, got: dict):
        part = ProbePart(inp.arrays(at, {"routing"})["routing"], inp.arrays("top1", {"top1"})["top1"])
        why = probe_part_problem(part.routing, part.top1)
        if why:
            raise WireError(f"{inp.tag}: {why}")
        return part

    return Kind(put, take)


def _text(v, tag: str, key: str) -> str:
    return str(v)



BASIC_KINDS: dict[str, Kind] = {
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
    "objective": _scalar(lambda v, tag, key: _objective(v, tag), lambda v, tag, key: _objective(str(v), tag),
                         text=True),
    "logical-run": _scalar(lambda v, tag, key: _logical_run(v, tag), text=True),
    "epoch": _scalar(lambda v, tag, key: _epoch(v, tag)),
    "epsilon-cap": _scalar(lambda v, tag, key: _epsilon_cap(v, tag), lambda v, tag, key: _epsilon_cap(v, tag)),
    "weights": _weights(),
    "deltas": _weights(np.float32),
    "probs": _single("probs", np.float32),
    "sums": _single("sums", np.float64),
    "update-metrics": _metrics(lambda p, m, tag: _check_update_keys(_kind_of(p), m, tag)),
    "eval-metrics": _metrics(lambda p, m, tag: _check_eval_keys(m, tag)),
    "prompts": _scalar(lambda v, tag, key: list(_prompts(v, tag)), lambda v, tag, key: _prompts(v, tag), text=True),
    "probe-routing": _single("routing", np.float64),
    "probe-top1": _single("top1", np.int32),
    "settle-bias": _single("bias", np.float64),
    "probe-part": _probe_part(),
}
