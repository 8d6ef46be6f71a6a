"""Cryptographic primitives of the secure aggregation, all from ``cryptography`` (OpenSSL).

Owns: X25519 key pairs and agreement, HKDF-SHA256 key derivation with context-bound ``info``, the
AES-256-CTR keystream PRG that expands a 32-byte seed into a mask vector uniform over Z_{2^bits}, the
ChaCha20-Poly1305 envelope for Shamir shares, and the commitment to a self-mask seed.

Must not: use a non-cryptographic generator (``random``, ``numpy.random``) for anything secret, fold a
seed to fewer than 256 bits, reuse a derived key for two purposes, or derive a key without binding it
to (run, round, ordered party ids, purpose). Flower 1.42's SecAgg+ is not used because its PRG is
MT19937 seeded with a 32-bit fold of the key (flwrlabs/flower#7522) and its key derivation has no
context binding (``docs/privacy.md`` §9).
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable

import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from distmoe.privacy.secagg.errors import ProtocolViolation

PROTOCOL = b"distmoe-secagg/v2"  # v2: the masks' PRG is AES-256-CTR (v1: ChaCha20)
KEY_BYTES = 32
NONCE_BYTES = 12
SIG_BYTES = 64  # Ed25519 signature
MAX_ID = 2**64 - 1

RandomBytes = Callable[[int], bytes]  # n -> n bytes; os.urandom unless a test injects a seeded one


def default_rng() -> RandomBytes:
    return os.urandom


def _u64(v: int) -> bytes:
    if not 0 <= v <= MAX_ID:
        raise ValueError(f"id/round {v} outside [0, 2^64)")
    return v.to_bytes(8, "big")


def context(purpose: str, run_id: bytes, round_: int, *ids: int, extra: tuple[bytes, ...] = ()) -> bytes:
    """Unambiguous encoding of (protocol, purpose, run, round, ids..., extra...): each field is
    length-prefixed, so no two different tuples give the same bytes."""
    parts = (PROTOCOL, purpose.encode(), run_id, _u64(round_), *(_u64(i) for i in ids), *extra)
    return b"".join(len(p).to_bytes(2, "big") + p for p in parts)


# ---- X25519 ---------------------------------------------------------------------------------------

def new_keypair(rng: RandomBytes) -> tuple[bytes, bytes]:
    """(private raw 32 bytes, public raw 32 bytes)."""
    sk = X25519PrivateKey.from_private_bytes(rng(KEY_BYTES))
    return sk.private_bytes_raw(), sk.public_key().public_bytes_raw()


def public_from_private(sk: bytes) -> bytes:
    return X25519PrivateKey.from_private_bytes(sk).public_key().public_bytes_raw()


def agree(sk: bytes, pk: bytes) -> bytes:
    """X25519 shared secret; a low-order (all-zero result) public key is a protocol violation."""
    try:
        return X25519PrivateKey.from_private_bytes(sk).exchange(X25519PublicKey.from_public_bytes(pk))
    except ValueError as exc:
        raise ProtocolViolation(f"invalid X25519 public key: {exc}") from None


def derive_key(secret: bytes, info: bytes) -> bytes:
    """HKDF-SHA256, 32 bytes, no salt (the input is a fresh DH secret or a uniform seed)."""
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(secret)


# ---- Ed25519 (the consistency check's signatures) ------------------------------------------------

def new_signing_key(rng: RandomBytes) -> tuple[bytes, bytes]:
    """(Ed25519 private seed 32 bytes, public key 32 bytes): a party's SecAgg signing key of one run."""
    sk = Ed25519PrivateKey.from_private_bytes(rng(KEY_BYTES))
    return sk.private_bytes_raw(), sk.public_key().public_bytes_raw()


def signing_public(sk: bytes) -> bytes:
    return Ed25519PrivateKey.from_private_bytes(sk).public_key().public_bytes_raw()


