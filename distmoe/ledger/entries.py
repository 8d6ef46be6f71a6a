"""A ledger entry: its fields, its canonical JSON, its hash, and the errors of a ledger.

Owns: the entry fields (``REQUIRED``, ``OPTIONAL``, the chain fields), ``canonical_json`` (sorted keys, compact,
ASCII, no NaN/Inf), ``entry_hash``, ``describe_payload`` (sizes and digests, never contents), the validation of the
fields a caller appends, ``GENESIS`` and ``SIG_DOMAIN``.

Must not: do I/O or sign anything.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections.abc import Mapping
from typing import Any

GENESIS = "0" * 64
SIG_DOMAIN = b"distmoe-ledger-v1:"
HEX64 = re.compile(r"^[0-9a-f]{64}$")
REQUIRED = ("run", "round", "phase", "direction", "payload_type", "keys", "shapes", "bytes", "sha256", "verdict")
OPTIONAL = ("time", "dp", "anchor", "peer", "info")
CHAIN = ("seq", "prev", "hash", "sig")


class LedgerError(RuntimeError):
    """A ledger cannot be opened or appended to safely (corrupt chain, second writer, bad entry)."""


class TornLedgerWarning(RuntimeWarning):
    """A torn trailing line (an append interrupted by a crash) was found and truncated away."""


# ----------------------------------------------------------------------------------------------- helpers
def canonical_json(obj: Any) -> str:
    """The one serialisation that is hashed: sorted keys, compact, ASCII, no NaN/Inf."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def entry_hash(entry: Mapping[str, Any]) -> str:
    """SHA-256 hex of the canonical JSON of ``entry`` without its ``hash`` and ``sig`` fields."""
    body = {k: v for k, v in entry.items() if k not in ("hash", "sig")}
    return hashlib.sha256(canonical_json(body).encode("ascii")).hexdigest()


def describe_payload(data: bytes) -> dict[str, Any]:
    """``{"bytes": len(data), "sha256": hex}`` of a serialized payload, ready for :meth:`Ledger.append`."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


# ---------------------------------------------------------------------------------------------- keys


def validate_fields(fields: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(fields) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise LedgerError(f"unknown ledger fields {unknown}; allowed: {sorted((*REQUIRED, *OPTIONAL))}")
    missing = [k for k in REQUIRED if k not in fields]
    if missing:
        raise LedgerError(f"missing ledger fields {missing}")
    f = dict(fields)
    f.setdefault("time", time.time())
    f.setdefault("dp", None)
    if not isinstance(f["time"], (int, float)) or not math.isfinite(f["time"]):
        raise LedgerError(f"time must be a finite number, got {f['time']!r}")
    if not isinstance(f["run"], str) or not isinstance(f["phase"], str) or not isinstance(f["payload_type"], str):
        raise LedgerError("run, phase and payload_type must be strings")
    rnd = f["round"]
    if rnd is not None and (isinstance(rnd, bool) or not isinstance(rnd, int) or rnd < 0):
        raise LedgerError(f"round must be a non-negative int or None, got {rnd!r}")
    if f["direction"] not in ("out", "in"):
        raise LedgerError(f"direction must be 'out' or 'in', got {f['direction']!r}")
    keys = f["keys"]
    if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
        raise LedgerError("keys must be a list of strings")
    f["keys"] = list(keys)
    shapes = f["shapes"]
    if not isinstance(shapes, Mapping):
        raise LedgerError("shapes must be a mapping key -> shape (list of ints)")
    f["shapes"] = {str(k): [int(d) for d in v] for k, v in shapes.items()}
    nbytes = f["bytes"]
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise LedgerError(f"bytes must be a non-negative int, got {nbytes!r}")
    if not isinstance(f["sha256"], str) or not HEX64.match(f["sha256"]):
        raise LedgerError("sha256 must be 64 lowercase hex characters")
    if f["dp"] is not None and not isinstance(f["dp"], Mapping):
        raise LedgerError("dp must be a dict or None")
    if "peer" in f and not isinstance(f["peer"], str):
        raise LedgerError("peer must be a string (the other node's name)")
    if "info" in f and not isinstance(f["info"], Mapping):
        raise LedgerError("info must be a dict")
    v = f["verdict"]
    if not isinstance(v, str) or not (v == "accepted" or (v.startswith("rejected: ") and v[10:].strip())):
        raise LedgerError(f"verdict must be 'accepted' or 'rejected: <reason>', got {v!r}")
    return f
