"""Per-node, append-only, hash-chained and Ed25519-signed JSONL ledger of everything crossing the wire.

Owns: the on-disk format of ``ledger/<node>.jsonl`` (one canonical JSON object per line, one entry per
object that leaves or enters the node), its crash-safe append, torn-tail recovery on open, the
verification of a ledger file (parse, contiguous ``seq``, ``prev`` links, recomputed hashes, signatures)
and of a ledger against a head anchored elsewhere (truncation), and the node's Ed25519 signing-key file.

Entry fields: ``time, run, round, phase, direction ("out"/"in"), payload_type, keys, shapes, bytes,
sha256`` (of the serialized payload), ``dp`` (dict or null), ``verdict`` (``"accepted"`` or
``"rejected: <reason>"``), optionally ``anchor`` (``{"node", "seq", "hash"}``: another node's head; on
the coordinator's "in" entries the sending party's, on a party's "in" entries the coordinator's head that
the instruction carried, so each side pins the other's chain),
then ``seq`` (0, 1, ...), ``prev`` (hash of the previous entry; 64 zeros for the first), ``hash``
(SHA-256 hex of the canonical JSON of the entry without ``hash``/``sig``) and ``sig`` (hex Ed25519
signature of ``SIG_DOMAIN + hash``). Optional ``peer`` (the other node's name) and ``info`` (a dict
of protocol facts: survivors, canary scans, the run's allow-list; see ``docs/privacy.md``).
Canonical JSON: sorted keys, ``(",", ":")`` separators, ASCII, no NaN/Inf.

Single writer: one :class:`Ledger` object (one process) owns a ledger file. A second writer is not
supported; as a guard, each append takes an advisory ``flock`` and refuses (``LedgerError``) if the
file changed size since this object last wrote, so a second writer fails loudly instead of forking
the chain. Readers (:func:`verify_ledger`) may run at any time.

Must not: import ``flwr``, see payload contents (callers pass sizes and digests, see
:func:`describe_payload`), silently keep or drop anything (a torn tail is truncated *with a warning*;
any other damage is an error), or overwrite a key file without ``force=True``.

Why hand-written: a plain HMAC chain (Schneier and Kelsey's secure audit logs) needs a shared key; a
signature lets the coordinator and an auditor verify a party's chain with its public key only, and no maintained
library offers a small signed append-only log over plain files (Certificate-Transparency style logs
are services). It is ~300 lines on ``cryptography``'s Ed25519 and ``hashlib``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import stat
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from distmoe.io import fsync_dir, write_atomic

try:  # POSIX advisory locks; the single-writer guard degrades to the size check elsewhere
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "GENESIS",
    "SIG_DOMAIN",
    "Ledger",
    "LedgerError",
    "TornLedgerWarning",
    "VerifyResult",
    "anchors_in",
    "canonical_json",
    "describe_payload",
    "entry_hash",
    "generate_signing_key",
    "load_public_key",
    "load_signing_key",
    "public_key_hex",
    "verify_against_anchor",
    "verify_ledger",
]

log = logging.getLogger(__name__)

GENESIS = "0" * 64
SIG_DOMAIN = b"distmoe-ledger-v1:"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_REQUIRED = ("run", "round", "phase", "direction", "payload_type", "keys", "shapes", "bytes", "sha256", "verdict")
_OPTIONAL = ("time", "dp", "anchor", "peer", "info")
_CHAIN = ("seq", "prev", "hash", "sig")


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
def generate_signing_key(path: str | os.PathLike[str], *, force: bool = False) -> Ed25519PrivateKey:
    """Create a new Ed25519 key, write it as unencrypted PKCS#8 PEM with mode 0600, return it.

    Refuses (``FileExistsError``) to replace an existing file unless ``force=True``; with ``force`` the
    replacement is atomic (temp file in the same directory, fsync, rename).
    """
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    write_atomic(path, pem, mode=0o600, replace=force)  # FileExistsError without force
    return key


def load_signing_key(path: str | os.PathLike[str], *, strict_permissions: bool = True) -> Ed25519PrivateKey:
    """Load an Ed25519 private key from a PEM file written by :func:`generate_signing_key`.

    With ``strict_permissions`` (default) a key file readable or writable by group or others is refused
    (``PermissionError``), as ssh does. A PEM holding another key type is a ``TypeError``.
    """
    path = Path(path)
    if strict_permissions and os.name == "posix":
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise PermissionError(f"{path}: signing key has mode {mode:04o}; it must not be accessible to "
                                  "group/others (chmod 600)")
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise TypeError(f"{path}: expected an Ed25519 private key, got {type(key).__name__}")
    return key


def public_key_hex(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """Raw 32-byte public key as hex (what a node publishes so others can verify its ledger)."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def load_public_key(key: Ed25519PublicKey | Ed25519PrivateKey | str | bytes) -> Ed25519PublicKey:
    """Accept a public key object, a private key (its public half), 32 raw bytes or their hex."""
    if isinstance(key, Ed25519PublicKey):
        return key
    if isinstance(key, Ed25519PrivateKey):
        return key.public_key()
    if isinstance(key, str):
        key = bytes.fromhex(key)
    if isinstance(key, bytes) and len(key) == 32:
        return Ed25519PublicKey.from_public_bytes(key)
    raise TypeError("public key must be an Ed25519 key object, 32 raw bytes or their 64-char hex")