def sign(sk: bytes, message: bytes) -> bytes:
    return Ed25519PrivateKey.from_private_bytes(sk).sign(message)


def verify(pk: bytes, signature: bytes, message: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(pk).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


# ---- PRG ------------------------------------------------------------------------------------------

def word_dtype(bits: int) -> np.dtype:
    """The unsigned word that holds Z_{2^bits}: uint32 up to 32 bits, uint64 up to 64."""
    if not 1 <= bits <= 64:
        raise ValueError(f"bits must be in [1, 64], got {bits}")
    return np.dtype(np.uint32) if bits <= 32 else np.dtype(np.uint64)


def ring_mask(bits: int) -> int:
    return (1 << bits) - 1


def prg(key: bytes, length: int, bits: int) -> np.ndarray:
    """Expand a 32-byte key into ``[length]`` words uniform over Z_{2^bits}.

    AES-256-CTR keystream (the 128-bit big-endian counter block starts at 0: every key is used for exactly
    one expansion), read as little-endian words and masked to ``bits``. Keeping the low bits of a uniform
    word is exactly uniform because 2^bits divides the word range. AES-CTR is the PRG of Google's SecAgg
    implementation (fcp's ``AesCtrPrngFactory``); it replaced ChaCha20 in protocol v2 because its keystream is
    1.56x ChaCha20's with AES instructions (8.2 vs 5.3 GB/s on one core of the benchmark machine,
    ``docs/results.md``), and the masks are most of the protocol's cost.
    """
    if len(key) != KEY_BYTES:
        raise ValueError("PRG key must be 32 bytes")
    dt = word_dtype(bits)
    enc = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    stream = enc.update(bytes(length * dt.itemsize))  # [length * itemsize] bytes
    words = np.frombuffer(stream, dtype=dt.newbyteorder("<")).astype(dt, copy=True)  # [length]
    if bits not in (32, 64):
        words &= dt.type(ring_mask(bits))
    return words


# Fast expansion: the same keystream as ``prg``, written chunk by chunk straight into a
# preallocated word buffer and added/subtracted in place. AES-CTR's counter block is the block index, so the
# stream can start at any 16-byte block (``_stream_at``): disjoint
# ranges of one stream can be expanded independently (threads) and still equal ``prg`` exactly.
CHUNK_BYTES = 1 << 18  # 256 KiB: the zero source and the scratch chunk stay in L2 while a range is combined
_ZEROS = bytes(CHUNK_BYTES)
_LITTLE = sys.byteorder == "little"


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


# threads per mask combination: this process's cores, at most 4 (``update_into`` releases the GIL; on the idle
# 2-core machine 9 pairwise 32-bit ChaCha20 streams, protocol v1, took 0.046 s on 2 threads vs 0.067 s on 1)
MASK_THREADS = max(1, min(4, _usable_cores()))


def _stream_at(key: bytes, offset_bytes: int):
    """An AES-256-CTR encryptor of ``key`` positioned at byte ``offset_bytes`` (a multiple of 16) of the keystream
    ``prg`` expands: its initial counter block is the block index, 128-bit big-endian (NIST SP 800-38A's
    standard incrementing function, so block i of the stream is AES_k(i))."""
    if len(key) != KEY_BYTES:
        raise ValueError("PRG key must be 32 bytes")
    block = offset_bytes // 16
    if offset_bytes % 16 or not 0 <= block < 2**128:
        raise ValueError(f"keystream offset {offset_bytes} is not a 16-byte block below 2^128 blocks")
    return Cipher(algorithms.AES(key), modes.CTR(block.to_bytes(16, "big"))).encryptor()


def prg_into(key: bytes, out: np.ndarray, bits: int) -> np.ndarray:
    """``out[:] = prg(key, len(out), bits)`` without an intermediate copy: ``out`` is a C-contiguous
    ``word_dtype(bits)`` array ``[length]``; the keystream is written into its bytes chunk by chunk."""
    return combine_masks(out, [(key, 0)], bits)


def _combine_range(out: np.ndarray, terms: list[tuple[bytes, int]], bits: int, lo: int, hi: int) -> None:
    """Words ``[lo, hi)`` of ``out`` (``lo`` at a 64-byte boundary of the keystream, a multiple of AES's 16-byte
    block): apply every term in place.
    Sign 0 writes the keystream (the first term only), +1 adds it, -1 subtracts it, all mod 2^word."""
    dt = out.dtype
    per = CHUNK_BYTES // dt.itemsize  # words per chunk
    scratch = np.empty(per, dt)  # [per], reused for every key and chunk
    sbytes = memoryview(scratch).cast("B")
    encs = [_stream_at(k, lo * dt.itemsize) for k, _ in terms]
    for a in range(lo, hi, per):
        b = min(a + per, hi)
        nb, seg = (b - a) * dt.itemsize, out[a:b]  # [b - a] view
        for enc, (_, sign) in zip(encs, terms, strict=True):
            if sign == 0:
                enc.update_into(_ZEROS[:nb], memoryview(seg).cast("B"))
                if not _LITTLE:
                    seg.byteswap(inplace=True)
                continue
            enc.update_into(_ZEROS[:nb], sbytes[:nb])
            s = scratch[:b - a]
            if not _LITTLE:
                s.byteswap(inplace=True)
            (np.add if sign > 0 else np.subtract)(seg, s, out=seg)


def combine_masks(out: np.ndarray, terms: list[tuple[bytes, int]], bits: int, *, threads: int = 1) -> np.ndarray:
    """In place: ``out = out + sum_{(k, +1)} PRG(k) - sum_{(k, -1)} PRG(k)  mod 2^bits``; a first term of sign 0
    overwrites ``out`` with ``PRG(k)`` instead (so no zero-fill is needed). ``out``: C-contiguous
    ``word_dtype(bits)`` ``[length]``. Equal to the reference ``prg`` arithmetic word for word (a test checks
    it). ``threads > 1`` splits the words into contiguous ranges, each expanded by its own positioned
    encryptors; it pays where cores are free (``cryptography`` releases the GIL in ``update_into``, numpy's ufuncs
    do): 1.46x for 9 pairwise streams on 2 threads of the idle 2-core machine, nothing under full load
    (``MASK_THREADS``: this process's cores, at most 4; ``docs/results.md``)."""
    dt = word_dtype(bits)
    if out.dtype != dt or out.ndim != 1 or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writeable contiguous [length] {dt} array, got {out.dtype} {out.shape}")
    if any(sign not in (-1, 0, 1) for _, sign in terms) or any(sign == 0 for _, sign in terms[1:]):
        raise ValueError("term signs must be +1/-1, with 0 (overwrite) allowed only first")
    n = out.shape[0]
    step = 64 // dt.itemsize  # words per 64 bytes (4 AES blocks): thread ranges start on a block
    parts = max(1, min(int(threads), n // (CHUNK_BYTES // dt.itemsize)))
    if parts == 1:
        _combine_range(out, list(terms), bits, 0, n)
    else:
        from concurrent.futures import ThreadPoolExecutor

        cuts = [min(n, -(-(n * i // parts) // step) * step) for i in range(parts)] + [n]
        with ThreadPoolExecutor(parts) as ex:
            for f in [ex.submit(_combine_range, out, list(terms), bits, cuts[i], cuts[i + 1]) for i in range(parts)]:
                f.result()
    if bits not in (32, 64):
        out &= dt.type(ring_mask(bits))
    return out


# ---- share envelope -------------------------------------------------------------------------------

def seal(key: bytes, plaintext: bytes, ad: bytes, rng: RandomBytes) -> tuple[bytes, bytes]:
    """ChaCha20-Poly1305 -> (nonce, ciphertext with tag). The key is already unique per
    (run, round, sender, recipient); the random nonce is defence in depth."""
    nonce = rng(NONCE_BYTES)
    return nonce, ChaCha20Poly1305(key).encrypt(nonce, plaintext, ad)


def open_sealed(key: bytes, nonce: bytes, ciphertext: bytes, ad: bytes) -> bytes | None:
    """Plaintext, or None when authentication fails."""
    try:
        return ChaCha20Poly1305(key).decrypt(nonce, ciphertext, ad)
    except (InvalidTag, ValueError):
        return None


def commit(seed: bytes, ctx: bytes) -> bytes:
    """SHA-256 commitment to a uniform 256-bit seed (lets the server check a reconstruction)."""
    return hashlib.sha256(ctx + seed).digest()


# ---- the protocol's derived keys (one purpose each) -----------------------------------------------

def share_key(run_id: bytes, round_: int, sender: int, recipient: int, c_sk: bytes, c_pk_peer: bytes) -> bytes:
    """AEAD key for the shares ``sender -> recipient`` of one round (direction-bound)."""
    return derive_key(agree(c_sk, c_pk_peer), context("share-key", run_id, round_, sender, recipient))


def share_ad(run_id: bytes, round_: int, sender: int, recipient: int, s_pk_sender: bytes) -> bytes:
    """Associated data of a share envelope: binds the sender's per-round mask key, so a server that
    swaps the relayed s_pk breaks the tag."""
    return context("share-ad", run_id, round_, sender, recipient, extra=(s_pk_sender,))


def self_mask_key(run_id: bytes, round_: int, owner: int, b: bytes) -> bytes:
    return derive_key(b, context("self-mask", run_id, round_, owner))


def pair_mask_key(run_id: bytes, round_: int, u: int, v: int, s_sk: bytes, s_pk_peer: bytes) -> bytes:
    """Pairwise mask seed of {u, v}: the same from either side (ids ordered low, high)."""
    lo, hi = (u, v) if u < v else (v, u)
    return derive_key(agree(s_sk, s_pk_peer), context("pair-mask", run_id, round_, lo, hi))


def b_commit_ctx(run_id: bytes, round_: int, owner: int) -> bytes:
    return context("b-commit", run_id, round_, owner)


def count_key(run_id: bytes, round_: int, sender: int, recipient: int, c_sk: bytes, c_pk_peer: bytes) -> bytes:
    """AEAD key for the contributor-bit share ``sender -> recipient`` of one round (purpose "count")."""
    return derive_key(agree(c_sk, c_pk_peer), context("count-key", run_id, round_, sender, recipient))


def count_ad(run_id: bytes, round_: int, sender: int, recipient: int) -> bytes:
    return context("count-ad", run_id, round_, sender, recipient)


def consistency_message(run_id: bytes, round_: int, signer: int, survivors: tuple[int, ...], share_sum: bytes) -> bytes:
    """What a survivor signs in the consistency check (Bonawitz et al. CCS 2017 §4, ConsistencyCheck):
    (domain, run, round, signer, the sorted survivor set U2 it was told, its share of sum_{u in U2} c_u)."""
    return context("consistency", run_id, round_, signer, extra=(b"".join(_u64(v) for v in sorted(survivors)),
                                                                 share_sum))


def directory_fingerprint(run_id: bytes, keys: tuple[tuple[int, bytes], ...], sig_keys: tuple[tuple[int, bytes], ...]
                          ) -> str:
    """SHA-256 (hex) of the canonical key directory: run, then (id, c_pk, sig_pk) sorted by id. Owners
    compare it out of band: a coordinator that gave two parties different keys gives them different
    fingerprints."""
    sig = dict(sig_keys)
    body = b"".join(_u64(v) + pk + sig.get(v, b"") for v, pk in sorted(keys))
    return hashlib.sha256(context("directory", run_id, 0, extra=(body,))).hexdigest()
