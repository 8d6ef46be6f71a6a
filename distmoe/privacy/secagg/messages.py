"""Parameters and messages of the secure aggregation: frozen dataclasses of ints, bytes and arrays.

Owns: the exact content of every protocol message, with size checks in ``__post_init__``, and
``payload_bytes`` (the serialized size a transport will need, for byte budgets and reports).

Must not: import ``flwr`` or know about records (``distmoe/wire`` maps these onto Flower records), or
hold secrets in the clear (shares travel only inside ``EncryptedShares`` or in ``UnmaskResponse``,
which goes to the server by design). Hand-written rather than Flower's SecAgg+ messages because those
only exist inside the legacy workflow and carry metrics and ``num_examples`` in the clear
(``docs/privacy.md`` §9).

Exchanges (see ``distmoe.privacy.secagg`` for the full schedule): setup ``KeyAdvert`` ->
``KeyDirectory``; share keys ``ShareKeys`` (standalone or inside ``MaskedInput.next_keys``); masked
input ``RoundStart`` -> ``MaskedInput`` (with the contributor-bit shares ``CountShare``); consistency
``ConsistencyRequest`` -> ``ConsistencyResponse``; unmask ``UnmaskRequest`` (with the signatures) ->
``UnmaskResponse``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from distmoe.privacy.secagg.primitives import KEY_BYTES, MAX_ID, NONCE_BYTES, SIG_BYTES
from distmoe.privacy.secagg.shamir import SHARE_BYTES

SHARE_PLAINTEXT_BYTES = 2 * SHARE_BYTES  # b-share || s-share
SHARE_CIPHERTEXT_BYTES = SHARE_PLAINTEXT_BYTES + 16  # + Poly1305 tag
COUNT_CIPHERTEXT_BYTES = SHARE_BYTES + 16  # one share of the contributor bit + Poly1305 tag


def _check_id(name: str, v: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_ID:
        raise ValueError(f"{name} must be an int in [0, 2^64), got {v!r}")


def _check_bytes(name: str, v: bytes, n: int) -> None:
    if not isinstance(v, bytes) or len(v) != n:
        raise ValueError(f"{name} must be {n} bytes")


@dataclass(frozen=True)
class SecAggParams:
    """Public parameters of one run, identical on the server and every client."""

    run_id: bytes  # unique per run; bound into every key derivation and associated data
    threshold: int  # t: shares needed to reconstruct a secret; every stage aborts below t
    bits: int  # inputs and sums live in Z_{2^bits}, 1 <= bits <= 64
    length: int  # the most elements an input vector may have (each round declares its own length <= this)

    def __post_init__(self):
        if not isinstance(self.run_id, bytes) or not 0 < len(self.run_id) <= 255:
            raise ValueError("run_id must be 1..255 bytes")
        if not 1 <= self.bits <= 64:
            raise ValueError(f"bits must be in [1, 64], got {self.bits}")
        if self.threshold < 2:
            raise ValueError("threshold must be at least 2")
        if self.length < 1:
            raise ValueError("length must be positive")


@dataclass(frozen=True)
class KeyAdvert:
    """Setup, client -> server, once per run: the long-term key for encrypting shares and the key that
    signs this client's consistency-check answers."""

    sender: int
    c_pk: bytes  # X25519 public key, 32 bytes
    sig_pk: bytes  # Ed25519 public key, 32 bytes

    def __post_init__(self):
        _check_id("sender", self.sender)
        _check_bytes("c_pk", self.c_pk, KEY_BYTES)
        _check_bytes("sig_pk", self.sig_pk, KEY_BYTES)


@dataclass(frozen=True)
class KeyDirectory:
    """Setup, server -> all clients: the roster of the run, its share-encryption keys and its signing
    keys (each client pins the directory it accepted for the whole run)."""

    run_id: bytes
    keys: tuple[tuple[int, bytes], ...]  # (client id, c_pk), sorted by id
    sig_keys: tuple[tuple[int, bytes], ...]  # (client id, Ed25519 sig_pk), same ids in the same order

    def __post_init__(self):
        for cid, pk in (*self.keys, *self.sig_keys):
            _check_id("client id", cid)
            _check_bytes("key", pk, KEY_BYTES)


