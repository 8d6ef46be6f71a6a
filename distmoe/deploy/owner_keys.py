"""A data owner's own keys: its SuperNode authentication key pair and its Ed25519 ledger-signing key, made on
its own machine (:func:`create_owner_keys`, ``distmoe deploy owner-keys``), and the public file it sends the
coordinator (``<party>.public.json``, :func:`read_owner_public`).

Formats: the SuperNode key is EC P-384 in OpenSSH format (``flower-supernode`` loads it with
``load_ssh_private_key``); the ledger key is Ed25519 PKCS#8 PEM with its raw public key in hex (what
``distmoe.ledger.load_signing_key`` reads). Private files are written 0600, the directory 0700
(``distmoe.deploy.credentials_layout``); no existing file is replaced without ``force``.

Owns: the owner's key pairs, their files in the owner's directory and the owner public-key file format.
Must not: import ``flwr``, make the CA or the SuperLink certificate (``distmoe.deploy.credentials`` does), or
write any file outside the owner's directory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from distmoe.deploy.credentials_layout import (
    CURVE,
    PARTY_RE,
    CredentialsError,
    PartyFiles,
    mkdir_private,
    openssh_fingerprint,
    party_files,
    party_names,
    pem_private_key,
    write_file,
)

OWNER_PUBLIC_FORMAT = "distmoe-owner-keys/1"


def make_supernode_keypair(comment: str = "") -> tuple[bytes, bytes]:
    """An EC P-384 key pair as (OpenSSH private key PEM, OpenSSH public key line)."""
    key = ec.generate_private_key(CURVE())
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                             serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return priv, pub + (f" {comment}".encode("ascii") if comment else b"") + b"\n"


def make_ledger_key() -> tuple[bytes, str]:
    """An Ed25519 ledger-signing key as (PKCS#8 PEM, raw public key hex), the format
    :func:`distmoe.ledger.load_signing_key` reads."""
    key = Ed25519PrivateKey.generate()
    pub = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
    return pem_private_key(key), pub


# --------------------------------------------------------------------------------------------- data owner
@dataclass(frozen=True)
class OwnerPublic:
    """What a data owner sends the coordinator (``<party>.public.json``): its name and two public keys."""

    party: str
    supernode_pub: bytes  # OpenSSH line of the EC P-384 SuperNode authentication key
    ledger_pub: str  # raw Ed25519 public key, hex


def owner_public_path(owner_dir: Path, party: str) -> Path:
    return owner_dir / f"{party}.public.json"


def create_owner_keys(out: str | os.PathLike[str], party: str, *, force: bool = False) -> tuple[PartyFiles, Path]:
    """A data owner's own keys, made on its machine: ``OUT/supernode.key`` and ``OUT/ledger.key`` (0600),
    their public halves, ``party.json`` (the directory ``distmoe deploy supernode --credentials`` reads once
    the coordinator's ``ca.crt`` is put beside them) and ``OUT/<party>.public.json``, the only file to send.
    Returns (the owner's files, the public file)."""
    (name,) = party_names([party])
    out = Path(out).expanduser()
    p = party_files(out, name)
    public = owner_public_path(out, name)
    targets = [p.supernode_key, p.supernode_pub, p.ledger_key, p.ledger_pub, p.info, public]
    if not force:
        for t in targets:
            if t.exists() or t.is_symlink():
                raise CredentialsError(f"{t} already exists; refusing to overwrite it (use --force to make new "
                                       "keys; the coordinator then needs the new public file)")
    mkdir_private(out)
    pub, lpub = make_party_keys(p, force)
    doc = {"format": OWNER_PUBLIC_FORMAT, "party": name, "supernode-pub": pub.decode("ascii").strip(),
           "supernode-key-fingerprint": openssh_fingerprint(pub), "ledger-public-key": lpub}
    write_file(public, (json.dumps(doc, indent=2) + "\n").encode("ascii"), private=False, force=force)
    return p, public


def read_owner_public(path: str | os.PathLike[str]) -> OwnerPublic:
    """A data owner's ``<party>.public.json``, its keys checked (EC P-384 OpenSSH key, 32-byte Ed25519 key)."""
    path = Path(path).expanduser()
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != OWNER_PUBLIC_FORMAT:
            raise ValueError(f"format is {doc.get('format')!r}, expected {OWNER_PUBLIC_FORMAT!r}")
        name, sn, lp = doc["party"], doc["supernode-pub"], doc["ledger-public-key"]
    except FileNotFoundError:
        raise CredentialsError(f"--owner-keys: {path} not found") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CredentialsError(f"--owner-keys: {path} is not a data owner's public key file "
                               f"({type(exc).__name__}: {exc})") from None
    if not isinstance(name, str) or not PARTY_RE.match(name):
        raise CredentialsError(f"--owner-keys: {path}: party name {name!r} is invalid")
    try:
        key = serialization.load_ssh_public_key(str(sn).encode("ascii"))
        if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, CURVE):
            raise ValueError("not an EC P-384 key")
        ledger = bytes.fromhex(str(lp))
        if len(ledger) != 32:
            raise ValueError("the ledger public key is not 32 bytes")
        Ed25519PublicKey.from_public_bytes(ledger)
    except (ValueError, TypeError, UnicodeError, UnsupportedAlgorithm) as exc:
        raise CredentialsError(f"--owner-keys: {path}: {exc}") from None
    return OwnerPublic(name, str(sn).strip().encode("ascii") + b"\n", ledger.hex())


def make_party_keys(p: PartyFiles, force: bool) -> tuple[bytes, str]:
    """Make and write one party's SuperNode key pair and ledger key (private files 0600) and its info file;
    return (SuperNode public key, ledger public key hex)."""
    priv, pub = make_supernode_keypair(p.name)
    lkey, lpub = make_ledger_key()
    write_file(p.supernode_key, priv, private=True, force=force)
    write_file(p.supernode_pub, pub, private=False, force=force)
    write_file(p.ledger_key, lkey, private=True, force=force)
    write_file(p.ledger_pub, (lpub + "\n").encode("ascii"), private=False, force=force)
    write_file(p.info, party_json(p), private=False, force=force)
    return pub, lpub


def party_json(p: PartyFiles) -> bytes:
    info = {"party": p.name, "ca-cert": p.ca_cert.name, "supernode-key": p.supernode_key.name,
            "supernode-pub": p.supernode_pub.name, "ledger-key": p.ledger_key.name, "ledger-pub": p.ledger_pub.name}
    return (json.dumps(info, indent=2) + "\n").encode("ascii")
