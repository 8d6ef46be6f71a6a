"""Owner-made keys: each data owner makes its SuperNode and ledger-signing keys on its own machine
(``distmoe deploy owner-keys``); the coordinator's ``distmoe credentials --owner-keys`` receives public keys
only; the owner's SuperNode signs its ledger with the key it made.

The attack these tests exercise: a coordinator holding a party's ledger-signing key can write (and sign) that
party's ledger entries itself, so a forged party ledger would pass the audit. The defence: no private key of a
data owner exists on the coordinator's machine (checked by scanning every file the coordinator's command
wrote), and the key the party signs with is the owner's own.
"""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from distmoe.cli import main
from distmoe.config import parse_node_config, parse_run_config
from distmoe.deploy import commands as dc
from distmoe.deploy import credentials as cr

OWNERS = ["hospital-a", "hospital-b"]


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """Two owners' directories and the coordinator's credentials made from their public files only."""
    root = tmp_path_factory.mktemp("fed")
    owners, public = {}, []
    for name in OWNERS:
        files, pub = cr.create_owner_keys(root / name, name)
        owners[name] = files
        public.append(cr.read_owner_public(pub))
    creds = cr.create(root / "coordinator", (), owner_public=public)
    return root, owners, creds


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_owner_private_keys_stay_with_the_owner_0600(federation):
    _, owners, _ = federation
    for p in owners.values():
        assert _mode(p.dir) == 0o700 and _mode(p.supernode_key) == 0o600 and _mode(p.ledger_key) == 0o600
        public = cr.owner_public_path(p.dir, p.name)
        text = public.read_text()
        assert "PRIVATE" not in text and _mode(public) == 0o644
        doc = json.loads(text)
        assert doc["supernode-pub"] == p.supernode_pub.read_text().strip()
        assert doc["ledger-public-key"] == p.ledger_pub.read_text().strip()
        assert doc["supernode-key-fingerprint"] == cr.openssh_fingerprint(p.supernode_pub.read_text())


def test_the_coordinator_holds_no_private_key_of_an_owner(federation):
    _, owners, creds = federation
    private = {f.name for f in creds.root.rglob("*") if f.is_file() and b"PRIVATE KEY" in f.read_bytes()}
    assert private == {"ca.key", "server.key"}  # its own CA and TLS keys only
    for p in creds.parties:
        assert sorted(f.name for f in p.dir.iterdir()) == ["ca.crt"]
    manifest = json.loads(creds.manifest.read_text())
    for entry in manifest["parties"]:
        owner = owners[entry["name"]]
        assert entry["ledger-public-key"] == owner.ledger_pub.read_text().strip()
        assert entry["keys-made-by"] == "owner"
        assert creds.registered_pub(entry["name"]).read_text() == owner.supernode_pub.read_text()


def test_the_owners_supernode_signs_with_the_owners_own_key(federation, tmp_path):
    from distmoe.party.session import open_ledger

    _, owners, creds = federation
    owner = owners["hospital-a"]
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(dc.DeployError, match="put the coordinator's ca.crt"):
        dc.supernode_command(owner.dir, superlink="127.0.0.1:9092", data_path=data)
    shutil.copy(creds.party("hospital-a").ca_cert, owner.ca_cert)
    cmd = dc.supernode_command(owner.dir, superlink="127.0.0.1:9092", data_path=data)
    argv = list(cmd.argv)
    assert argv[argv.index("--auth-supernode-private-key") + 1] == str(owner.supernode_key.resolve())
    assert f'ledger-key="{owner.ledger_key.resolve()}"' in argv[argv.index("--node-config") + 1]
    node = parse_node_config(
        {"data-path": str(data), "party-name": "hospital-a", "ledger-key": str(owner.ledger_key)},
        parse_run_config({}).sim,
    )
    assert open_ledger(node).public_key_hex == owner.ledger_pub.read_text().strip()


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.update(format="other/1"), "format is 'other/1'"),
        (lambda d: d.update(party="bad name"), "party name 'bad name' is invalid"),
        (lambda d: d.update({"ledger-public-key": "ab" * 31}), "not 32 bytes"),
        (lambda d: d.update({"ledger-public-key": "zz" * 32}), "non-hexadecimal"),
        (
            lambda d: d.update(
                {"supernode-pub": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE2Bk8U7d1Q3iC8p0c0x7rXq7B8tq2aJc8M6l0bHq5Xq x"}
            ),
            "not an EC P-384 key",
        ),
        (lambda d: d.pop("ledger-public-key"), "KeyError"),
    ],
)
def test_a_bad_public_file_is_refused(tmp_path, edit, match):
    _, pub = cr.create_owner_keys(tmp_path / "o", "party-0")
    doc = json.loads(pub.read_text())
    edit(doc)
    pub.write_text(json.dumps(doc))
    with pytest.raises(cr.CredentialsError, match=match):
        cr.read_owner_public(pub)


def test_a_private_key_sent_as_public_is_refused(tmp_path):
    files, pub = cr.create_owner_keys(tmp_path / "o", "party-0")
    doc = json.loads(pub.read_text())
    doc["supernode-pub"] = files.supernode_key.read_text()
    pub.write_text(json.dumps(doc))
    with pytest.raises(cr.CredentialsError):
        cr.read_owner_public(pub)


def test_owner_keys_refuse_to_overwrite_and_duplicates_are_refused(tmp_path):
    _, pub = cr.create_owner_keys(tmp_path / "o", "party-0")
    with pytest.raises(cr.CredentialsError, match="already exists; refusing to overwrite it"):
        cr.create_owner_keys(tmp_path / "o", "party-0")
    first = cr.read_owner_public(pub)
    with pytest.raises(cr.CredentialsError, match="duplicate name"):
        cr.create(tmp_path / "c", (), owner_public=[first, first])
    with pytest.raises(cr.CredentialsError, match="either party names"):
        cr.create(tmp_path / "c", ["x"], owner_public=[first])
    serialization.load_ssh_public_key(first.supernode_pub)


def test_cli_owner_keys_then_credentials(tmp_path, capsys):
    assert main(["deploy", "owner-keys", "--party", "party-0", "--out", str(tmp_path / "o")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["party"] == "party-0" and "PRIVATE" not in out
    assert "send only" in err and "party-0.public.json" in err
    assert (
        main(["credentials", "--out", str(tmp_path / "c"), "--owner-keys", str(tmp_path / "o" / "party-0.public.json")])
        == 0
    )
    out, _ = capsys.readouterr()
    assert "data owner party-0: send" in out and "it has its own keys" in out and "warning" not in out
    assert main(["credentials", "--out", str(tmp_path / "d"), "--parties", "x"]) == 0
    out, _ = capsys.readouterr()
    assert "every data owner's private keys" in out  # the development shortcut says what it is
    assert main(["credentials", "--out", str(tmp_path / "e"), "--owner-keys", str(tmp_path / "nope.json")]) == 2
    assert "not found" in capsys.readouterr().err
