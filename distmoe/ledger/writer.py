"""The writer of a node's ledger: one :class:`Ledger` object (one process) owns a ledger file and appends signed,
hash-chained entries to it, crash-safe.

Owns: open (verify, truncate a torn tail with a warning; the prefix an earlier open verified is checked by
its SHA-256 against a ``<ledger>.verified`` note tagged with the ledger key, the entries after it one by one:
a reopen per message costs the new entries' checks, not the whole chain's), the single-writer guard (an
advisory ``flock`` and the size check), ``append`` / ``append_final``, ``batch`` (group commit: one fsync for
several appends) and ``anchor`` (pin another node's head).

Must not: see payload contents (callers pass sizes and digests), or silently drop anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from distmoe.io import fsync_dir
from distmoe.ledger.entries import (
    GENESIS,
    HEX64,
    SIG_DOMAIN,
    LedgerError,
    TornLedgerWarning,
    canonical_json,
    describe_payload,
    entry_hash,
    validate_fields,
)
from distmoe.ledger.keys import load_signing_key, public_key_hex, read_tagged, write_tagged
from distmoe.ledger.verify import as_head, check_entries, head_of, split_lines

try:  # POSIX advisory locks; the single-writer guard degrades to the size check elsewhere
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

VERIFIED_DOMAIN = b"distmoe-ledger-verified-v1"  # the note's tag (``private_tag``): only this key's holder makes one


def verified_note(path: str | os.PathLike[str]) -> Path:
    """The note of how much of ledger ``path`` its writer verified on its last open: ``<ledger>.verified``."""
    path = Path(path)
    return path.with_name(path.name + ".verified")


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
        self.checked_on_open = 0  # entries whose hash and signature the open checked one by one
        self._head: tuple[int, str] = (-1, GENESIS)
        self._size = 0
        self._lock = threading.Lock()  # appends from two threads of one process (a stop signal's handler)
        self._sealed: str | None = None  # why no further entry may be appended (``seal``)
        self._batch: int | None = None  # the thread inside ``batch()``: its appends are fsynced once, at its end
        self._unsynced = False
        self._open()

    # -- open / recover
    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        good = data.rfind(b"\n") + 1  # the complete lines' bytes; after them a torn tail, if any
        tail = data[good:]
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
        view = memoryview(data)
        start, skip, digest = self._verified_prefix(view, good)
        done = data.count(b"\n", 0, skip)  # lines in the verified prefix
        lines, _, _ = split_lines(bytes(view[skip:good]))  # the entries after it, each checked
        entries, errors = check_entries(lines, self._pub, str(self.path), start, done + 1)
        if errors:
            raise LedgerError("refusing to extend a ledger that does not verify: " + "; ".join(errors[:5]))
        self.checked_on_open = len(entries)
        self._head = head_of(entries) if entries else start
        self._size = good
        if good > skip:
            digest.update(view[skip:good])
            self._note_verified(good, digest.hexdigest())

    def _verified_prefix(self, data: memoryview, good: int) -> tuple[tuple[int, str], int, Any]:
        """``(head, bytes, sha256 so far)`` of the prefix of ``data`` that an earlier open verified: its note
        (``verified_note``) verifies under this ledger's key and the prefix's SHA-256 is the one it names (the very
        bytes verified, so their entries need not be checked again); ``((-1, GENESIS), 0, sha256())`` otherwise."""
        none = (-1, GENESIS), 0, hashlib.sha256()
        payload = read_tagged(verified_note(self.path), self._key, VERIFIED_DOMAIN)
        if payload is None:  # no note, or none tagged with this ledger's key
            return none
        try:
            note = json.loads(payload)
            n, head = int(note["bytes"]), (int(note["head"][0]), str(note["head"][1]))
            if note["ledger"] == self.path.name and 0 < n <= good and data[n - 1:n] == b"\n":
                digest = hashlib.sha256(data[:n])
                if digest.hexdigest() == note["sha256"]:
                    return head, n, digest
        except (ValueError, KeyError, TypeError, IndexError):  # a tagged note of the wrong shape
            pass
        return none

    def _note_verified(self, good: int, digest: str) -> None:
        """Tag and write the note that the first ``good`` bytes (SHA-256 ``digest``) verified up to this head (a cache:
        written without fsync; when it is lost or does not match, the next open checks every entry)."""
        payload = json.dumps({"ledger": self.path.name, "bytes": good, "sha256": digest, "head": list(self._head)},
                             separators=(",", ":")).encode("ascii")
        with contextlib.suppress(OSError):
            write_tagged(verified_note(self.path), self._key, VERIFIED_DOMAIN, payload)

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

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Group commit: the appends this thread makes inside the block are written at once and fsynced together
        when the block ends (one fsync instead of one per entry; the coordinator logs one stage's messages to every
        party this way). Durable when the block ends, not when ``append`` returns: the caller sends or acts on
        none of them before that. Appends from other threads (a stop signal's ``run-end``) are fsynced as always."""
        if self._batch is not None:  # nested: the outer block syncs
            yield
            return
        self._batch = threading.get_ident()
        try:
            yield
        finally:
            with self._lock:
                self._batch = None
                self._sync_unsynced()

    def append_final(self, why: str, **fields: Any) -> dict[str, Any]:
        """Append one last entry and refuse every later append in this process, under one lock: after a stop
        signal closed the ledger with ``run-end``, a worker thread still running must not write after it."""
        with self._lock:
            if self._sealed is not None:
                raise LedgerError(f"{self.path}: sealed ({self._sealed}); no further entries")
            entry = self._append(fields)
            self._sealed = why
            self._sync_unsynced()  # the last entry is durable when this returns, batch or not
            return entry

    def _sync_unsynced(self) -> None:
        """fsync the file if an append since the last sync was left to a batch's end (the caller holds the lock)."""
        if self._unsynced:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._unsynced = False

    def _append(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        body = validate_fields(fields)
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
            if self._batch == threading.get_ident():  # synced when the batch ends (``batch``)
                self._unsynced = True
            else:
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
        seq, h = as_head(head)
        if not HEX64.match(h):
            raise LedgerError(f"anchored hash must be 64 lowercase hex characters, got {h!r}")
        a = {"node": str(node), "seq": seq, "hash": h}
        payload = canonical_json(a).encode("ascii")
        return self.append(run=run, round=round, phase=phase, direction="in", payload_type="ledger_head",
                           keys=["node", "seq", "hash"], shapes={}, **describe_payload(payload),
                           verdict="accepted", anchor=a)

    def __repr__(self) -> str:
        return f"Ledger({str(self.path)!r}, head={self._head[0]})"
