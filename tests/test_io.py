"""distmoe.io: atomic, durable writes; the one implementation every module uses."""

from __future__ import annotations

import json
import math
import os
import stat

import pytest

from distmoe.io import append_durable, sanitize, write_atomic, write_json_atomic, write_text_atomic


def test_write_atomic_replaces_whole_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "sub" / "f.bin"
    write_atomic(path, b"first")
    write_atomic(path, b"second, longer")
    assert path.read_bytes() == b"second, longer"
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.bin"]


def test_write_atomic_sets_the_mode_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        write_atomic(tmp_path / "key", b"secret", mode=0o600)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "key").stat().st_mode) == 0o600


def test_write_atomic_without_replace_refuses_an_existing_file(tmp_path):
    path = tmp_path / "key"
    write_atomic(path, b"one", replace=False)
    with pytest.raises(FileExistsError):
        write_atomic(path, b"two", replace=False)
    assert path.read_bytes() == b"one"
    assert [p.name for p in tmp_path.iterdir()] == ["key"]  # the refused temp file is gone


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "f.txt"
    write_text_atomic(path, "old")

    def broken(fd, data):
        raise OSError("disk full")

    monkeypatch.setattr(os, "write", broken)
    with pytest.raises(OSError, match="disk full"):
        write_text_atomic(path, "new")
    monkeypatch.undo()
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_json_is_sanitized_and_append_is_whole_lines(tmp_path):
    write_json_atomic(tmp_path / "r.json", {"a": math.nan, "b": (1, 2.5), "c": {3: math.inf}})
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": None, "b": [1, 2.5], "c": {"3": None}}
    assert sanitize([float("-inf"), "x"]) == [None, "x"]
    for i in range(3):
        append_durable(tmp_path / "log.jsonl", f'{{"i": {i}}}\n'.encode())
    assert [json.loads(x)["i"] for x in (tmp_path / "log.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_changed_only_skips_identical_bytes_and_writes_any_difference(tmp_path, monkeypatch):
    path = tmp_path / "state"
    assert write_atomic(path, b"abc", mode=0o600, changed_only=True) is True  # absent: written
    fsyncs = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real(fd))[1])
    assert write_atomic(path, b"abc", mode=0o600, changed_only=True) is False and fsyncs == []  # same: no I/O
    assert write_atomic(path, b"abd", mode=0o600, changed_only=True) is True and path.read_bytes() == b"abd"
    os.chmod(path, 0o644)
    assert write_atomic(path, b"abd", mode=0o600, changed_only=True) is True  # same bytes, wrong mode: rewritten
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert write_json_atomic(tmp_path / "j.json", {"a": 1}, changed_only=True) is True
    assert write_json_atomic(tmp_path / "j.json", {"a": 1}, changed_only=True) is False
    assert write_json_atomic(tmp_path / "j.json", {"a": 2}, changed_only=True) is True
    assert json.loads((tmp_path / "j.json").read_text()) == {"a": 2}
