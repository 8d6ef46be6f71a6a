"""Packing at the Flower message boundary: a message's records travel as one ArrayRecord and one ConfigRecord
(a short message as the ConfigRecord alone).

Flower 1.42 moves a message as content-addressed objects, one request per object on each of its three hops
(ServerApp -> SuperLink -> SuperNode -> ClientApp, and back): the message, its record dict, each record, each
``Array`` of an ArrayRecord and each 5 MB chunk of an array are objects of their own. A distmoe instruction with one
array per trainable tensor is 40-100 objects, a SecAgg stage 9-23. Packed, a message is the ``PACKED`` ArrayRecord,
holding each ArrayRecord as one uint8 ``.npy`` array (its arrays' ``.npy`` bytes back to back) under the record's
name, and ``MANIFEST``, one ConfigRecord: per array its record, key, dtype, stype, shape and byte range; the record
names in order with their kinds; and every ConfigRecord and MetricRecord value as it is (``v<i>``, with its record
and key). An ArrayRecord shared by several messages (the global weights of a stage) packs to the same bytes in
each, so Flower still pushes its object once. A short message (its arrays ``INLINE_MAX`` bytes or less in all: a
SecAgg stage, a masked sum of evaluation counts or router statistics) carries its records' packed bytes inside the
manifest instead (``inline``: the record names, ``a<j>``: each one's bytes), so it is three objects (the message, its
record dict, the manifest) instead of six: each object is a request on each hop, two at a time.

``pack`` runs where a message is built (``codec.instruction_content`` / ``codec.reply_content``, and the in-process
transport); ``unpack`` is the first step of each receiver's guard (``party_guard.serve``, ``ServerGuard.inbound``)
and of ``codec.decode``, so the codec, the guards and both ledgers see, check and hash the logical records (one
array per key), exactly as before packing. ``unpack`` is strict: no record outside the pack, the manifest's lists
agree in length and type, the byte ranges of a record tile its packed array exactly (from 0, no gap, no overlap,
nothing after), each range is one well-formed ``.npy`` (``inspect.parse_npy``) whose dtype and shape are the
manifest's, no (record, key) twice, metric values are numbers; anything else raises ``WireError`` naming the record
and key. A record dict without ``MANIFEST`` is returned as it is (the unpacked form is the same logical content).

Must not: decode payloads, or check values (finiteness, declared keys, shapes, budgets: the codec and the guards
do that on the unpacked records).
"""

from __future__ import annotations

import io

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from distmoe.wire import inspect
from distmoe.wire.records import WireError

PACKED = "packed"  # ArrayRecord: record name -> that record's arrays as one uint8 .npy array
MANIFEST = "packed_manifest"  # ConfigRecord: the arrays' names, layout and byte ranges (``_FIELDS``)
INLINE_MAX = 256 * 1024  # bytes: a message whose arrays hold at most this many travels as the manifest alone
_STR_FIELDS = ("order", "kinds", "records", "keys", "dtypes", "stypes", "value_records", "value_keys", "inline")
_INT_FIELDS = ("ndims", "dims", "offsets", "sizes")
_FIELDS = frozenset(_STR_FIELDS + _INT_FIELDS)


def _u8_npy(parts: list[bytes]) -> bytes:
    """One uint8 ``.npy`` (format 1.0, as ``np.save`` writes it) holding ``parts`` back to back, in one copy."""
    total = sum(len(p) for p in parts)
    hdr = io.BytesIO()
    np.lib.format.write_array_header_1_0(hdr, {"descr": "|u1", "fortran_order": False, "shape": (total,)})
    return b"".join([hdr.getvalue(), *parts])


_SEGMENT = ("records", "keys", "dtypes", "stypes", "ndims", "dims", "offsets", "sizes")  # one array record's fields


def _segment(name: str, rec: ArrayRecord) -> tuple[dict[str, list], list[bytes]]:
    """One ArrayRecord's manifest fields (``_SEGMENT``; offsets from its own first byte) and its arrays' bytes."""
    seg: dict[str, list] = {f: [] for f in _SEGMENT}
    parts, offset = [], 0
    for key, arr in rec.items():
        data = bytes(arr.data)
        seg["records"].append(name)
        seg["keys"].append(key)
        seg["dtypes"].append(str(arr.dtype))
        seg["stypes"].append(str(arr.stype))
        seg["ndims"].append(len(arr.shape))
        seg["dims"].extend(int(d) for d in arr.shape)
        seg["offsets"].append(offset)
        seg["sizes"].append(len(data))
        parts.append(data)
        offset += len(data)
    return seg, parts


def _pack_record(name: str, rec: ArrayRecord) -> tuple[dict[str, list], Array]:
    """One ArrayRecord's manifest fields and its packed array."""
    seg, parts = _segment(name, rec)
    size = sum(len(p) for p in parts)
    return seg, Array(dtype="uint8", shape=(size,), stype=inspect.STYPE, data=_u8_npy(parts))


