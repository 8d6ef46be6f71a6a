"""Federation credentials for a deployment: the CA and the SuperLink's TLS certificate, made from the data
owners' public keys, and the whole credentials directory (:func:`create`) with its manifest.

Who makes what (``docs/deploy.md``): each data owner makes its own keys on its own machine
(:func:`create_owner_keys`, ``distmoe deploy owner-keys``) and sends only ``<party>.public.json`` (the two
public keys); the coordinator makes the CA and the SuperLink certificate from those public files
(:func:`create` with ``owner_public``, ``distmoe credentials --owner-keys``) and sends each owner back only
``ca.crt``. No private key of a data owner is ever on the coordinator's machine. :func:`create` with party
names instead (``--parties``/``--num-parties``) makes every key on one machine: a development shortcut for
tests and closed set-ups, where the coordinator could sign in any party's name.

Owns: the CA and the SuperLink's TLS certificate, :func:`create` (a whole credentials directory: the
check covers every file before the first one is written, so a refused call leaves nothing half-written) and
its manifest. The layout, the file rules and the parsing are ``distmoe.deploy.credentials_layout``; a data
owner's own keys are ``distmoe.deploy.owner_keys``; this module re-exports their public names.

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

import datetime as _dt
import json
import os
from collections.abc import Iterable, Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from distmoe.deploy.credentials_layout import (
    CURVE,
    DEFAULT_SANS,
    PARTY_RE,
    Credentials,
    CredentialsError,
    PartyFiles,
    layout,
    mkdir_private,
    openssh_fingerprint,
    parse_sans,
    party_files,
    party_names,
    pem_private_key,
    read_credentials,
    read_party_dir,
    write_file,
)
from distmoe.deploy.owner_keys import (
    OWNER_PUBLIC_FORMAT,
    OwnerPublic,
    create_owner_keys,
    make_ledger_key,
    make_party_keys,
    make_supernode_keypair,
    owner_public_path,
    read_owner_public,
)

__all__ = [
    "CURVE",
    "DEFAULT_DAYS",
    "DEFAULT_SANS",
    "DEV_KEYS_NOTE",
    "OWNER_PUBLIC_FORMAT",
    "PARTY_RE",
    "PRODUCTION_NOTE",
    "Credentials",
    "CredentialsError",
    "OwnerPublic",
    "PartyFiles",
    "create",
    "create_owner_keys",
    "layout",
    "make_ca",
    "make_ledger_key",
    "make_server_cert",
    "make_supernode_keypair",
    "openssh_fingerprint",
    "owner_public_path",
    "parse_sans",
    "party_files",
    "party_names",
    "read_credentials",
    "read_owner_public",
    "read_party_dir",
    "summary",
]

DEFAULT_DAYS = 365

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
        mkdir_private(d)

    ca_key, ca_cert = make_ca(days)
    srv_key, srv_cert = make_server_cert(ca_key, ca_cert, general_names, days)
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    write_file(creds.ca_key, pem_private_key(ca_key), private=True, force=force)
    write_file(creds.ca_cert, ca_pem, private=False, force=force)
    write_file(creds.superlink_ca, ca_pem, private=False, force=force)
    write_file(creds.server_key, pem_private_key(srv_key), private=True, force=force)
    write_file(creds.server_cert, srv_cert.public_bytes(serialization.Encoding.PEM), private=False, force=force)

    manifest_parties = []
    for i, p in enumerate(creds.parties):
        write_file(p.ca_cert, ca_pem, private=False, force=force)
        if owner_public is not None:
            pub, lpub = owner_public[i].supernode_pub, owner_public[i].ledger_pub
        else:
            pub, lpub = make_party_keys(p, force)
        write_file(creds.registered_pub(p.name), pub, private=False, force=force)
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
    write_file(creds.manifest, (json.dumps(manifest, indent=2) + "\n").encode("ascii"), private=False, force=force)
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