# --------------------------------------------------------------------------------------------- reading
def _split(data: bytes) -> tuple[list[bytes], int, bytes]:
    """Complete lines (without '\\n'), byte length of the complete part, and the unterminated tail."""
    end = data.rfind(b"\n") + 1  # 0 when there is no newline at all
    body, tail = data[:end], data[end:]
    lines = body.split(b"\n")[:-1] if body else []
    return lines, end, tail


@dataclass
class VerifyResult:
    """Outcome of :func:`verify_ledger` / :func:`verify_against_anchor`. Truthy iff ``ok``."""

    ok: bool
    entries: int
    head: tuple[int, str]
    errors: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.ok


def _check_entries(lines: Sequence[bytes], pub: Ed25519PublicKey, where: str
                   ) -> tuple[list[dict[str, Any]], list[str]]:
    entries: list[dict[str, Any]] = []
    errors: list[str] = []
    prev_hash, expect_seq = GENESIS, 0
    for i, raw in enumerate(lines, start=1):
        try:
            obj = json.loads(raw.decode("ascii"))
            if not isinstance(obj, dict):
                raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        except ValueError as exc:
            errors.append(f"{where}: line {i}: does not parse: {exc}")
            prev_hash, expect_seq = None, None  # chain position unknown after an unreadable line
            continue
        missing = [k for k in (*_REQUIRED, *_CHAIN) if k not in obj]
        if missing:
            errors.append(f"{where}: line {i}: missing fields {missing}")
        seq, h, sig = obj.get("seq"), obj.get("hash"), obj.get("sig")
        if expect_seq is not None and seq != expect_seq:
            errors.append(f"{where}: line {i}: seq {seq!r}, expected {expect_seq} (entry deleted, inserted or "
                          "reordered)")
        if prev_hash is not None and obj.get("prev") != prev_hash:
            errors.append(f"{where}: line {i} (seq {seq!r}): prev does not link to the previous entry's hash")
        recomputed = entry_hash(obj)
        if h != recomputed:
            errors.append(f"{where}: line {i} (seq {seq!r}): hash mismatch: entry content was modified")
        try:
            pub.verify(bytes.fromhex(sig), SIG_DOMAIN + str(h).encode("ascii"))
        except (InvalidSignature, ValueError, TypeError):
            errors.append(f"{where}: line {i} (seq {seq!r}): bad signature (wrong key or forged entry)")
        entries.append(obj)
        prev_hash = h if isinstance(h, str) else None
        expect_seq = seq + 1 if isinstance(seq, int) else None
    return entries, errors


def _head_of(entries: Sequence[Mapping[str, Any]]) -> tuple[int, str]:
    if not entries:
        return (-1, GENESIS)
    last = entries[-1]
    return (last.get("seq", -1), last.get("hash", GENESIS))


