"""``distmoe credentials``: certificates that verify and serve TLS, keys in the formats Flower 1.42 loads,
file modes, and the no-overwrite / ``--force`` rules.

Flower's own loaders are used where Flower reads a file: ``flower-supernode``'s private-key setup
(``_try_setup_client_authentication``, i.e. ``load_ssh_private_key`` + EC check) and ``flwr supernode
register``'s ``try_load_public_key`` (``load_ssh_public_key`` + NIST-curve check).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.verification import PolicyBuilder, Store

from distmoe.cli import main
from distmoe.deploy import credentials as cr
from distmoe.ledger import load_signing_key, public_key_hex

PARTIES = ["party-0", "party-1", "party-2"]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> cr.Credentials:
    return cr.create(tmp_path_factory.mktemp("c") / "out", PARTIES)


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ----------------------------------------------------------------------------------------- certificates
def test_server_certificate_chains_to_the_ca_for_every_default_san(made):
    ca, srv = _cert(made.ca_cert), _cert(made.server_cert)
    ca.verify_directly_issued_by(ca)
    srv.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert srv.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    sans = srv.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert set(sans.get_values_for_type(x509.IPAddress)) == {ipaddress.ip_address("127.0.0.1"),
                                                             ipaddress.ip_address("::1")}
    # full path validation with the web-PKI server policy, once per name a client may use
    store = Store([ca])
    for subject in (x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.IPAddress(ipaddress.ip_address("::1"))):
        chain = PolicyBuilder().store(store).build_server_verifier(subject).verify(srv, [])
        assert chain[-1] == ca
    with pytest.raises(Exception, match="(?i)subject|name|mismatch"):
        PolicyBuilder().store(store).build_server_verifier(x509.DNSName("elsewhere.example")).verify(srv, [])
    # every copy of the CA certificate is the same CA
    assert made.superlink_ca.read_bytes() == made.ca_cert.read_bytes()
    assert all(p.ca_cert.read_bytes() == made.ca_cert.read_bytes() for p in made.parties)


def test_custom_sans(tmp_path):
    c = cr.create(tmp_path / "c", ["a"], ["superlink.example.org", "10.0.0.5,[2001:db8::1]"])
    sans = _cert(c.server_cert).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["superlink.example.org"]
    assert set(sans.get_values_for_type(x509.IPAddress)) == {ipaddress.ip_address("10.0.0.5"),
                                                             ipaddress.ip_address("2001:db8::1")}
    assert "superlink.example.org" in _cert(c.server_cert).subject.rfc4514_string()
    with pytest.raises(cr.CredentialsError, match="--san: 'bad name!'"):
        cr.create(tmp_path / "d", ["a"], ["bad name!"])
    assert not (tmp_path / "d").exists()  # validated before anything is made


def test_tls_handshake_with_python_ssl_as_flower_uses_it(made):
    """The SuperLink serves with uvicorn (ssl.load_cert_chain); Flower's clients verify with the CA file."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(str(made.server_cert), str(made.server_key))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    errors: list[BaseException] = []

    def serve():
        for _ in range(2):
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(tls.recv(5))
            except (ssl.SSLError, OSError) as exc:
                errors.append(exc)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        for name in ("127.0.0.1", "localhost"):  # an IP SAN and a DNS SAN, hostname checked
            client_ctx = ssl.create_default_context(cafile=str(made.ca_cert))
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
                with client_ctx.wrap_socket(raw, server_hostname=name) as tls:
                    tls.sendall(b"hello")
                    assert tls.recv(5) == b"hello"
    finally:
        t.join(timeout=10)
        listener.close()
    assert not errors, errors


# ----------------------------------------------------------------------------------------- key formats
def test_supernode_keys_load_with_flowers_own_loaders(made):
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes
    from flwr.supernode.cli.flower_supernode import _try_setup_client_authentication

    seen = set()
    for p in made.parties:
        priv, pub = _try_setup_client_authentication(
            argparse.Namespace(auth_supernode_private_key=str(p.supernode_key), auth_supernode_public_key=None))
        assert isinstance(priv, ec.EllipticCurvePrivateKey) and priv.curve.name == "secp384r1"
        registered = try_load_public_key(made.registered_pub(p.name))  # what flwr supernode register sends
        assert registered == public_key_to_bytes(pub) == try_load_public_key(p.supernode_pub)
        assert p.supernode_pub.read_text().startswith("ecdsa-sha2-nistp384 ")
        seen.add(registered)
    assert len(seen) == len(PARTIES)  # one key pair per data owner


