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

The parts: :mod:`~distmoe.ledger.entries` (fields, canonical JSON, hashes), :mod:`~distmoe.ledger.keys` (the
signing-key file), :mod:`~distmoe.ledger.verify` (verification of a file and against an anchored head),
:mod:`~distmoe.ledger.writer` (the single writer). Callers import from ``distmoe.ledger``.

Must not: import ``flwr``, see payload contents (callers pass sizes and digests, see
:func:`describe_payload`), silently keep or drop anything (a torn tail is truncated *with a warning*;
any other damage is an error), or overwrite a key file without ``force=True``.

Why hand-written: a plain HMAC chain (Schneier and Kelsey's secure audit logs) needs a shared key; a
signature lets the coordinator and an auditor verify a party's chain with its public key only, and no maintained
library offers a small signed append-only log over plain files (Certificate-Transparency style logs
are services). It is ~300 lines on ``cryptography``'s Ed25519 and ``hashlib``.
"""

from distmoe.ledger.entries import (
    GENESIS,
    SIG_DOMAIN,
    LedgerError,
    TornLedgerWarning,
    canonical_json,
    describe_payload,
    entry_hash,
)
from distmoe.ledger.keys import generate_signing_key, load_public_key, load_signing_key, public_key_hex
from distmoe.ledger.verify import VerifyResult, anchors_in, verify_against_anchor, verify_ledger
from distmoe.ledger.writer import Ledger

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
