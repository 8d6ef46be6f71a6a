"""A node's Ed25519 ledger-signing key file: generated with mode 0600 (never overwritten without ``force``),
loaded with a permission check, and its public key in hex.

Owns: the key file format (unencrypted PKCS#8 PEM), public keys given as objects, hex or raw bytes, and
``private_tag``: a MAC under a secret derived from the signing key, for the key holder's own cache files (only it
makes or checks them, at a fraction of a signature's cost), and ``write_tagged`` / ``read_tagged``: such a cache
file's one format (the tag's hex, a newline, the payload), written atomically with mode 0600 and without fsync.

Must not: write a ledger.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from distmoe.io import write_atomic


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


def private_tag(key: Ed25519PrivateKey, domain: bytes, payload: bytes) -> str:
    """HMAC-SHA256 (hex) of ``payload`` under a secret derived from ``key``'s private bytes and ``domain``: a tag only
    the holder of ``key`` can make or check, for its own cache files (never shown to anyone else, never a signature
    another node verifies). Each ``domain`` derives its own secret, so one file's tag is never valid for another's."""
    raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                            serialization.NoEncryption())
    secret = hashlib.sha256(b"distmoe-private-tag-v1:" + domain + b":" + raw).digest()
    return hmac.new(secret, payload, hashlib.sha256).hexdigest()


def private_tag_ok(key: Ed25519PrivateKey, domain: bytes, payload: bytes, tag: str) -> bool:
    """Whether ``tag`` is :func:`private_tag` of ``payload`` (constant-time comparison)."""
    return hmac.compare_digest(private_tag(key, domain, payload), tag)


def write_tagged(path: str | os.PathLike[str], key: Ed25519PrivateKey, domain: bytes, payload: bytes) -> None:
    """Write the cache file ``path``: :func:`private_tag` of ``payload`` (hex), a newline, ``payload``; atomic, mode
    0600, no fsync (a cache: when it is lost or older after a crash, its reader redoes the work it saves)."""
    write_atomic(path, private_tag(key, domain, payload).encode("ascii") + b"\n" + payload, mode=0o600, durable=False)


def read_tagged(path: str | os.PathLike[str], key: Ed25519PrivateKey, domain: bytes) -> bytes | None:
    """The payload of a file :func:`write_tagged` wrote with this ``key`` and ``domain``; None when the file is
    missing or unreadable, has no tag line, or its tag does not verify (another key's, another domain's, edited)."""
    try:
        tag, payload = Path(path).read_bytes().split(b"\n", 1)
        return payload if private_tag_ok(key, domain, payload, tag.decode("ascii")) else None
    except (OSError, ValueError):  # no file; no newline (unpacking); a tag that is not ASCII (UnicodeDecodeError)
        return None