def verify_ledger(path: str | os.PathLike[str], public_key: Any) -> VerifyResult:
    """Check a ledger file: every line parses, ``seq`` is 0..n-1, ``prev`` links, hashes, signatures.

    Detects an edited entry (hash mismatch, or a bad signature if the hash was recomputed), a deleted,
    inserted or reordered entry (seq/prev), a foreign key (signatures) and a torn trailing line. A
    truncated tail is invisible here by construction: use :func:`verify_against_anchor`. Never modifies
    the file. A missing file is an error; an empty file verifies with ``head == (-1, GENESIS)``.
    """
    path = Path(path)
    pub = load_public_key(public_key)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return VerifyResult(False, 0, (-1, GENESIS), [f"{path}: no such ledger"])
    lines, _, tail = _split(data)
    entries, errors = _check_entries(lines, pub, str(path))
    if tail:
        errors.append(f"{path}: torn trailing line of {len(tail)} bytes (an append that did not complete)")
    return VerifyResult(not errors, len(entries), _head_of(entries), errors)


def _as_head(head: Any) -> tuple[int, str]:
    if isinstance(head, Mapping):
        return int(head["seq"]), str(head["hash"])
    seq, h = head
    return int(seq), str(h)


def verify_against_anchor(path: str | os.PathLike[str], public_key: Any, anchored_head: Any) -> VerifyResult:
    """:func:`verify_ledger` plus: the entry at the anchored ``seq`` exists and has the anchored hash.

    ``anchored_head`` is ``(seq, hash)`` or ``{"seq", "hash"}`` as recorded by another node
    (:meth:`Ledger.anchor`). Detects truncation (the ledger ends before the anchored seq) and a
    rewritten history (a different entry at the anchored seq). Entries after the anchor are fine.
    """
    result = verify_ledger(path, public_key)
    seq, h = _as_head(anchored_head)
    if seq < 0:
        return result
    lines, _, _ = _split(Path(path).read_bytes()) if Path(path).exists() else ([], 0, b"")
    found = None
    for raw in lines:
        try:
            obj = json.loads(raw.decode("ascii"))
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("seq") == seq:
            found = obj
            break
    if found is None:
        result.errors.append(f"{path}: truncated: anchored head is seq {seq} but the ledger ends at seq "
                             f"{result.head[0]}")
    elif found.get("hash") != h:
        result.errors.append(f"{path}: entry seq {seq} differs from the anchored head (history rewritten)")
    result.ok = not result.errors
    return result


def anchors_in(path: str | os.PathLike[str]) -> dict[str, tuple[int, str]]:
    """The latest anchored head per node recorded in a ledger (e.g. the server's), for the audit."""
    out: dict[str, tuple[int, str]] = {}
    lines, _, _ = _split(Path(path).read_bytes())
    for raw in lines:
        obj = json.loads(raw.decode("ascii"))
        a = obj.get("anchor")
        if isinstance(a, dict):
            out[str(a["node"])] = (int(a["seq"]), str(a["hash"]))
    return out


