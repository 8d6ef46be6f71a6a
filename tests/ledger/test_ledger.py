"""The wire ledger: hash chain, signatures, anchoring, torn-tail recovery, key files."""

from __future__ import annotations

import hashlib
import json
import os
import stat

import pytest

import distmoe.ledger.writer as ledger_writer
from distmoe.ledger import (
    GENESIS,
    Ledger,
    LedgerError,
    TornLedgerWarning,
    anchors_in,
    describe_payload,
    entry_hash,
    generate_signing_key,
    load_signing_key,
    public_key_hex,
    verify_against_anchor,
    verify_ledger,
)


def _fields(i: int, **over):
    payload = f"payload-{i}".encode()
    f = dict(run="r1", round=i, phase="stats", direction="out", payload_type="router_stats",
             keys=["masked"], shapes={"masked": [200]}, **describe_payload(payload),
             dp={"mechanism": "skellam", "noise_multiplier": 10.0}, verdict="accepted")
    f.update(over)
    return f


@pytest.fixture
def key(tmp_path):
    return generate_signing_key(tmp_path / "keys" / "node.pem")


@pytest.fixture
def filled(tmp_path, key):
    path = tmp_path / "ledger" / "client-1.jsonl"
    led = Ledger(path, key)
    for i in range(5):
        led.append(**_fields(i))
    return path, led


def _lines(path):
    return path.read_bytes().decode().splitlines(keepends=True)


def _write(path, lines):
    path.write_text("".join(lines))


def test_append_chain_and_verify(filled, key):
    path, led = filled
    res = verify_ledger(path, public_key_hex(key))
    assert res.ok and res.entries == 5 and not res.errors
    entries = [json.loads(x) for x in _lines(path)]
    assert [e["seq"] for e in entries] == list(range(5))
    assert entries[0]["prev"] == GENESIS
    assert all(b["prev"] == a["hash"] for a, b in zip(entries, entries[1:], strict=False))
    assert all(e["hash"] == entry_hash(e) for e in entries)
    assert led.head() == (4, entries[-1]["hash"]) == res.head
    # reopening continues the same chain
    led2 = Ledger(path, key)
    e5 = led2.append(**_fields(5))
    assert e5["seq"] == 5 and e5["prev"] == entries[-1]["hash"]
    assert verify_ledger(path, key.public_key()).ok


def test_describe_payload_digest():
    d = describe_payload(b"abc")
    assert d == {"bytes": 3, "sha256": hashlib.sha256(b"abc").hexdigest()}


def test_edited_entry_detected(filled, key):
    path, _ = filled
    lines = _lines(path)
    e = json.loads(lines[2])
    e["bytes"] += 1  # a smuggled byte count, hash left as it was
    lines[2] = json.dumps(e) + "\n"
    _write(path, lines)
    res = verify_ledger(path, key.public_key())
    assert not res.ok and any("line 3" in m and "hash mismatch" in m for m in res.errors)


def test_edited_entry_with_recomputed_hash_fails_signature(filled, key):
    path, _ = filled
    lines = _lines(path)
    e = json.loads(lines[4])  # last entry: no later prev link can give it away
    e["verdict"] = "rejected: policy"
    e["hash"] = entry_hash(e)
    lines[4] = json.dumps(e) + "\n"
    _write(path, lines)
    res = verify_ledger(path, key.public_key())
    assert not res.ok
    assert any("line 5" in m and "bad signature" in m for m in res.errors)
    assert not any("hash mismatch" in m for m in res.errors)


def test_entry_forged_with_other_key_detected(filled, key, tmp_path):
    path, _ = filled
    other = generate_signing_key(tmp_path / "attacker.pem")
    lines = _lines(path)
    e = json.loads(lines[4])
    e["dp"] = None
    e["hash"] = entry_hash(e)
    e["sig"] = other.sign(ledger_writer.SIG_DOMAIN + e["hash"].encode()).hex()
    lines[4] = json.dumps(e) + "\n"
    _write(path, lines)
    assert any("bad signature" in m for m in verify_ledger(path, key.public_key()).errors)


