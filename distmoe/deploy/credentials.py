"""Federation credentials for a deployment: a CA, the SuperLink's TLS certificate, and per data owner the
SuperNode authentication key pair and the Ed25519 ledger-signing key.

Who makes what (``docs/deploy.md``): each data owner makes its own keys on its own machine
(:func:`create_owner_keys`, ``distmoe deploy owner-keys``) and sends only ``<party>.public.json`` (the two
public keys); the coordinator makes the CA and the SuperLink certificate from those public files
(:func:`create` with ``owner_public``, ``distmoe credentials --owner-keys``) and sends each owner back only
``ca.crt``. No private key of a data owner is ever on the coordinator's machine. :func:`create` with party
names instead (``--parties``/``--num-parties``) makes every key on one machine: a development shortcut for
tests and closed set-ups, where the coordinator could sign in any party's name.

Owns: the credentials directory layout (one place, :func:`layout`), the key and certificate formats, and
the file rules: private files are written with mode 0600 and directories with 0700, independent of
the umask; no existing file is replaced unless ``force`` is given, and the check covers every file
before the first one is written, so a refused call leaves nothing half-written.

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

Formats are the ones Flower 1.42 reads: ``flower-supernode`` loads its key with
``cryptography``'s ``load_ssh_private_key`` and requires an EC key on a NIST curve; ``flwr supernode
register`` loads the ``.pub`` with ``load_ssh_public_key``; the SuperLink's HTTPS server (uvicorn,
Python ``ssl``) takes a PEM certificate and a PEM private key; clients verify it against ``ca.crt``,
so the server certificate carries the SuperLink's addresses as subject alternative names.

This is a development CA. In production the certificate of the SuperLink should come from a real CA
(:data:`PRODUCTION_NOTE`).

Must not: import ``flwr`` (the library stays importable without it), or touch files outside ``OUT``.
"""

from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import ipaddress
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from distmoe.io import write_atomic

DEFAULT_SANS: tuple[str, ...] = ("localhost", "127.0.0.1", "::1")
DEFAULT_DAYS = 365
CURVE = ec.SECP384R1  # the curve flower-1.42 documents for SuperNode keys; also used for the CA and server
PARTY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")  # same rule as node config 'party-name'
_DNS_RE = re.compile(r"^(\*\.)?([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}"
                     r"[A-Za-z0-9])?)*$")

PRODUCTION_NOTE = (
    "note: this is a development CA made on this machine. In production, have the SuperLink's certificate "
    "issued by a real CA (or your organisation's CA) for the public name/IP the data owners connect to, "
    "and keep ca/ca.key offline."
)
DEV_KEYS_NOTE = (
    "warning: --parties/--num-parties made every data owner's private keys (SuperNode and ledger-signing) on "
    "this machine: whoever holds this directory can sign ledger entries in any party's name. In a deployment "
    "each data owner runs 'distmoe deploy owner-keys' and the coordinator runs 'distmoe credentials "
    "--owner-keys <party>.public.json ...' (docs/deploy.md)."
)
OWNER_PUBLIC_FORMAT = "distmoe-owner-keys/1"


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
def _mkdir_private(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)  # exist_ok keeps an old mode; mode= is subject to the umask


