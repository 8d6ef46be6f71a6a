"""The envelope of a saved protocol state (``SecAggClient.to_state`` / ``SecAggServer.to_state``).

Owns: the byte layout of a state blob and its integrity check, plus the small field codecs the
client and server use to turn their state into JSON values and back:

    MAGIC (8) | format version (1) | kind (1) | body length (4, big endian) | body | SHA-256 (32)

``body`` is canonical JSON (UTF-8, sorted keys, no whitespace, ASCII only): self-describing, and the
same state always gives the same bytes. Byte strings are base64 (standard alphabet, padded); maps with
integer keys are lists of pairs sorted by key. The SHA-256 covers everything before it, so a torn,
truncated, extended or bit-flipped blob raises ``StateCorrupt`` before any field is read.

Must not: use ``pickle`` or anything else that can run code while decoding (a blob may be read back by
another process or another version of this code), or put a secret into an exception message. The
checksum detects corruption, not forgery: whoever can write a party's state can also read its
secrets, so the blob's protection is where it is kept (the party's own node state or work directory).
Exists because a Flower SuperNode starts a new ClientApp process for every message (``docs/architecture.md``
§1), so the protocol state machines must survive between messages.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import Any

from distmoe.privacy.secagg.errors import StateCorrupt, StateMismatch
from distmoe.privacy.secagg.messages import SecAggParams

MAGIC = b"DMSASTv\x00"
FORMAT_VERSION = 2  # 2: the consistency check (signing keys, contributor-count shares, signed survivor sets)
KIND_CLIENT = 1
KIND_SERVER = 2
_KIND_NAMES = {KIND_CLIENT: "client", KIND_SERVER: "server"}
_HEADER = len(MAGIC) + 1 + 1 + 4
_DIGEST = 32


def seal_state(kind: int, body: dict[str, Any]) -> bytes:
    payload = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                         allow_nan=False).encode("ascii")
    head = MAGIC + bytes((FORMAT_VERSION, kind)) + len(payload).to_bytes(4, "big")
    blob = head + payload
    return blob + hashlib.sha256(blob).digest()


def open_state(data: bytes, kind: int) -> dict[str, Any]:
    """Check the envelope of ``data`` and return its JSON body (a dict)."""
    what = _KIND_NAMES[kind]
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"{what} state must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _HEADER + _DIGEST:
        raise StateCorrupt(f"{what} state: {len(data)} bytes, shorter than an empty blob (torn or truncated)")
    blob, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.sha256(blob).digest() != digest:
        raise StateCorrupt(f"{what} state: checksum mismatch ({len(data)} bytes; torn, truncated or altered)")
    if blob[:len(MAGIC)] != MAGIC:
        raise StateCorrupt(f"{what} state: not a distmoe secagg state blob (bad magic)")
    version, got_kind = blob[len(MAGIC)], blob[len(MAGIC) + 1]
    if version != FORMAT_VERSION:
        raise StateMismatch(f"{what} state: format version {version}, this code reads version {FORMAT_VERSION}")
    if got_kind != kind:
        raise StateMismatch(f"{what} state expected, got a {_KIND_NAMES.get(got_kind, f'kind-{got_kind}')} state")
    n = int.from_bytes(blob[len(MAGIC) + 2:_HEADER], "big")
    if n != len(blob) - _HEADER:
        raise StateCorrupt(f"{what} state: body length field {n} != {len(blob) - _HEADER} bytes present")
    try:
        body = json.loads(blob[_HEADER:].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise StateCorrupt(f"{what} state: body is not canonical JSON") from None
    if not isinstance(body, dict) or body.get("kind") != what:
        raise StateCorrupt(f"{what} state: body does not describe a {what}")
    return body


# ---- field codecs ---------------------------------------------------------------------------------

def b64(v: bytes) -> str:
    return base64.b64encode(v).decode("ascii")


def unb64(s: Any, n: int | tuple[int, ...] | None = None) -> bytes:
    """Decode a base64 field; ``n``: the allowed length(s)."""
    if not isinstance(s, str):
        raise TypeError("byte field is not a string")
    try:
        v = base64.b64decode(s.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ValueError("byte field is not base64") from None
    allowed = (n,) if isinstance(n, int) else n
    if allowed is not None and len(v) not in allowed:
        raise ValueError(f"byte field of {len(v)} bytes, expected {allowed}")
    return v


def as_int(v: Any, lo: int = 0, hi: int = 2**64 - 1) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError("integer field out of range")
    return v


def ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise TypeError("list field is not a list")
    return tuple(as_int(x) for x in v)


def params_json(p: SecAggParams) -> dict[str, Any]:
    return {"run_id": b64(p.run_id), "threshold": p.threshold, "bits": p.bits, "length": p.length}


def check_params(saved: Any, p: SecAggParams, what: str) -> None:
    """Raise ``StateMismatch`` unless the blob was saved under exactly ``p``."""
    if not isinstance(saved, dict):
        raise StateCorrupt(f"{what} state: no parameters")
    if saved.get("run_id") != b64(p.run_id):
        raise StateMismatch(f"{what} state belongs to another run (run_id differs); refusing to restore it")
    diff = [f"{k}: saved {saved.get(k)!r}, given {getattr(p, k)!r}" for k in ("threshold", "bits", "length")
            if saved.get(k) != getattr(p, k)]
    if diff:
        raise StateMismatch(f"{what} state was saved with other parameters ({'; '.join(diff)})")


def holders_digest(holders: dict[int, tuple[int, ...]]) -> str:
    """A short fingerprint of a peer graph over the roster (to check the graph given on restore)."""
    enc = json.dumps(sorted((u, list(h)) for u, h in holders.items()), separators=(",", ":"))
    return hashlib.sha256(enc.encode("ascii")).hexdigest()
