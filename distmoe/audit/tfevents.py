"""A strict reader of TensorBoard event files for the audit, without the ``tensorboard`` package.

Owns: :func:`read_scalars` (``path -> [(tag, step, value)]`` or :class:`EventFileError`): the TFRecord framing
(``uint64 length, uint32 masked CRC-32C of the length, data, uint32 masked CRC-32C of the data``, both CRCs
checked) and a protobuf decoding of ``tensorboard.Event`` that accepts only what
``distmoe.report.tensorboard`` writes: the file-version header (``wall_time`` 1, ``step`` 2, ``file_version``
3 = ``brain.Event:2``, ``source_metadata`` 10 with a short ``writer`` name) and scalar summaries
(``summary`` 5 -> ``value`` 1 -> ``tag`` 1 + ``simple_value`` 2). Any other field (an image, a histogram, a
tensor, text, a graph, a log message, plugin metadata) is an error naming its field number and byte offset:
a scalar file has no room for anything else.

CRC-32C is the Castagnoli polynomial (reflected 0x82F63B78), as TFRecord uses; the mask is TensorFlow's
``((crc >> 15) | (crc << 17)) + 0xA282EAD8``.

Must not: import anything but the standard library, or write anything.
"""

from __future__ import annotations

import struct
from pathlib import Path

__all__ = ["read_scalars", "EventFileError", "masked_crc32c", "MAX_BYTES"]

MAX_BYTES = 64 << 20  # an event file of aggregate scalars is kilobytes; anything this large is refused unread
FILE_VERSION = b"brain.Event:2"
WRITER_MAX = 100

_TABLE = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _TABLE.append(_c)


class EventFileError(ValueError):
    """The file is not an event file of aggregate scalars (the message names the byte offset)."""


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(buf: bytes, pos: int, where: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise EventFileError(f"byte {where + pos}: truncated or overlong varint")
        b = buf[pos]
        out |= (b & 0x7F) << shift
        pos += 1
        shift += 7
        if not b & 0x80:
            return out, pos


def _fields(buf: bytes, where: int):
    """``(field number, wire type, value, offset)`` of one protobuf message; lengths checked."""
    pos = 0
    while pos < len(buf):
        at = pos
        key, pos = _varint(buf, pos, where)
        num, wt = key >> 3, key & 7
        if wt == 0:
            val, pos = _varint(buf, pos, where)
        elif wt == 1:
            if pos + 8 > len(buf):
                raise EventFileError(f"byte {where + at}: truncated 64-bit field {num}")
            val, pos = buf[pos : pos + 8], pos + 8
        elif wt == 5:
            if pos + 4 > len(buf):
                raise EventFileError(f"byte {where + at}: truncated 32-bit field {num}")
            val, pos = buf[pos : pos + 4], pos + 4
        elif wt == 2:
            n, pos = _varint(buf, pos, where)
            if pos + n > len(buf):
                raise EventFileError(f"byte {where + at}: field {num} runs past its message")
            val, pos = buf[pos : pos + n], pos + n
        else:
            raise EventFileError(f"byte {where + at}: field {num} of wire type {wt} (groups are not written)")
        yield num, wt, val, where + at


def _text(raw: bytes, at: int, what: str, limit: int) -> str:
    try:
        s = raw.decode("ascii")
    except UnicodeDecodeError:
        raise EventFileError(f"byte {at}: {what} is not ASCII") from None
    if len(s) > limit or not s.isprintable():
        raise EventFileError(f"byte {at}: {what} is not a short printable string ({len(s)} characters)")
    return s


def _value(buf: bytes, where: int) -> tuple[str, float]:
    tag, value = None, None
    for num, wt, val, at in _fields(buf, where):
        if num == 1 and wt == 2:
            tag = _text(val, at, "a scalar's tag", 200)
        elif num == 2 and wt == 5:
            (value,) = struct.unpack("<f", val)
        else:
            raise EventFileError(
                f"byte {at}: summary value field {num}: only a tag and a simple scalar are written "
                "(no image, histogram, audio, tensor or plugin metadata)"
            )
    if tag is None or value is None:
        raise EventFileError(f"byte {where}: a summary value without {'a tag' if tag is None else 'a scalar'}")
    return tag, value


def _event(buf: bytes, where: int, out: list[tuple[str, int, float]]) -> None:
    step, values, header = 0, [], False
    for num, wt, val, at in _fields(buf, where):
        if num == 1 and wt == 1:
            pass  # wall_time
        elif num == 2 and wt == 0:
            step = val
        elif num == 3 and wt == 2:
            if val != FILE_VERSION:
                raise EventFileError(f"byte {at}: file_version {val[:40]!r} is not {FILE_VERSION.decode()!r}")
            header = True
        elif num == 10 and wt == 2:
            for n2, wt2, v2, at2 in _fields(val, at):
                if n2 != 1 or wt2 != 2:
                    raise EventFileError(f"byte {at2}: source_metadata field {n2}: only the writer's name is written")
                _text(v2, at2, "the writer's name", WRITER_MAX)
        elif num == 5 and wt == 2:
            for n2, wt2, v2, at2 in _fields(val, at):
                if n2 != 1 or wt2 != 2:
                    raise EventFileError(f"byte {at2}: summary field {n2}: only scalar values are written")
                values.append(_value(v2, at2))
        else:
            raise EventFileError(
                f"byte {at}: event field {num}: not one a scalar file holds (graph, log message, "
                "session log or run metadata)"
            )
    if not values and not header:
        raise EventFileError(f"byte {where}: an event with neither a scalar nor the file-version header")
    out += [(tag, step, value) for tag, value in values]


def read_scalars(path: str | Path) -> list[tuple[str, int, float]]:
    """Every ``(tag, step, value)`` of the event file at ``path``; :class:`EventFileError` names the first
    problem (framing, a CRC, a field that is not a scalar's)."""
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise EventFileError(f"{size} bytes: larger than any event file of aggregate scalars ({MAX_BYTES})")
    data = path.read_bytes()
    pos, out, first = 0, [], True
    while pos < len(data):
        if pos + 12 > len(data):
            raise EventFileError(f"byte {pos}: a truncated record header")
        header = data[pos : pos + 8]
        (n,) = struct.unpack("<Q", header)
        (hcrc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        if hcrc != masked_crc32c(header):
            raise EventFileError(f"byte {pos}: the record length's CRC does not match")
        body_at = pos + 12
        if body_at + n + 4 > len(data):
            raise EventFileError(f"byte {pos}: a record of {n} bytes runs past the end of the file")
        body = data[body_at : body_at + n]
        (dcrc,) = struct.unpack("<I", data[body_at + n : body_at + n + 4])
        if dcrc != masked_crc32c(body):
            raise EventFileError(f"byte {body_at}: the record's CRC does not match its data")
        got: list[tuple[str, int, float]] = []
        _event(body, body_at, got)
        if first and got:
            raise EventFileError(f"byte {body_at}: the first event is not the file-version header")
        first = False
        out += got
        pos = body_at + n + 4
    if first:
        raise EventFileError("an empty event file (no file-version header)")
    return out