def test_deleted_entry_detected(filled, key):
    path, _ = filled
    lines = _lines(path)
    del lines[2]
    _write(path, lines)
    res = verify_ledger(path, key.public_key())
    assert not res.ok
    assert any("seq 3, expected 2" in m for m in res.errors)
    assert any("prev does not link" in m for m in res.errors)


def test_reordered_entries_detected(filled, key):
    path, _ = filled
    lines = _lines(path)
    lines[1], lines[2] = lines[2], lines[1]
    _write(path, lines)
    res = verify_ledger(path, key.public_key())
    assert not res.ok and any("reordered" in m for m in res.errors)


def test_wrong_key_detected(filled, tmp_path):
    path, _ = filled
    other = generate_signing_key(tmp_path / "other.pem")
    res = verify_ledger(path, public_key_hex(other))
    assert not res.ok and sum("bad signature" in m for m in res.errors) == 5


def test_truncation_detected_only_against_anchor(tmp_path, key):
    client_path = tmp_path / "ledger" / "client-1.jsonl"
    client = Ledger(client_path, key)
    server = Ledger(tmp_path / "ledger" / "server.jsonl", generate_signing_key(tmp_path / "server.pem"))
    for i in range(4):
        client.append(**_fields(i))
        server.anchor("client-1", client.head(), run="r1", round=i)  # the head travels with each reply
    anchored = anchors_in(server.path)["client-1"]
    assert anchored == client.head()
    assert verify_against_anchor(client_path, key.public_key(), anchored).ok
    _write(client_path, _lines(client_path)[:2])  # drop the last two entries
    alone = verify_ledger(client_path, key.public_key())
    assert alone.ok  # a clean prefix of a chain is self-consistent: truncation needs the anchor
    res = verify_against_anchor(client_path, key.public_key(), {"seq": anchored[0], "hash": anchored[1]})
    assert not res.ok and any("truncated" in m for m in res.errors)
    assert verify_ledger(server.path, server.public_key_hex).ok


def test_rewritten_history_detected_against_anchor(tmp_path, key):
    path = tmp_path / "a.jsonl"
    led = Ledger(path, key)
    for i in range(3):
        led.append(**_fields(i))
    anchored = led.head()
    path.unlink()  # the node rewrites its history from scratch, validly signed
    led = Ledger(path, key)
    for i in range(3):
        led.append(**_fields(i, verdict="rejected: rewritten"))
    assert verify_ledger(path, key.public_key()).ok
    res = verify_against_anchor(path, key.public_key(), anchored)
    assert not res.ok and any("history rewritten" in m for m in res.errors)


