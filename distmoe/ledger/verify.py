"""Verifying a ledger file: parse, contiguous ``seq``, ``prev`` links, recomputed hashes, signatures; and a ledger
against a head anchored elsewhere (a truncated or rewritten chain).

Owns: splitting a file into complete lines and a torn tail, ``check_entries``, ``verify_ledger``,
``verify_against_anchor``, ``anchors_in`` (the heads of other nodes a ledger pinned) and ``VerifyResult``.

Must not: write or repair a file (the writer truncates a torn tail, with a warning, on open).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from distmoe.ledger.entries import CHAIN, GENESIS, REQUIRED, SIG_DOMAIN, entry_hash
from distmoe.ledger.keys import load_public_key


def split_lines(data: bytes) -> tuple[list[bytes], int, bytes]:
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


def check_entries(lines: Sequence[bytes], pub: Ed25519PublicKey, where: str, start: tuple[int, str] = (-1, GENESIS),
                   first_line: int = 1) -> tuple[list[dict[str, Any]], list[str]]:
    """The entries of ``lines`` and every error found in them; ``start``: the head the first line must extend
    (``first_line``: its line number in the file), the genesis by default."""
    entries: list[dict[str, Any]] = []
    errors: list[str] = []
    prev_hash, expect_seq = start[1], start[0] + 1
    for i, raw in enumerate(lines, start=first_line):
        try:
            obj = json.loads(raw.decode("ascii"))
            if not isinstance(obj, dict):
                raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        except ValueError as exc:
            errors.append(f"{where}: line {i}: does not parse: {exc}")
            prev_hash, expect_seq = None, None  # chain position unknown after an unreadable line
            continue
        missing = [k for k in (*REQUIRED, *CHAIN) if k not in obj]
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


def head_of(entries: Sequence[Mapping[str, Any]]) -> tuple[int, str]:
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
    lines, _, tail = split_lines(data)
    entries, errors = check_entries(lines, pub, str(path))
    if tail:
        errors.append(f"{path}: torn trailing line of {len(tail)} bytes (an append that did not complete)")
    return VerifyResult(not errors, len(entries), head_of(entries), errors)


def as_head(head: Any) -> tuple[int, str]:
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
    seq, h = as_head(anchored_head)
    if seq < 0:
        return result
    lines, _, _ = split_lines(Path(path).read_bytes()) if Path(path).exists() else ([], 0, b"")
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
    lines, _, _ = split_lines(Path(path).read_bytes())
    for raw in lines:
        obj = json.loads(raw.decode("ascii"))
        a = obj.get("anchor")
        if isinstance(a, dict):
            out[str(a["node"])] = (int(a["seq"]), str(a["hash"]))
    return out


# --------------------------------------------------------------------------------------------- writing