# --------------------------------------------------------------------------------------------- writing
def _validate(fields: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(fields) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise LedgerError(f"unknown ledger fields {unknown}; allowed: {sorted((*_REQUIRED, *_OPTIONAL))}")
    missing = [k for k in _REQUIRED if k not in fields]
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
    if not isinstance(f["sha256"], str) or not _HEX64.match(f["sha256"]):
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


class Ledger:
    """Append-only signed ledger of one node (single writer; see the module docstring).

    Opening an existing file checks it: a torn trailing line (a crash mid-append) is truncated away
    with a :class:`TornLedgerWarning`; any other damage (unparsable line, broken chain, hash or
    signature mismatch with ``signing_key``) raises :class:`LedgerError`, so a node never extends a
    chain it cannot vouch for.
    """

    def __init__(self, path: str | os.PathLike[str], signing_key: Ed25519PrivateKey | str | os.PathLike[str]):
        self.path = Path(path)
        self._key = signing_key if isinstance(signing_key, Ed25519PrivateKey) else load_signing_key(signing_key)
        self._pub = self._key.public_key()
        self.recovered_bytes = 0  # bytes of torn tail truncated on open
        self._head: tuple[int, str] = (-1, GENESIS)
        self._size = 0
        self._lock = threading.Lock()  # appends from two threads of one process (a stop signal's handler)
        self._sealed: str | None = None  # why no further entry may be appended (``seal``)
        self._open()

    # -- open / recover
    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        lines, good, tail = _split(data)
        if tail:
            msg = (f"{self.path}: torn trailing line of {len(tail)} bytes (interrupted append) truncated "
                   f"to {good} bytes; that entry was never completed")
            warnings.warn(msg, TornLedgerWarning, stacklevel=3)
            log.warning(msg)
            fd = os.open(self.path, os.O_WRONLY)
            try:
                os.ftruncate(fd, good)
                os.fsync(fd)
            finally:
                os.close(fd)
            self.recovered_bytes = len(tail)
        entries, errors = _check_entries(lines, self._pub, str(self.path))
        if errors:
            raise LedgerError("refusing to extend a ledger that does not verify: " + "; ".join(errors[:5]))
        self._head = _head_of(entries)
        self._size = good

    # -- api
    @property
    def public_key_hex(self) -> str:
        return public_key_hex(self._pub)

    def head(self) -> tuple[int, str]:
        """``(seq, hash)`` of the last entry; ``(-1, GENESIS)`` for an empty ledger."""
        return self._head

    def append(self, **fields: Any) -> dict[str, Any]:
        """Validate, chain, sign and durably append one entry; return it as written.

        Required: ``run, round, phase, direction, payload_type, keys, shapes, bytes, sha256, verdict``;
        optional: ``time`` (default now), ``dp`` (default None), ``anchor``. The full line is built
        before the file is touched and written with one ``os.write`` on an ``O_APPEND`` descriptor,
        then fsynced: when this returns the entry is durable; a crash leaves at most a torn tail that
        the next open truncates.
        """
        with self._lock:
            if self._sealed is not None:
                raise LedgerError(f"{self.path}: sealed ({self._sealed}); no further entries")
            return self._append(fields)

    def append_final(self, why: str, **fields: Any) -> dict[str, Any]:
        """Append one last entry and refuse every later append in this process, under one lock: after a stop
        signal closed the ledger with ``run-end``, a worker thread still running must not write after it."""
        with self._lock:
            if self._sealed is not None:
                raise LedgerError(f"{self.path}: sealed ({self._sealed}); no further entries")
            entry = self._append(fields)
            self._sealed = why
            return entry

    def _append(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        body = _validate(fields)
        seq, prev = self._head
        body["seq"], body["prev"] = seq + 1, prev
        try:
            body = json.loads(canonical_json(body))  # normalise exactly as a reader will see it
        except ValueError as exc:
            raise LedgerError(f"ledger entry is not JSON-serialisable: {exc}") from exc
        h = entry_hash(body)
        entry = {**body, "hash": h, "sig": self._key.sign(SIG_DOMAIN + h.encode("ascii")).hex()}
        line = (canonical_json(entry) + "\n").encode("ascii")
        created = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # private (wire.at_rest)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            size = os.fstat(fd).st_size
            if size != self._size:
                raise LedgerError(f"{self.path}: file is {size} bytes, expected {self._size}: another writer "
                                  "appended (single-writer ledger); reopen it")
            view = memoryview(line)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)  # also releases the flock
        if created:
            fsync_dir(self.path.parent)
        self._size += len(line)
        self._head = (entry["seq"], h)
        return entry

    def anchor(self, node: str, head: Any, *, run: str = "", round: int | None = None,
               phase: str = "anchor") -> dict[str, Any]:
        """Record another node's ledger head (``(seq, hash)`` or ``{"seq", "hash"}``) in this ledger."""
        seq, h = _as_head(head)
        if not _HEX64.match(h):
            raise LedgerError(f"anchored hash must be 64 lowercase hex characters, got {h!r}")
        a = {"node": str(node), "seq": seq, "hash": h}
        payload = canonical_json(a).encode("ascii")
        return self.append(run=run, round=round, phase=phase, direction="in", payload_type="ledger_head",
                           keys=["node", "seq", "hash"], shapes={}, **describe_payload(payload),
                           verdict="accepted", anchor=a)

    def __repr__(self) -> str:
        return f"Ledger({str(self.path)!r}, head={self._head[0]})"
