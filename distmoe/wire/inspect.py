"""Byte-level inspection of Flower records that arrive from another process (the server-side
inbound guard's low level): strict ``.npy`` parsing of every ``Array`` (no trailing or missing
bytes, no object / structured / non-native dtypes, header equal to the ``Array`` metadata),
byte budgets (``record_bytes``), a canonical content digest (``digest`` / ``describe``), string
allow-lists (``check_strings``) and declarative record layouts (``check_layout``).

Everything here only reads records and raises ``InspectError`` (a ``ValueError``) naming the
record, key and what was wrong. Must not: decode records into payloads (``distmoe/wire/codec.py``
does that), build records or messages, or do any I/O.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import math
import struct
from collections.abc import Collection, Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

MAGIC = b"\x93NUMPY"
MAX_HEADER = 10_000  # numpy's own default max_header_size
_LEN_FIELD = {(1, 0): ("<H", "latin1"), (2, 0): ("<I", "latin1"), (3, 0): ("<I", "utf8")}
_HEADER_KEYS = {"descr", "fortran_order", "shape"}
_KINDS = "biufc"  # bool, signed, unsigned, float, complex: nothing that can carry text or objects
STYPE = "numpy.ndarray"


class InspectError(ValueError):
    """An inbound record failed byte-level inspection; the message names record, key and reason."""


@functools.lru_cache(maxsize=1024)
def _literal(text: str):
    """``ast.literal_eval(text)``, memoised by the header text (a pure function of it; an exception is raised again
    every time, never cached): every round's records carry the same few hundred headers (55 us each to parse).
    The value is shared between calls, so callers only read it."""
    return ast.literal_eval(text)


def parse_npy(data: bytes, where: str) -> tuple[np.dtype, tuple[int, ...]]:
    """Parse and check a ``.npy`` serialization; return ``(dtype, shape)``.

    ``len(data)`` must be exactly ``header_end + prod(shape) * itemsize`` (the payload is then
    the last ``prod(shape) * itemsize`` bytes).
    """
    if not isinstance(data, bytes):
        raise InspectError(f"{where}: data is {type(data).__name__}, not bytes")
    if len(data) < 10 or data[:6] != MAGIC:
        raise InspectError(f"{where}: not a .npy payload (bad magic)")
    version = (data[6], data[7])
    if version not in _LEN_FIELD:
        raise InspectError(f"{where}: unsupported .npy version {version[0]}.{version[1]}")
    fmt, encoding = _LEN_FIELD[version]
    start = 8 + struct.calcsize(fmt)
    if len(data) < start:
        raise InspectError(f"{where}: truncated .npy header length field")
    (hlen,) = struct.unpack_from(fmt, data, 8)
    header_end = start + hlen
    if hlen > MAX_HEADER:
        raise InspectError(f"{where}: .npy header of {hlen} bytes exceeds {MAX_HEADER}")
    if len(data) < header_end:
        raise InspectError(f"{where}: truncated .npy header ({len(data) - start} of {hlen} bytes)")
    try:
        text = data[start:header_end].decode(encoding).strip()
    except UnicodeDecodeError as e:
        raise InspectError(f"{where}: .npy header is not {encoding}") from e
    if not (text.startswith("{") and text.endswith("}")):
        raise InspectError(f"{where}: .npy header is not a dict literal")
    try:
        header = _literal(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError) as e:
        raise InspectError(f"{where}: .npy header is not a literal: {e}") from e
    if not isinstance(header, dict) or set(header) != _HEADER_KEYS:
        keys = sorted(map(str, header)) if isinstance(header, dict) else type(header).__name__
        raise InspectError(f"{where}: .npy header keys {keys}, expected {sorted(_HEADER_KEYS)}")
    descr, fortran, shape = header["descr"], header["fortran_order"], header["shape"]
    if fortran is not False:
        raise InspectError(f"{where}: fortran_order={fortran!r} (only C order is accepted)")
    if not isinstance(descr, str) or not descr or descr[0] not in "<|=":
        raise InspectError(f"{where}: dtype descr {descr!r} is not a native/little-endian type string")
    try:
        dtype = np.dtype(descr)
    except TypeError as e:
        raise InspectError(f"{where}: bad dtype descr {descr!r}") from e
    if dtype.kind not in _KINDS or dtype.fields is not None or dtype.subdtype is not None or dtype.itemsize < 1:
        raise InspectError(f"{where}: dtype {descr!r} not allowed (only plain bool/int/uint/float/complex)")
    if dtype.byteorder == ">":
        raise InspectError(f"{where}: big-endian dtype {descr!r}")
    if not isinstance(shape, tuple) or not all(type(d) is int for d in shape):
        raise InspectError(f"{where}: shape {shape!r} is not a tuple of ints")
    if any(d < 0 for d in shape):
        raise InspectError(f"{where}: negative dimension in shape {shape}")
    expected = header_end + math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        diff = len(data) - expected
        what = f"{diff} trailing bytes" if diff > 0 else f"{-diff} bytes missing"
        raise InspectError(f"{where}: {what} after the .npy payload (shape {shape}, dtype {dtype})")
    return dtype, shape


def check_array(arr: Array, where: str, *, dtype: str | np.dtype | None = None,
                shape: tuple[int, ...] | None = None, finite: bool = True) -> np.ndarray:
    """Check one ``Array`` byte for byte and return a read-only view of its values.

    The ``.npy`` header must agree with the ``Array``'s ``dtype`` / ``shape`` metadata and, when
    given, with the expected ``dtype`` and exact ``shape``; float/complex values must be finite
    unless ``finite=False``.
    """
    if not isinstance(arr, Array):
        raise InspectError(f"{where}: expected an Array, got {type(arr).__name__}")
    if arr.stype != STYPE:
        raise InspectError(f"{where}: stype {arr.stype!r}, expected {STYPE!r}")
    dt, shp = parse_npy(arr.data, where)
    if str(dt) != arr.dtype or shp != tuple(arr.shape):
        raise InspectError(f"{where}: header says {dt}{list(shp)} but metadata says {arr.dtype}{list(arr.shape)}")
    if dtype is not None and dt != np.dtype(dtype):
        raise InspectError(f"{where}: dtype {dt}, expected {np.dtype(dtype)}")
    if shape is not None and shp != tuple(shape):
        raise InspectError(f"{where}: shape {list(shp)}, expected {list(shape)}")
    count = math.prod(shp)
    out = np.frombuffer(arr.data, dtype=dt, count=count, offset=len(arr.data) - count * dt.itemsize).reshape(shp)
    out.flags.writeable = False
    if finite and dt.kind in "fc" and not np.isfinite(out).all():
        raise InspectError(f"{where}: contains NaN or Inf")
    return out


def _kind(rec: object, where: str) -> str:
    if isinstance(rec, ArrayRecord):
        return "array"
    if isinstance(rec, ConfigRecord):
        return "config"
    if isinstance(rec, MetricRecord):
        return "metric"
    raise InspectError(f"{where}: unknown record type {type(rec).__name__}")


def _value_bytes(v: object) -> int:
    if isinstance(v, bytes):
        return len(v)
    if isinstance(v, str):
        return len(v.encode("utf8"))
    if isinstance(v, list):
        return sum(_value_bytes(x) for x in v)
    return 8  # bool / int / float


def _items_bytes(items) -> int:
    total = 0
    for name, rec in items:
        total += len(name.encode("utf8"))
        kind = _kind(rec, name)
        for key, v in rec.items():
            total += len(key.encode("utf8"))
            total += len(v.data) if kind == "array" else _value_bytes(v)
    return total


def record_bytes(content: RecordDict) -> int:
    """Total serialized size for byte budgets: array ``.data`` lengths, config/metric values
    (utf-8 / raw length for str / bytes, 8 per number, summed over lists) and all record names
    and keys (utf-8 length), since keys are attacker-chosen text too."""
    return _items_bytes(content.items())


def _blob(h, b: bytes) -> None:
    h.update(struct.pack(">Q", len(b)))
    h.update(b)


def _value(h, v: object, where: str) -> None:
    if isinstance(v, bool):
        h.update(b"T" if v else b"F")
    elif isinstance(v, int):
        h.update(b"i")
        _blob(h, str(v).encode())
    elif isinstance(v, float):
        h.update(b"f" + struct.pack(">d", v))
    elif isinstance(v, str):
        h.update(b"s")
        _blob(h, v.encode("utf8"))
    elif isinstance(v, bytes):
        h.update(b"y")
        _blob(h, v)
    elif isinstance(v, list):
        h.update(b"l" + struct.pack(">Q", len(v)))
        for x in v:
            _value(h, x, where)
    else:
        raise InspectError(f"{where}: unsupported value type {type(v).__name__}")


def _record(h, name: str, rec: object) -> None:
    kind = _kind(rec, name)
    h.update(kind[0].encode())
    _blob(h, name.encode("utf8"))
    h.update(struct.pack(">Q", len(rec)))
    for key in sorted(rec):
        v = rec[key]
        _blob(h, key.encode("utf8"))
        if kind == "array":
            _blob(h, v.dtype.encode())
            _blob(h, v.stype.encode())
            h.update(struct.pack(">Q", len(v.shape)) + b"".join(struct.pack(">q", d) for d in v.shape))
            _blob(h, v.data)
        else:
            _value(h, v, f"{name}.{key}")


def digest(content: RecordDict, exclude: Collection[str] = (), memo=None) -> str:
    """Deterministic SHA-256 (hex) of the records not named in ``exclude``, independent of
    insertion order; every name, key, dtype, shape, stype, byte and value is length-prefixed
    and type-tagged, so any change to them changes the digest.

    ``memo`` (the exchange's ``server_guard.ExchangeMemo``): the hash state after each leading run of records, keyed by
    their names and record objects, so that messages whose first records (in name order) are the same record
    objects (one model's weights sent to several parties, each with its own round start) hash those bytes once. The
    digest is the same with or without it."""
    names = sorted(n for n in content if n not in exclude)
    start, h = 0, None
    if memo is not None:
        for i in range(len(names)):
            got = memo.get("digest", tuple(content[n] for n in names[:i + 1]), tuple(names[:i + 1]))
            if got is None:
                break
            start, h = i + 1, got
    h = h.copy() if h is not None else hashlib.sha256(b"distmoe.wire.inspect/v1")
    for i in range(start, len(names)):
        _record(h, names[i], content[names[i]])
        if memo is not None:
            memo.put("digest", tuple(content[n] for n in names[:i + 1]), h.copy(), tuple(names[:i + 1]))
    return h.hexdigest()


def describe(content: RecordDict, exclude: Collection[str] = (), memo=None) -> dict:
    """A loggable summary: ``{"keys": sorted ["<record>.<key>"], "shapes": {"<record>.<key>": dims}
    (arrays only), "bytes": record_bytes(content), "sha256": digest(content, exclude)}``; records named
    in ``exclude`` are left out of all four."""
    keys, shapes = [], {}
    kept = [(n, r) for n, r in content.items() if n not in exclude]
    for name, rec in kept:
        kind = _kind(rec, name)
        for key, v in rec.items():
            keys.append(f"{name}.{key}")
            if kind == "array":
                shapes[f"{name}.{key}"] = list(v.shape)
    return {"keys": sorted(keys), "shapes": shapes, "bytes": _items_bytes(kept),
            "sha256": digest(content, exclude, memo)}


def _has_text(v: object) -> bool:
    return isinstance(v, str | bytes) or (isinstance(v, list) and any(_has_text(x) for x in v))


def _is_number(v: object) -> bool:
    return type(v) in (int, float)


def check_strings(content: RecordDict, allowed: Mapping[str, Collection[str]]) -> None:
    """Reject str / bytes values (or lists holding them) in any ConfigRecord except under keys in
    ``allowed[record_name]``; MetricRecords may hold only int / float (or lists of them)."""
    for name, rec in content.items():
        kind = _kind(rec, name)
        for key, v in rec.items():
            if kind == "config" and _has_text(v) and key not in allowed.get(name, ()):
                raise InspectError(f"{name}.{key}: text value not allowed in config record {name!r}")
            if kind == "metric" and not (_is_number(v) or (isinstance(v, list) and all(map(_is_number, v)))):
                raise InspectError(f"{name}.{key}: metric value of type {type(v).__name__} (only int/float)")


ArraySpec = tuple[str | np.dtype | None, tuple[int, ...] | None]
Layout = Mapping[str, tuple[str, Mapping[str, ArraySpec] | Collection[str] | None]]


def check_layout(content: RecordDict, layout: Layout, *, finite: bool = True) -> dict[str, dict[str, np.ndarray]]:
    """Check the exact record layout and every array; return ``{record: {key: read-only array}}``.

    ``layout`` maps each record name (the exact set that must be present) to ``(kind, keys)``:
    ``kind`` is ``"array"``, ``"config"`` or ``"metric"``. For ``"array"``, ``keys`` is a mapping
    ``key -> (dtype, shape)`` giving the exact key set, each array checked by ``check_array``
    (``None`` for dtype or shape skips that check), or ``None`` to allow any keys (still checked
    byte by byte). For ``"config"`` / ``"metric"``, ``keys`` is the exact key collection, or
    ``None`` for any keys. Example: ``{"meta": ("config", {"payload", "round"}),
    "stats": ("array", {"sums": ("float64", (4, 8))})}``.
    """
    names = set(content)
    if names != set(layout):
        raise InspectError(f"records {sorted(names)}: missing {sorted(set(layout) - names)}, "
                           f"unexpected {sorted(names - set(layout))}")
    arrays: dict[str, dict[str, np.ndarray]] = {}
    for name, (kind, keys) in layout.items():
        rec = content[name]
        got = _kind(rec, name)
        if got != kind:
            raise InspectError(f"{name}: {got} record, expected {kind} record")
        if keys is not None and set(rec) != set(keys):
            raise InspectError(f"{name}: keys missing {sorted(set(keys) - set(rec))}, "
                               f"unexpected {sorted(set(rec) - set(keys))}")
        if kind == "array":
            specs = keys if isinstance(keys, Mapping) else {}
            arrays[name] = {
                key: check_array(arr, f"{name}.{key}", dtype=specs.get(key, (None, None))[0],
                                 shape=specs.get(key, (None, None))[1], finite=finite)
                for key, arr in rec.items()}
    return arrays