def pack(content: RecordDict, memo=None, inline_max: int = INLINE_MAX) -> RecordDict:
    """``content`` packed (module docstring): the ``PACKED`` ArrayRecord (when it has arrays) and ``MANIFEST``.
    ``memo`` (the exchange's ``server_guard.ExchangeMemo``): an ArrayRecord object that several of its messages carry
    (one model's weights to every party) is packed once and its packed array shared (arrays are never changed).
    Arrays of ``inline_max`` bytes or less in all travel inside the manifest (0: never)."""
    if PACKED in content or MANIFEST in content:
        raise WireError(f"record names {PACKED!r} and {MANIFEST!r} are reserved for packing (already packed?)")
    if not len(content):
        return content
    man: dict[str, list] = {f: [] for f in _STR_FIELDS + _INT_FIELDS}
    man["order"] = list(content.keys())
    packed, values = {}, {}
    inline = inline_max > 0 and sum(len(a.data) for rec in content.values() if isinstance(rec, ArrayRecord)
                                    for a in rec.values()) <= inline_max
    for name, rec in content.items():
        if not isinstance(rec, ArrayRecord):  # a ConfigRecord's or MetricRecord's values, each as it is
            man["kinds"].append("metric" if isinstance(rec, MetricRecord) else "config")
            for key, v in rec.items():
                values[f"v{len(man['value_keys'])}"] = v
                man["value_records"].append(name)
                man["value_keys"].append(key)
            continue
        man["kinds"].append("array")
        if inline:
            seg, parts = _segment(name, rec)
            values[f"a{len(man['inline'])}"] = b"".join(parts)
            man["inline"].append(name)
        else:
            seg, packed[name] = (_pack_record(name, rec) if memo is None else
                                 memo.once("pack", (rec,), lambda n=name, r=rec: _pack_record(n, r), (name,)))
        for f in _SEGMENT:
            man[f].extend(seg[f])
    out = {PACKED: ArrayRecord(array_dict=packed)} if packed else {}
    out[MANIFEST] = ConfigRecord({**man, **values})
    return RecordDict(out)


def _manifest(rec: object) -> dict[str, list]:
    if not isinstance(rec, ConfigRecord):
        raise WireError(f"packing: {MANIFEST!r} is not a ConfigRecord")
    nv = len(rec["value_keys"]) if isinstance(rec.get("value_keys"), list) else 0
    na = len(rec["inline"]) if isinstance(rec.get("inline"), list) else 0
    want = _FIELDS | {f"v{i}" for i in range(nv)} | {f"a{j}" for j in range(na)}
    if set(rec.keys()) != want:
        extra = sorted(set(rec.keys()) - want)
        raise WireError(f"packing: manifest fields: missing {sorted(want - set(rec.keys()))[:5]}, unexpected "
                        f"{extra[:5]} (values v0..v{nv - 1}, inline records a0..a{na - 1})")
    man = {}
    for f in _FIELDS:
        v = rec[f]
        want = str if f in _STR_FIELDS else int
        if not isinstance(v, list) or not all(type(x) is want for x in v):
            raise WireError(f"packing: manifest field {f!r} is not a list of {want.__name__}")
        if want is int and any(x < 0 for x in v):
            raise WireError(f"packing: manifest field {f!r} holds a negative number")
        man[f] = v
    n = len(man["keys"])
    if any(len(man[f]) != n for f in ("records", "dtypes", "stypes", "ndims", "offsets", "sizes")) or \
            len(man["kinds"]) != len(man["order"]) or len(man["value_records"]) != nv:
        raise WireError("packing: manifest lists differ in length (" +
                        ", ".join(f"{f} {len(man[f])}" for f in sorted(_FIELDS - {"dims"})) + ")")
    if sum(man["ndims"]) != len(man["dims"]):
        raise WireError(f"packing: manifest ndims sum to {sum(man['ndims'])}, dims has {len(man['dims'])}")
    if not set(man["kinds"]) <= {"array", "config", "metric"} or len(set(man["order"])) != len(man["order"]):
        raise WireError(f"packing: manifest kinds {sorted(set(man['kinds']))} (array, config, metric) or a record "
                        "named twice in its order")
    man["values"] = [rec[f"v{i}"] for i in range(nv)]
    man["inline_bytes"] = [rec[f"a{j}"] for j in range(na)]
    if not all(type(b) is bytes for b in man["inline_bytes"]):
        raise WireError("packing: an inline record's value (a<j>) is not bytes")
    return man