@dataclass(frozen=True)
class EncryptedShares:
    """Shares of (b_u, s_sk_u) for round ``round`` from ``sender`` to ``recipient``, AEAD-sealed with
    associated data binding run, round, sender, recipient, the sender's s_pk and its b commitment."""

    sender: int
    recipient: int
    round: int
    nonce: bytes  # 12 bytes
    ciphertext: bytes  # SHARE_CIPHERTEXT_BYTES

    def __post_init__(self):
        _check_id("sender", self.sender)
        _check_id("recipient", self.recipient)
        _check_id("round", self.round)
        _check_bytes("nonce", self.nonce, NONCE_BYTES)
        _check_bytes("ciphertext", self.ciphertext, SHARE_CIPHERTEXT_BYTES)


@dataclass(frozen=True)
class ShareKeys:
    """Stage 1 of round ``round``, client -> server: a fresh mask key and encrypted shares for every
    peer. Sent standalone or inside the previous round's ``MaskedInput``."""

    sender: int
    round: int
    s_pk: bytes  # fresh per-round X25519 public key for the pairwise masks
    b_commit: bytes  # SHA-256 commitment to the self-mask seed b_u
    shares: tuple[EncryptedShares, ...]  # one per peer, sorted by recipient

    def __post_init__(self):
        _check_id("sender", self.sender)
        _check_id("round", self.round)
        _check_bytes("s_pk", self.s_pk, KEY_BYTES)
        _check_bytes("b_commit", self.b_commit, 32)


@dataclass(frozen=True)
class RoundStart:
    """Stage 2 opener, server -> one participant: who shared keys (U1), their mask keys, and the
    ciphertexts addressed to this participant."""

    round: int
    recipient: int
    participants: tuple[tuple[int, bytes], ...]  # U1 as (id, s_pk), sorted by id
    shares: tuple[EncryptedShares, ...]  # from each peer in U1, addressed to recipient
    length: int = 0  # elements of this round's input vectors; 0 = params.length
    bits: int = 0  # this round's ring Z_{2^bits} (the release's declared width); 0 = params.bits

    def __post_init__(self):
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 0:
            raise ValueError(f"length must be an int >= 0, got {self.length!r}")
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 0 <= self.bits <= 64:
            raise ValueError(f"bits must be an int in [0, 64], got {self.bits!r}")


@dataclass(frozen=True)
class CountShare:
    """A Shamir share of ``sender``'s contributor bit c in {0, 1} of round ``round`` for ``recipient``,
    AEAD-sealed under the pairwise c-key with purpose "count" (associated data: run, round, sender,
    recipient). Travels with the masked input; the server relays it in the consistency request."""

    sender: int
    recipient: int
    round: int
    nonce: bytes  # 12 bytes
    ciphertext: bytes  # COUNT_CIPHERTEXT_BYTES

    def __post_init__(self):
        _check_id("sender", self.sender)
        _check_id("recipient", self.recipient)
        _check_id("round", self.round)
        _check_bytes("nonce", self.nonce, NONCE_BYTES)
        _check_bytes("ciphertext", self.ciphertext, COUNT_CIPHERTEXT_BYTES)


@dataclass(frozen=True, eq=False)
class MaskedInput:
    """Stage 2, client -> server: y_u = x_u + PRG(b_u) + sum_{v>u} PRG(s_uv) - sum_{v<u} PRG(s_uv), and a
    share of the contributor bit c_u for every other party of the run (the pinned key directory)."""

    sender: int
    round: int
    y: np.ndarray  # [length] uint32 (bits <= 32) or uint64, values < 2^bits; read-only
    next_keys: ShareKeys | None = None  # stage 1 of round + 1, piggybacked
    count_shares: tuple[CountShare, ...] = ()  # one per other party of the run's directory, sorted by recipient

    def __post_init__(self):
        _check_id("sender", self.sender)
        _check_id("round", self.round)
        y = np.asarray(self.y)
        if y.ndim != 1 or y.dtype not in (np.uint32, np.uint64):
            raise ValueError("y must be a 1-d uint32/uint64 array")
        y = y.view()
        y.flags.writeable = False
        object.__setattr__(self, "y", y)


