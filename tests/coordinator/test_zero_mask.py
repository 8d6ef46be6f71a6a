"""Masks that are not masks: a party whose PRG returns zeros would send its inputs in the
clear under the label "masked". Three parties run in process (``LocalTransport``: the real party code path
with its session, outbound guard and ledger); the PRG is patched to return zeros.

- The PRG's known-answer test at setup catches the zero PRG: every party refuses with the ``secagg`` code
  before any key or masked input leaves.
- With the known-answer test bypassed as well, the masked input is plaintext: its uniformity statistic fails
  and the party refuses to send it (``secagg``); with the session's own check bypassed too, the outbound guard
  blocks it. No masked input is ever accepted into a party ledger.

The audit side (a ledger entry recording a failing statistic exits 1 naming ``mask-uniformity``) is in
``tests/audit/test_audit.py``; honest runs passing the audit with the new check, in ``test_secure_runs.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from distmoe.party import session as party_session
from distmoe.privacy.secagg import primitives, selftest
from distmoe.wire.errors import ErrorCode

PARTIES = ("party-0", "party-1", "party-2")


def _zero_prg(key: bytes, length: int, bits: int) -> np.ndarray:
    return np.zeros(length, primitives.word_dtype(bits))


def _zero_combine(out: np.ndarray, terms, bits: int, *, threads: int = 1) -> np.ndarray:
    """The in-place mask expansion the protocol uses (``combine_masks``) with an all-zero keystream."""
    if terms and terms[0][1] == 0:
        out[:] = 0
    return out


def _patch_zero(monkeypatch) -> None:
    """Both the reference PRG and the fast in-place expansion return zeros (the party's masking path and the
    known-answer test each use one of them)."""
    monkeypatch.setattr(primitives, "prg", _zero_prg)
    monkeypatch.setattr(primitives, "combine_masks", _zero_combine)


def _ledger(run_dir: Path, p: str) -> list[dict]:
    path = run_dir / "work" / p / "ledger" / f"{p}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x]


def _run(make_run, tmp_path):
    coord, _, run_dir, _, _ = make_run(tmp_path, {"schedule.phases": "stats:arith"})
    try:
        coord.run()  # with no party taking part it fails, or completes with the release skipped
    except Exception:  # noqa: BLE001 - either way, what matters is what the parties' ledgers say left
        pass
    return run_dir


def _sent_masked(entries: list[dict]) -> list[dict]:
    return [e for e in entries if e["direction"] == "out" and e["payload_type"].startswith("masked-input:")
            and e["verdict"] == "accepted"]


def _errors(entries: list[dict]) -> list[int]:
    return [e["info"]["code"] for e in entries if e["direction"] == "out" and e["payload_type"] == "error"]


def test_prg_known_answer_holds_for_the_real_prg():
    assert selftest.prg_known_answer() is None


def test_known_answer_catches_a_broken_fast_expansion_alone(monkeypatch):
    """The protocol masks with ``combine_masks``, not ``prg``: a zero fast path with an honest ``prg`` fails too."""
    monkeypatch.setattr(primitives, "combine_masks", _zero_combine)
    assert "masks-64" in selftest.prg_known_answer()


@pytest.mark.integration  # a whole in-process run
def test_zero_prg_fails_the_known_answer_test_at_setup(tmp_path, monkeypatch, make_run):
    _patch_zero(monkeypatch)
    assert "known-answer" in selftest.prg_known_answer()
    run_dir = _run(make_run, tmp_path)
    for p in PARTIES:
        entries = _ledger(run_dir, p)
        assert _errors(entries) == [ErrorCode.SECAGG]
        assert not [e for e in entries if e["direction"] == "out" and e["payload_type"] != "error"]  # no key advert
        assert "PRG known-answer test failed" in (run_dir / "work" / p / "party.log").read_text()


@pytest.mark.integration
@pytest.mark.parametrize("bypass", ["kat", "kat+session"])
def test_zero_masks_past_the_known_answer_test_are_never_sent(tmp_path, monkeypatch, make_run, bypass):
    _patch_zero(monkeypatch)
    monkeypatch.setattr(party_session, "prg_known_answer", lambda: None)
    if bypass == "kat+session":
        monkeypatch.setattr(party_session, "mask_check_failure", lambda facts: None)
    run_dir = _run(make_run, tmp_path)
    want = ErrorCode.SECAGG if bypass == "kat" else ErrorCode.BLOCKED
    for p in PARTIES:
        entries = _ledger(run_dir, p)
        assert not _sent_masked(entries)
        assert ErrorCode(_errors(entries)[-1]) == want
        assert "not uniform" in (run_dir / "work" / p / "party.log").read_text()