def test_ledger_keys_load_with_distmoes_ledger_loader(made):
    pubs = set()
    for p in made.parties:
        key = load_signing_key(p.ledger_key)  # strict: refuses group/other-readable files
        assert public_key_hex(key) == p.ledger_pub.read_text().strip()
        pubs.add(public_key_hex(key))
    assert len(pubs) == len(PARTIES)


def test_manifest_and_party_dirs_describe_the_files(made):
    again = cr.read_credentials(made.root)
    assert again == made
    for p in made.parties:
        assert cr.read_party_dir(p.dir) == p
    import json

    m = json.loads(made.manifest.read_text())
    assert [p["name"] for p in m["parties"]] == PARTIES
    for p, entry in zip(made.parties, m["parties"], strict=True):
        assert entry["supernode-key-fingerprint"] == cr.openssh_fingerprint(p.supernode_pub.read_bytes())
        assert entry["ledger-public-key"] == p.ledger_pub.read_text().strip()
    with pytest.raises(cr.CredentialsError, match="party.json not found"):
        cr.read_party_dir(made.root)


# ----------------------------------------------------------------------------------------- files
def test_private_files_0600_dirs_0700_even_with_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        c = cr.create(tmp_path / "c", ["a", "b"])
    finally:
        os.umask(old)
    private = {c.ca_key, c.server_key, *(p.supernode_key for p in c.parties), *(p.ledger_key for p in c.parties)}
    files = [f for f in c.root.rglob("*") if f.is_file()]
    dirs = [c.root, *(d for d in c.root.rglob("*") if d.is_dir())]
    assert private <= set(files)
    for f in files:
        assert _mode(f) == (0o600 if f in private else 0o644), f
    for d in dirs:
        assert _mode(d) == 0o700, d
    assert not [f for f in files if f.name.endswith(".tmp")]


def test_refuses_to_overwrite_and_names_the_file(tmp_path):
    c = cr.create(tmp_path / "c", ["a"])
    before = {f: f.read_bytes() for f in c.root.rglob("*") if f.is_file()}
    with pytest.raises(cr.CredentialsError, match=r"ca\.key already exists.*--force"):
        cr.create(tmp_path / "c", ["a"])
    assert {f: f.read_bytes() for f in c.root.rglob("*") if f.is_file()} == before

    # one stray file is enough to refuse, and nothing else is written
    d = cr.layout(tmp_path / "d", ["x", "y"])
    d.parties[1].dir.mkdir(parents=True)
    d.parties[1].ledger_key.write_text("mine")
    with pytest.raises(cr.CredentialsError, match=str(d.parties[1].ledger_key)):
        cr.create(d.root, ["x", "y"])
    assert [f for f in d.root.rglob("*") if f.is_file()] == [d.parties[1].ledger_key]
    assert d.parties[1].ledger_key.read_text() == "mine"


def test_force_replaces_every_credential(tmp_path):
    c = cr.create(tmp_path / "c", ["a"])
    old_key, old_ca = c.parties[0].supernode_key.read_bytes(), c.ca_cert.read_bytes()
    os.chmod(c.parties[0].ledger_key, 0o644)  # a loosened mode is tightened again
    c2 = cr.create(tmp_path / "c", ["a"], force=True)
    assert c2 == c
    assert c.parties[0].supernode_key.read_bytes() != old_key and c.ca_cert.read_bytes() != old_ca
    assert _mode(c.parties[0].ledger_key) == 0o600
    _cert(c.server_cert).verify_directly_issued_by(_cert(c.ca_cert))  # the new server cert is the new CA's


def test_party_names():
    assert cr.party_names(num_parties=2) == ["party-0", "party-1"]
    assert cr.party_names("alice, bob") == ["alice", "bob"]
    for bad, msg in (("a,a", "duplicate"), ("a,b c", "'b c'"), ("-x", "'-x'"), (",", "no party names")):
        with pytest.raises(cr.CredentialsError, match=msg):
            cr.party_names(bad)
    with pytest.raises(cr.CredentialsError, match="either"):
        cr.party_names("a", 2)
    with pytest.raises(cr.CredentialsError, match=">= 1"):
        cr.party_names(num_parties=0)


# ----------------------------------------------------------------------------------------- command
def test_cli_credentials_prints_production_note_and_refuses_a_second_run(tmp_path, capsys):
    out = tmp_path / "creds"
    assert main(["credentials", "--out", str(out), "--num-parties", "2", "--san", "localhost",
                 "--san", "127.0.0.1"]) == 0
    text = capsys.readouterr().out
    assert "real CA" in text and "party-1" in text
    assert (out / "parties" / "party-1" / "supernode.key").is_file()
    assert main(["credentials", "--out", str(out), "--num-parties", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "already exists" in err and str(out) in err
    assert main(["credentials", "--out", str(out), "--num-parties", "2", "--force"]) == 0