def _values(man: dict[str, list]) -> dict[str, ConfigRecord | MetricRecord]:
    """The ConfigRecords and MetricRecords of the manifest's values."""
    kinds = dict(zip(man["order"], man["kinds"], strict=True))
    out = {name: {} for name, kind in kinds.items() if kind != "array"}
    for name, key, v in zip(man["value_records"], man["value_keys"], man["values"], strict=True):
        if name not in out:
            raise WireError(f"packing: value {name}.{key}: no config or metric record {name!r} in the manifest")
        if key in out[name]:
            raise WireError(f"packing: value {name}.{key} is in the manifest twice")
        out[name][key] = v
    try:
        return {name: (MetricRecord if kinds[name] == "metric" else ConfigRecord)(vals) for name, vals in out.items()}
    except (TypeError, ValueError) as exc:
        raise WireError(f"packing: a metric record holds a value that is not a number: {exc}") from None


def unpack(content: RecordDict) -> RecordDict:
    """The logical record dict of a packed one (module docstring); raises ``WireError`` naming what is wrong."""
    if MANIFEST not in content:
        if PACKED in content:
            raise WireError(f"packing: {PACKED!r} travels without its {MANIFEST!r}")
        return content
    loose = sorted(set(content.keys()) - {PACKED, MANIFEST})
    if loose:
        raise WireError(f"packing: records {loose} travel outside the pack")
    packed = content[PACKED] if PACKED in content else ArrayRecord()
    if not isinstance(packed, ArrayRecord):
        raise WireError(f"packing: {PACKED!r} is not an ArrayRecord")
    man = _manifest(content[MANIFEST])
    arrays = [name for name, kind in zip(man["order"], man["kinds"], strict=True) if kind == "array"]
    carried = list(packed.keys()) + man["inline"]
    if sorted(arrays) != sorted(carried):
        raise WireError(f"packing: the manifest's array records {sorted(arrays)} != the packed {sorted(carried)} "
                        "(each once, in the packed record or inline)")
    rest = _values(man)
    order = man["order"]
    unknown = sorted(set(man["records"]) - set(carried))
    if unknown:
        raise WireError(f"packing: manifest names records {unknown} that are not packed")
    records: dict[str, dict[str, Array]] = {name: {} for name in carried}
    ends = dict.fromkeys(carried, 0)
    blobs = {name: np.frombuffer(b, np.uint8) for name, b in zip(man["inline"], man["inline_bytes"], strict=True)}
    for name, arr in packed.items():
        try:
            blobs[name] = inspect.check_array(arr, f"packing: {PACKED}.{name}", dtype=np.uint8, finite=False)
        except inspect.InspectError as exc:
            raise WireError(str(exc)) from None
        if blobs[name].ndim != 1:
            raise WireError(f"packing: {PACKED}.{name} has shape {list(blobs[name].shape)}, expected one dimension")
    dims = iter(man["dims"])
    for i, (name, key) in enumerate(zip(man["records"], man["keys"], strict=True)):
        where = f"packing: array {name}.{key}"
        shape = tuple(next(dims) for _ in range(man["ndims"][i]))
        if key in records[name]:
            raise WireError(f"{where} is in the manifest twice")
        off, size, blob = man["offsets"][i], man["sizes"][i], blobs[name]
        if off != ends[name]:
            raise WireError(f"{where}: offset {off}, but the record's previous array ends at byte {ends[name]} "
                            "(the ranges must tile the packed array: no gap, no overlap)")
        if off + size > blob.size:
            raise WireError(f"{where}: bytes {off}..{off + size} run past the packed array's {blob.size} bytes")
        ends[name] = off + size
        data = blob[off:off + size].tobytes()
        if man["stypes"][i] != inspect.STYPE:
            raise WireError(f"{where}: stype {man['stypes'][i]!r}, expected {inspect.STYPE!r}")
        try:
            dt, shp = inspect.parse_npy(data, where)
        except inspect.InspectError as exc:
            raise WireError(str(exc)) from None
        if str(dt) != man["dtypes"][i] or shp != shape:
            raise WireError(f"{where}: its bytes hold {dt}{list(shp)}, "
                            f"the manifest says {man['dtypes'][i]}{list(shape)}")
        records[name][key] = Array(dtype=man["dtypes"][i], shape=shape, stype=inspect.STYPE, data=data)
    short = sorted(f"{name} ({ends[name]} of {blobs[name].size} bytes)" for name in carried
                   if ends[name] != blobs[name].size)
    if short:
        raise WireError(f"packing: the manifest's arrays do not cover the packed records: {', '.join(short)}")
    out = {name: rest[name] if name in rest else ArrayRecord(array_dict=records[name]) for name in order}
    return RecordDict(out)


def object_count(content: RecordDict, chunk: int | None = None) -> int:
    """How many Flower objects a message with this content is: the message, its record dict, each record, each
    array and each of its chunks (``chunk`` bytes, default Flower's ``FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE``)."""
    from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE

    chunk = chunk or FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
    n = 2 + len(content)
    for rec in content.values():
        if isinstance(rec, ArrayRecord):
            n += sum(1 + max(1, -(-len(a.data) // chunk)) for a in rec.values())
        elif not isinstance(rec, (ConfigRecord, MetricRecord)):
            raise WireError(f"packing: unknown record type {type(rec).__name__}")
    return n