def test_torn_trailing_line_is_truncated_on_open(filled, key, monkeypatch):
    path, led = filled
    size_before = path.stat().st_size
    real_write = os.write

    def crash_half_way(fd, data):  # the process dies mid-append after writing half the line
        real_write(fd, bytes(data)[: len(data) // 2])
        raise OSError("simulated crash")

    monkeypatch.setattr(ledger_writer.os, "write", crash_half_way)
    with pytest.raises(OSError, match="simulated crash"):
        led.append(**_fields(99, phase="torn-marker"))
    monkeypatch.setattr(ledger_writer.os, "write", real_write)
    assert path.stat().st_size > size_before
    torn = verify_ledger(path, key.public_key())
    assert not torn.ok and any("torn trailing line" in m for m in torn.errors)

    with pytest.warns(TornLedgerWarning, match="torn trailing line"):
        led2 = Ledger(path, key)
    assert led2.recovered_bytes > 0 and path.stat().st_size == size_before
    assert led2.head()[0] == 4
    led2.append(**_fields(5))
    led2.append(**_fields(6))
    res = verify_ledger(path, key.public_key())
    assert res.ok and res.entries == 7 and res.head == led2.head()
    assert b"torn-marker" not in path.read_bytes()


def test_damage_other_than_torn_tail_refuses_open(filled, key):
    path, _ = filled
    lines = _lines(path)
    lines[1] = '{"not": "an entry"\n'  # complete (newline-terminated) but corrupt: not a crash artefact
    _write(path, lines)
    with pytest.raises(LedgerError, match="does not verify"):
        Ledger(path, key)


def test_second_writer_is_refused(filled, key):
    path, led = filled
    other = Ledger(path, key)
    other.append(**_fields(5))
    with pytest.raises(LedgerError, match="another writer"):
        led.append(**_fields(5))
    assert verify_ledger(path, key.public_key()).ok  # the chain did not fork


def test_final_entry_seals_the_ledger_against_other_threads(filled, key):
    """A stop signal's handler writes ``run-end`` with ``append_final``; the run's own thread, still going, must
    not append after it (the audit requires run-end last). Concurrent appends from threads keep one chain."""
    import threading

    path, led = filled
    threads = [threading.Thread(target=led.append, kwargs=_fields(10 + i)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    led.append_final("stopped by a signal", **_fields(99))
    with pytest.raises(LedgerError, match="sealed"):
        led.append(**_fields(100))
    with pytest.raises(LedgerError, match="sealed"):
        led.append_final("again", **_fields(101))
    entries = [json.loads(line) for line in _lines(path)]
    assert len(entries) == 5 + 8 + 1 and entries[-1]["round"] == _fields(99)["round"]
    assert verify_ledger(path, key.public_key()).ok


@pytest.mark.parametrize("over,msg", [
    (dict(verdict="ok"), "verdict"),
    (dict(verdict="rejected: "), "verdict"),
    (dict(direction="sideways"), "direction"),
    (dict(sha256="xyz"), "sha256"),
    (dict(extra_field=1), "unknown ledger fields"),
    (dict(dp={"noise_multiplier": float("nan")}), "JSON"),
    (dict(round=-1), "round"),
])
def test_invalid_entries_rejected(tmp_path, key, over, msg):
    path = tmp_path / "x.jsonl"
    led = Ledger(path, key)
    with pytest.raises(LedgerError, match=msg):
        led.append(**_fields(0, **over))
    assert not path.exists() or path.stat().st_size == 0  # nothing written


def test_rejected_verdict_is_recorded(tmp_path, key):
    led = Ledger(tmp_path / "x.jsonl", key)
    e = led.append(**_fields(0, verdict="rejected: shape (32, 128) not in spec"))
    assert e["verdict"].startswith("rejected: ")


def test_key_file_mode_and_no_overwrite(tmp_path):
    p = tmp_path / "k.pem"
    k1 = generate_signing_key(p)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    pem = p.read_bytes()
    with pytest.raises(FileExistsError):
        generate_signing_key(p)
    assert p.read_bytes() == pem
    assert public_key_hex(load_signing_key(p)) == public_key_hex(k1)
    k2 = generate_signing_key(p, force=True)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert public_key_hex(load_signing_key(p)) == public_key_hex(k2) != public_key_hex(k1)
    os.chmod(p, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        load_signing_key(p)


def test_ledger_accepts_key_path(tmp_path):
    p = tmp_path / "k.pem"
    k = generate_signing_key(p)
    led = Ledger(tmp_path / "l.jsonl", p)
    led.append(**_fields(0))
    assert led.public_key_hex == public_key_hex(k)
    assert verify_ledger(led.path, public_key_hex(k)).ok


def test_a_batch_is_one_group_commit_durable_when_it_ends(tmp_path, key, monkeypatch):
    """Inside ``batch()`` this thread's appends are written at once and fsynced together when the block ends (one
    stage's messages to every party); outside, and from another thread meanwhile, each append is fsynced before it
    returns; ``append_final`` is durable when it returns even inside a batch. The ledger verifies throughout."""
    import threading

    synced = []
    real = os.fsync
    monkeypatch.setattr(ledger_writer.os, "fsync", lambda fd: synced.append(fd) or real(fd))
    led = Ledger(tmp_path / "ledger" / "c.jsonl", key)
    led.append(**_fields(0))  # creates the file (its directory is synced too)
    led.append(**_fields(0, round=99))
    base = len(synced)
    synced.clear()
    assert base >= 1
    with led.batch():
        for i in range(1, 4):
            led.append(**_fields(i))
        assert len(synced) == 0  # written, not yet synced
        assert len(_lines(led.path)) == 5
        other = threading.Thread(target=lambda: led.append(**_fields(9, phase="eval")))
        other.start()
        other.join()
        assert len(synced) == 1  # another thread's append is synced as always
        with led.batch():  # nested: the outer block syncs
            led.append(**_fields(4))
        assert len(synced) == 1
    assert len(synced) == 2  # one fsync for the batch's four entries
    with led.batch():
        pass
    assert len(synced) == 2  # nothing written, nothing to sync
    with pytest.raises(RuntimeError), led.batch():  # a failure inside still syncs what was written
        led.append(**_fields(5))
        raise RuntimeError("boom")
    assert len(synced) == 3
    with led.batch():
        led.append_final("end", **_fields(6))
        assert len(synced) == 4
    assert len(synced) == 4
    assert verify_ledger(led.path, public_key_hex(key)).ok


def test_a_reopen_checks_only_the_entries_after_the_prefix_an_earlier_open_verified(filled, key):
    """A party opens its ledger once per message: the checks per open must not grow with the ledger."""
    path, _ = filled
    assert Ledger(path, key).checked_on_open == 5  # no note yet: every entry
    checked = []
    for i in range(5, 105, 2):
        led = Ledger(path, key)
        checked.append(led.checked_on_open)
        led.append(**_fields(i))
        led.append(**_fields(i + 1))
    assert checked[0] == 0 and set(checked[1:]) == {2}  # 2 new entries per open, at 10 entries as at 100
    led = Ledger(path, key)
    res = verify_ledger(path, key.public_key())
    assert res.ok and res.entries == 105 and led.head() == res.head


def test_a_verified_prefix_changed_afterwards_still_refuses_the_open(filled, key, tmp_path):
    path, _ = filled
    Ledger(path, key)  # writes the note for all 5 entries
    note = ledger_writer.verified_note(path)
    assert note.exists() and stat.S_IMODE(note.stat().st_mode) == 0o600
    lines = _lines(path)
    # a note edited to cover other bytes, its signature kept: ignored, every entry checked
    sig, payload = note.read_bytes().split(b"\n", 1)
    forged = json.loads(payload)
    note.write_bytes(sig + b"\n" + payload.replace(forged["sha256"].encode(), b"0" * 64))
    assert Ledger(path, key).checked_on_open == 5
    # a note signed by another key: ignored
    other = generate_signing_key(tmp_path / "keys" / "other.pem")
    Ledger(tmp_path / "other.jsonl", other).append(**_fields(0))
    Ledger(tmp_path / "other.jsonl", other)
    ledger_writer.verified_note(path).write_bytes(ledger_writer.verified_note(tmp_path / "other.jsonl").read_bytes())
    assert Ledger(path, key).checked_on_open == 5
    # an entry of the verified prefix edited after the note: the prefix no longer hashes to it, the open refuses
    Ledger(path, key)
    assert Ledger(path, key).checked_on_open == 0
    assert '"round":1' in lines[1]
    lines[1] = lines[1].replace('"round":1', '"round":9')
    _write(path, lines)
    with pytest.raises(LedgerError, match="does not verify"):
        Ledger(path, key)
    # the prefix cut off (shorter than the note): every entry checked again
    _write(path, _lines(path)[:1])
    assert Ledger(path, key).checked_on_open == 1
