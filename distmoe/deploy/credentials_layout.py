"""The credentials directory's layout and file rules: every path of a credentials directory (one place,
:func:`layout`), how the paths are read back, the checks of party names and SANs, and how files are written.

File rules: private files are written with mode 0600 and directories with 0700, independent of the umask
(:func:`write_file`, :func:`mkdir_private`); no existing file is replaced unless ``force`` is given.

Layout under ``OUT``::

    ca/ca.key, ca/ca.crt                     the CA (keep ca.key offline; it is not needed to run)
    superlink/ca.crt, server.pem, server.key the coordinator's TLS files (flower-superlink --ssl-*)
    superlink/supernodes/<party>.pub         public keys the coordinator registers (flwr supernode register)
    parties/<party>/                         what data owner <party> receives:
        ca.crt                               to verify the SuperLink (flower-supernode --root-certificates)
        supernode.key, supernode.pub         EC P-384 in OpenSSH format (--auth-supernode-private-key)
        ledger.key, ledger.pub               Ed25519 PKCS#8 PEM (node config ledger-key), raw hex public key
        party.json                           the party name and the file names above
        (with owner-made keys only ca.crt: the keys are in the owner's own directory, same file names,
        made by create_owner_keys, plus <party>.public.json, the one file the owner sends)
    manifest.json                            fingerprints of every public key and certificate

Must not: import ``flwr`` or any other distmoe module but ``distmoe.io``, make keys or certificates
(``distmoe.deploy.credentials`` and ``distmoe.deploy.owner_keys`` do), or touch files outside ``OUT``.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from distmoe.io import write_atomic

DEFAULT_SANS: tuple[str, ...] = ("localhost", "127.0.0.1", "::1")
CURVE = ec.SECP384R1  # the curve flower-1.42 documents for SuperNode keys; also used for the CA and server
PARTY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")  # same rule as node config 'party-name'
_DNS_RE = re.compile(r"^(\*\.)?([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}"
                     r"[A-Za-z0-9])?)*$")


class CredentialsError(ValueError):
    """A credentials request that cannot be carried out (the message names the option or the file)."""


@dataclass(frozen=True)
class PartyFiles:
    """The files of one data owner, inside ``parties/<name>/``."""

    name: str
    dir: Path
    ca_cert: Path
    supernode_key: Path
    supernode_pub: Path
    ledger_key: Path
    ledger_pub: Path
    info: Path  # party.json


@dataclass(frozen=True)
class Credentials:
    """Every path of one credentials directory (:func:`layout`); the files exist after :func:`create`."""

    root: Path
    ca_key: Path
    ca_cert: Path
    superlink_dir: Path
    superlink_ca: Path
    server_cert: Path
    server_key: Path
    registered_dir: Path  # superlink/supernodes: <party>.pub per data owner
    manifest: Path
    parties: tuple[PartyFiles, ...]

    def registered_pub(self, party: str) -> Path:
        return self.registered_dir / f"{party}.pub"

    def party(self, name: str) -> PartyFiles:
        for p in self.parties:
            if p.name == name:
                return p
        raise CredentialsError(f"no party {name!r} in {self.root} (parties: {', '.join(p.name for p in self.parties)})")


def party_files(party_dir: Path, name: str) -> PartyFiles:
    return PartyFiles(name=name, dir=party_dir, ca_cert=party_dir / "ca.crt",
                      supernode_key=party_dir / "supernode.key", supernode_pub=party_dir / "supernode.pub",
                      ledger_key=party_dir / "ledger.key", ledger_pub=party_dir / "ledger.pub",
                      info=party_dir / "party.json")


def layout(root: str | os.PathLike[str], parties: Sequence[str]) -> Credentials:
    """The paths of a credentials directory for ``parties`` (nothing is read or written)."""
    root = Path(root)
    sl = root / "superlink"
    return Credentials(root=root, ca_key=root / "ca" / "ca.key", ca_cert=root / "ca" / "ca.crt", superlink_dir=sl,
                       superlink_ca=sl / "ca.crt", server_cert=sl / "server.pem", server_key=sl / "server.key",
                       registered_dir=sl / "supernodes", manifest=root / "manifest.json",
                       parties=tuple(party_files(root / "parties" / p, p) for p in parties))


def read_credentials(root: str | os.PathLike[str]) -> Credentials:
    """The layout of an existing credentials directory (parties taken from its ``manifest.json``)."""
    root = Path(root)
    mpath = root / "manifest.json"
    try:
        parties = [p["name"] for p in json.loads(mpath.read_text())["parties"]]
    except FileNotFoundError:
        raise CredentialsError(f"{mpath} not found: {root} is not a directory made by 'distmoe credentials'") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CredentialsError(f"{mpath} is unreadable ({type(exc).__name__}: {exc})") from None
    return layout(root, parties)


def read_party_dir(party_dir: str | os.PathLike[str]) -> PartyFiles:
    """A data owner's directory (``parties/<name>/`` as received): its name from ``party.json``."""
    party_dir = Path(party_dir)
    info = party_dir / "party.json"
    try:
        name = json.loads(info.read_text())["party"]
    except FileNotFoundError:
        raise CredentialsError(f"{info} not found: pass the data owner's directory made by 'distmoe deploy "
                               "owner-keys' (or OUT/parties/<party> of 'distmoe credentials --parties')") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CredentialsError(f"{info} is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(name, str) or not PARTY_RE.match(name):
        raise CredentialsError(f"{info}: party name {name!r} is invalid")
    return party_files(party_dir, name)


# --------------------------------------------------------------------------------------------- parsing
def party_names(parties: str | Sequence[str] | None = None, num_parties: int | None = None) -> list[str]:
    """``--parties a,b,c`` or ``--num-parties N`` (names ``party-0`` .. ``party-N-1``), validated."""
    if parties is not None and num_parties is not None:
        raise CredentialsError("give either --parties or --num-parties, not both")
    if parties is None and num_parties is None:
        raise CredentialsError("name the data owners: --parties party-0,party-1,... or --num-parties N")
    if num_parties is not None:
        if num_parties < 1:
            raise CredentialsError(f"--num-parties: value {num_parties} must be >= 1")
        return [f"party-{i}" for i in range(num_parties)]
    items = parties.split(",") if isinstance(parties, str) else list(parties)
    names = [s.strip() for s in items if s.strip()]
    if not names:
        raise CredentialsError("--parties: no party names given")
    for n in names:
        if not PARTY_RE.match(n):
            raise CredentialsError(f"--parties: name {n!r} must start with a letter or digit and use only "
                                   "letters, digits, '-', '_'")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise CredentialsError(f"--parties: duplicate name(s) {', '.join(dup)}")
    return names


def parse_sans(sans: Iterable[str] | None) -> list[x509.GeneralName]:
    """Subject alternative names: IP addresses (v4/v6) and DNS names; ``None``/empty = :data:`DEFAULT_SANS`."""
    items = [s.strip() for v in (sans or ()) for s in v.split(",") if s.strip()] or list(DEFAULT_SANS)
    out: list[x509.GeneralName] = []
    for s in items:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(s.strip("[]"))))
            continue
        except ValueError:
            pass
        if len(s) > 253 or not _DNS_RE.match(s):
            raise CredentialsError(f"--san: {s!r} is neither an IP address nor a valid DNS name")
        out.append(x509.DNSName(s.lower()))
    seen, uniq = set(), []
    for g in out:
        if g not in seen:
            seen.add(g)
            uniq.append(g)
    return uniq


# --------------------------------------------------------------------------------------------- files
def mkdir_private(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)  # exist_ok keeps an old mode; mode= is subject to the umask


def write_file(path: Path, data: bytes, *, private: bool, force: bool) -> None:
    """Write atomically with mode 0600 (private) or 0644; no replacement without ``force``."""
    write_atomic(path, data, mode=0o600 if private else 0o644, replace=force)


def pem_private_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def openssh_fingerprint(pub_line: bytes | str) -> str:
    """``SHA256:...`` of an OpenSSH public key line, as ``ssh-keygen -lf`` prints it."""
    text = pub_line.decode("ascii") if isinstance(pub_line, bytes) else pub_line
    blob = base64.b64decode(text.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode("ascii").rstrip("=")