def _write(path: Path, data: bytes, *, private: bool, force: bool) -> None:
    """Write atomically with mode 0600 (private) or 0644; no replacement without ``force``."""
    write_atomic(path, data, mode=0o600 if private else 0o644, replace=force)


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def openssh_fingerprint(pub_line: bytes | str) -> str:
    """``SHA256:...`` of an OpenSSH public key line, as ``ssh-keygen -lf`` prints it."""
    text = pub_line.decode("ascii") if isinstance(pub_line, bytes) else pub_line
    blob = base64.b64decode(text.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode("ascii").rstrip("=")


def _cert_fingerprint(cert: x509.Certificate) -> str:
    return "SHA256:" + cert.fingerprint(hashes.SHA256()).hex()


# --------------------------------------------------------------------------------------------- certificates
def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "distmoe federation"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(days: int = DEFAULT_DAYS, cn: str = "distmoe development CA"):
    """A self-signed CA: (private key, certificate) with CA:TRUE, pathlen 0, keyCertSign."""
    key = ec.generate_private_key(CURVE())
    now = _dt.datetime.now(_dt.UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (x509.CertificateBuilder()
            .subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(ski, critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
            .sign(key, hashes.SHA384()))
    return key, cert


def make_server_cert(ca_key, ca_cert: x509.Certificate, sans: Sequence[x509.GeneralName],
                     days: int = DEFAULT_DAYS):
    """The SuperLink's TLS certificate signed by the CA: (private key, certificate), SANs = ``sans``."""
    if not sans:
        raise CredentialsError("the server certificate needs at least one subject alternative name (--san)")
    key = ec.generate_private_key(CURVE())
    now = _dt.datetime.now(_dt.UTC)
    first_dns = next((g.value for g in sans if isinstance(g, x509.DNSName)), None)
    cn = first_dns or str(sans[0].value)
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (x509.CertificateBuilder()
            .subject_name(_name(cn)).issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .sign(ca_key, hashes.SHA384()))
    return key, cert


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
    return _pem_key(key), pub


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
    _mkdir_private(out)
    pub, lpub = _make_party_keys(p, force)
    doc = {"format": OWNER_PUBLIC_FORMAT, "party": name, "supernode-pub": pub.decode("ascii").strip(),
           "supernode-key-fingerprint": openssh_fingerprint(pub), "ledger-public-key": lpub}
    _write(public, (json.dumps(doc, indent=2) + "\n").encode("ascii"), private=False, force=force)
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


def _make_party_keys(p: PartyFiles, force: bool) -> tuple[bytes, str]:
    """Make and write one party's SuperNode key pair and ledger key (private files 0600) and its info file;
    return (SuperNode public key, ledger public key hex)."""
    priv, pub = make_supernode_keypair(p.name)
    lkey, lpub = make_ledger_key()
    _write(p.supernode_key, priv, private=True, force=force)
    _write(p.supernode_pub, pub, private=False, force=force)
    _write(p.ledger_key, lkey, private=True, force=force)
    _write(p.ledger_pub, (lpub + "\n").encode("ascii"), private=False, force=force)
    _write(p.info, _party_json(p), private=False, force=force)
    return pub, lpub


def _party_json(p: PartyFiles) -> bytes:
    info = {"party": p.name, "ca-cert": p.ca_cert.name, "supernode-key": p.supernode_key.name,
            "supernode-pub": p.supernode_pub.name, "ledger-key": p.ledger_key.name, "ledger-pub": p.ledger_pub.name}
    return (json.dumps(info, indent=2) + "\n").encode("ascii")


# --------------------------------------------------------------------------------------------- create
def create(out: str | os.PathLike[str], parties: Sequence[str] = (), sans: Iterable[str] | None = None, *,
           days: int = DEFAULT_DAYS, force: bool = False,
           owner_public: Sequence[OwnerPublic] | None = None) -> Credentials:
    """Make a federation's credentials under ``out`` (see the module docstring for the layout).

    With ``owner_public`` (the data owners' ``<party>.public.json``, :func:`read_owner_public`) only public
    keys are used: no private key of a data owner is made here, and ``parties/<party>/`` gets ``ca.crt``
    only. Otherwise (development) every key of the named ``parties`` is made here.

    Without ``force``, an existing file at any of the paths is an error naming it, raised before
    anything is written. With ``force`` every file is replaced (new keys: re-register the SuperNodes).
    """
    if owner_public is not None and parties:
        raise CredentialsError("give either party names (development keys) or the owners' public key files")
    names = party_names([o.party for o in owner_public] if owner_public is not None else list(parties))
    general_names = parse_sans(sans)
    if days < 1:
        raise CredentialsError(f"--days: value {days} must be >= 1")
    creds = layout(out, names)
    root = creds.root
    if root.exists() and not root.is_dir():
        raise CredentialsError(f"{root} exists and is not a directory")
    targets = [creds.ca_key, creds.ca_cert, creds.superlink_ca, creds.server_cert, creds.server_key, creds.manifest]
    for p in creds.parties:
        targets += [creds.registered_pub(p.name), p.ca_cert]
        if owner_public is None:
            targets += [p.supernode_key, p.supernode_pub, p.ledger_key, p.ledger_pub, p.info]
    if not force:
        for t in targets:
            if t.exists() or t.is_symlink():
                raise CredentialsError(f"{t} already exists; refusing to overwrite it (use --force to replace "
                                       "every credential; SuperNodes then need to be registered again)")

    for d in [root, creds.ca_key.parent, creds.superlink_dir, creds.registered_dir, root / "parties",
              *(p.dir for p in creds.parties)]:
        _mkdir_private(d)

    ca_key, ca_cert = make_ca(days)
    srv_key, srv_cert = make_server_cert(ca_key, ca_cert, general_names, days)
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    _write(creds.ca_key, _pem_key(ca_key), private=True, force=force)
    _write(creds.ca_cert, ca_pem, private=False, force=force)
    _write(creds.superlink_ca, ca_pem, private=False, force=force)
    _write(creds.server_key, _pem_key(srv_key), private=True, force=force)
    _write(creds.server_cert, srv_cert.public_bytes(serialization.Encoding.PEM), private=False, force=force)

    manifest_parties = []
    for i, p in enumerate(creds.parties):
        _write(p.ca_cert, ca_pem, private=False, force=force)
        if owner_public is not None:
            pub, lpub = owner_public[i].supernode_pub, owner_public[i].ledger_pub
        else:
            pub, lpub = _make_party_keys(p, force)
        _write(creds.registered_pub(p.name), pub, private=False, force=force)
        manifest_parties.append({"name": p.name, "supernode-key-fingerprint": openssh_fingerprint(pub),
                                 "ledger-public-key": lpub,
                                 "keys-made-by": "owner" if owner_public is not None else "this machine"})

    manifest = {
        "format": "distmoe-credentials/1",
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "ca": {"subject": ca_cert.subject.rfc4514_string(), "fingerprint": _cert_fingerprint(ca_cert),
               "not-after": ca_cert.not_valid_after_utc.isoformat()},
        "server": {"subject": srv_cert.subject.rfc4514_string(), "fingerprint": _cert_fingerprint(srv_cert),
                   "sans": [str(g.value) for g in general_names],
                   "not-after": srv_cert.not_valid_after_utc.isoformat()},
        "parties": manifest_parties,
    }
    _write(creds.manifest, (json.dumps(manifest, indent=2) + "\n").encode("ascii"), private=False, force=force)
    return creds


def summary(creds: Credentials) -> str:
    """What was made and who receives what (printed by ``distmoe credentials``)."""
    lines = [f"credentials in {creds.root}:",
             f"  CA (keep offline):         {creds.ca_key}  {creds.ca_cert}",
             f"  coordinator (SuperLink):   {creds.superlink_dir}/  (ca.crt, server.pem, server.key)",
             f"  public keys to register:   {creds.registered_dir}/<party>.pub"]
    owner_made = not any(p.supernode_key.exists() for p in creds.parties)
    for p in creds.parties:
        if owner_made:
            lines.append(f"  data owner {p.name}: send {p.ca_cert} (it has its own keys)")
        else:
            lines.append(f"  data owner {p.name}: send {p.dir}/ (ca.crt, supernode.key, ledger.key, party.json)")
    lines.append(PRODUCTION_NOTE)
    if not owner_made:
        lines.append(DEV_KEYS_NOTE)
    return "\n".join(lines)
