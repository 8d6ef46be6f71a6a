"""Packing at the Flower message boundary: every ArrayRecord of an encoded record dict travels as ONE ``Array``.

Flower 1.42 moves a message as content-addressed objects, one request per object on each of its three hops
(ServerApp -> SuperLink -> SuperNode -> ClientApp, and back): the message, its record dict, each record, each
``Array`` of an ArrayRecord and each 5 MB chunk of an array are objects of their own. An instruction with one
array per trainable tensor is 30-60 objects; packed, each ArrayRecord becomes one uint8 ``.npy`` array (its arrays'
``.npy`` bytes back to back) under the record's name in the ``PACKED`` ArrayRecord, and ``MANIFEST`` (one
ConfigRecord) says, per array, its record, key, dtype, stype, shape and byte range. ConfigRecords and
MetricRecords travel as they are. An ArrayRecord shared by several messages (the global weights of a stage) packs
to the same bytes in each, so Flower still pushes its object once.

``pack`` runs where a message is built (``codec.instruction_content`` / ``codec.reply_content``, and the in-process
transport); ``unpack`` is the first step of each receiver's guard (``party_guard.serve``, ``ServerGuard.inbound``),
so the codec, the guards and both ledgers see, check and hash the logical records (one array per key), exactly
as before packing. ``unpack`` is strict: the manifest's lists must agree in length and type, the byte ranges of
a record must tile its packed array exactly (from 0, no gap, no overlap, nothing after), each range must be one
well-formed ``.npy`` (``inspect.parse_npy``) whose dtype and shape are the manifest's, no (record, key) twice, no
ArrayRecord outside the pack, and no record name twice; anything else raises ``WireError`` naming the record and
key. A record dict without ``PACKED`` is returned as it is (the unpacked form is the same logical content).

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
_STR_FIELDS = ("order", "records", "keys", "dtypes", "stypes")
_INT_FIELDS = ("ndims", "dims", "offsets", "sizes")
_FIELDS = frozenset(_STR_FIELDS + _INT_FIELDS)


def _u8_npy(parts: list[bytes]) -> bytes:
    """One uint8 ``.npy`` (format 1.0, as ``np.save`` writes it) holding ``parts`` back to back, in one copy."""
    total = sum(len(p) for p in parts)
    hdr = io.BytesIO()
    np.lib.format.write_array_header_1_0(hdr, {"descr": "|u1", "fortran_order": False, "shape": (total,)})
    return b"".join([hdr.getvalue(), *parts])


def pack(content: RecordDict) -> RecordDict:
    """``content`` with its ArrayRecords packed (module docstring); content without any is returned as it is."""
    if PACKED in content or MANIFEST in content:
        raise WireError(f"record names {PACKED!r} and {MANIFEST!r} are reserved for packing (already packed?)")
    arrays = [(name, rec) for name, rec in content.items() if isinstance(rec, ArrayRecord)]
    if not arrays:
        return content
    man: dict[str, list] = {f: [] for f in _STR_FIELDS + _INT_FIELDS}
    man["order"] = list(content.keys())
    packed = {}
    for name, rec in arrays:
        parts, offset = [], 0
        for key, arr in rec.items():
            data = bytes(arr.data)
            man["records"].append(name)
            man["keys"].append(key)
            man["dtypes"].append(str(arr.dtype))
            man["stypes"].append(str(arr.stype))
            man["ndims"].append(len(arr.shape))
            man["dims"].extend(int(d) for d in arr.shape)
            man["offsets"].append(offset)
            man["sizes"].append(len(data))
            parts.append(data)
            offset += len(data)
        packed[name] = Array(dtype="uint8", shape=(offset,), stype=inspect.STYPE, data=_u8_npy(parts))
    out = {name: rec for name, rec in content.items() if not isinstance(rec, ArrayRecord)}
    out[PACKED] = ArrayRecord(array_dict=packed)
    out[MANIFEST] = ConfigRecord(man)
    return RecordDict(out)


def _manifest(rec: object) -> dict[str, list]:
    if not isinstance(rec, ConfigRecord):
        raise WireError(f"packing: {MANIFEST!r} is not a ConfigRecord")
    if set(rec.keys()) != _FIELDS:
        raise WireError(f"packing: manifest fields {sorted(rec.keys())} != {sorted(_FIELDS)}")
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
    if any(len(man[f]) != n for f in ("records", "dtypes", "stypes", "ndims", "offsets", "sizes")):
        raise WireError("packing: manifest lists differ in length (" +
                        ", ".join(f"{f} {len(man[f])}" for f in sorted(_FIELDS - {"order", "dims"})) + ")")
    if sum(man["ndims"]) != len(man["dims"]):
        raise WireError(f"packing: manifest ndims sum to {sum(man['ndims'])}, dims has {len(man['dims'])}")
    return man


def unpack(content: RecordDict) -> RecordDict:
    """The logical record dict of a packed one (module docstring); raises ``WireError`` naming what is wrong."""
    if PACKED not in content and MANIFEST not in content:
        return content
    if PACKED not in content or MANIFEST not in content:
        raise WireError(f"packing: {PACKED!r} and {MANIFEST!r} travel together; only one of them is present")
    packed = content[PACKED]
    if not isinstance(packed, ArrayRecord):
        raise WireError(f"packing: {PACKED!r} is not an ArrayRecord")
    man = _manifest(content[MANIFEST])
    rest = {name: rec for name, rec in content.items() if name not in (PACKED, MANIFEST)}
    loose = sorted(name for name, rec in rest.items() if isinstance(rec, ArrayRecord))
    if loose:
        raise WireError(f"packing: ArrayRecords {loose} travel outside the pack")
    clash = sorted(set(packed.keys()) & set(rest))
    if clash:
        raise WireError(f"packing: records {clash} are both packed and unpacked")
    order = man["order"]
    names = set(rest) | set(packed.keys())
    if len(set(order)) != len(order) or set(order) != names:
        raise WireError(f"packing: manifest order {sorted(order)} != the records {sorted(names)}")
    unknown = sorted(set(man["records"]) - set(packed.keys()))
    if unknown:
        raise WireError(f"packing: manifest names records {unknown} that are not packed")
    records: dict[str, dict[str, Array]] = {name: {} for name in packed.keys()}
    ends = dict.fromkeys(packed.keys(), 0)
    blobs = {}
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
    short = sorted(f"{name} ({ends[name]} of {blobs[name].size} bytes)" for name in packed.keys()
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