@dataclass(frozen=True)
class ConsistencyRequest:
    """Consistency stage, server -> each member of U2: the survivor set U2 and the contributor-bit shares
    addressed to ``recipient`` from the other members of U2 (Bonawitz et al. CCS 2017 §4,
    ConsistencyCheck, extended with the securely summed contributor count)."""

    round: int
    recipient: int
    survivors: tuple[int, ...]  # U2, sorted
    count_shares: tuple[CountShare, ...]  # from each other member of U2, addressed to recipient


@dataclass(frozen=True)
class ConsistencyResponse:
    """Consistency stage, client -> server: its share of sum_{u in U2} c_u and its Ed25519 signature over
    (run, round, itself, U2, that share-sum) (``primitives.consistency_message``)."""

    sender: int
    round: int
    share_sum: bytes  # 66-byte field element
    signature: bytes  # 64 bytes

    def __post_init__(self):
        _check_id("sender", self.sender)
        _check_id("round", self.round)
        _check_bytes("share_sum", self.share_sum, SHARE_BYTES)
        _check_bytes("signature", self.signature, SIG_BYTES)


@dataclass(frozen=True)
class UnmaskRequest:
    """Stage 3, server -> survivors: b-shares wanted for ``alive`` (U2), s-shares for ``dead``
    (U1 minus U2). Each client checks both lists against the U1 it saw and its own peer set, and checks
    ``signatures`` (the consistency check) before revealing anything."""

    round: int
    alive: tuple[int, ...]
    dead: tuple[int, ...]
    signatures: tuple[tuple[int, bytes, bytes], ...] = ()  # (signer, 66-byte share-sum, 64-byte signature)

    def __post_init__(self):
        for signer, share_sum, sig in self.signatures:
            _check_id("signer", signer)
            _check_bytes("share_sum", share_sum, SHARE_BYTES)
            _check_bytes("signature", sig, SIG_BYTES)


@dataclass(frozen=True)
class UnmaskResponse:
    """Stage 3, client -> server: for each peer exactly one of its two shares."""

    sender: int
    round: int
    b_shares: tuple[tuple[int, bytes], ...]  # (owner, 66-byte share of b_owner), owner alive
    s_shares: tuple[tuple[int, bytes], ...]  # (owner, 66-byte share of s_sk_owner), owner dropped

    def __post_init__(self):
        for owner, share in (*self.b_shares, *self.s_shares):
            _check_id("owner", owner)
            _check_bytes("share", share, SHARE_BYTES)


@dataclass(frozen=True, eq=False)
class AggregateResult:
    """What the server learns: the sum of the inputs of ``included`` (U2) mod 2^bits."""

    round: int
    total: np.ndarray  # [length] uint32/uint64
    included: tuple[int, ...]  # U2: whose inputs are in ``total``
    dropped: tuple[int, ...]  # U1 minus U2: shared keys, sent no masked input
    responders: tuple[int, ...]  # U3: answered the unmask request
    contributors: int = 0  # sum_{u in U2} c_u, from the consistency stage


def payload_bytes(msg: object) -> int:
    """Serialized size of a message: raw bytes and array data, 8 bytes per integer."""
    if isinstance(msg, bytes):
        return len(msg)
    if isinstance(msg, np.ndarray):
        return msg.nbytes
    if isinstance(msg, bool) or msg is None:
        return 1
    if isinstance(msg, int):
        return 8
    if isinstance(msg, tuple | list):
        return sum(payload_bytes(m) for m in msg)
    if dataclasses.is_dataclass(msg):
        return sum(payload_bytes(getattr(msg, f.name)) for f in dataclasses.fields(msg))
    raise TypeError(f"no size for {type(msg).__name__}")
