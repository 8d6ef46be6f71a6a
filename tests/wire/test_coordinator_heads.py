"""Every instruction carries the coordinator's ledger head, and the party records it.

The server guard logs an instruction in the coordinator's ledger and attaches the head after that entry;
the party guard (``party_guard.serve``) writes it as the ``anchor`` of its signed "in" entry, with the
digest of the instruction as the coordinator logged it. An instruction without a head is refused before
the party does anything. The audit side is ``tests/audit/test_ledger_checks.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pytest

from distmoe.ledger import Ledger, generate_signing_key
from distmoe.wire import codec
from distmoe.wire.errors import Refused
from distmoe.wire.party_guard import serve
from distmoe.wire.schema import RouterStats, StatsInstruction
from distmoe.wire.server_guard import ServerGuard, build_policy

L, E = 2, 4
TRAINABLE = {"w": (3, 2)}


@dataclass
class _Party:
    """A plaintext-mode party whose answer is fixed router statistics (``party_guard.Party``)."""

    name: str
    ledger: Ledger
    canaries: list[bytes] = field(default_factory=list)
    secure: bool = False
    asked: int = 0

    def answer(self, mtype, instruction):
        self.asked += 1
        return RouterStats(np.ones((L, E), np.float64)), None


def _entries(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture
def wire(tmp_path):
    policy = build_policy(
        secure=False,
        n_parties=2,
        trainable=TRAINABLE,
        layers=L,
        experts=E,
        update_length=8,
        stats_length=8,
        rl_update_length=8,
        tasks=("t",),
        eval_length=8,
    )
    coord = Ledger(tmp_path / "coordinator.jsonl", generate_signing_key(tmp_path / "c.key"))
    guard = ServerGuard(coord, "run-1", policy)
    party = _Party("party-0", Ledger(tmp_path / "party-0.jsonl", generate_signing_key(tmp_path / "p.key")))
    return guard, party


def _instruction(rnd: int) -> StatsInstruction:
    return StatsInstruction(rnd, "t", {"w": np.zeros(TRAINABLE["w"], np.float32)}, "h")


def test_every_instruction_carries_the_coordinator_head_and_the_party_records_it(wire, tmp_path):
    guard, party = wire
    for rnd in (1, 2, 3):
        mtype, content = guard.outbound(0, _instruction(rnd), rnd, "stats")
        assert codec.ledger_head(content) == guard.ledger.head()  # the head after this instruction's entry
        reply = serve(mtype, content, party, "run-1")
        assert codec.ledger_head(reply) == party.ledger.head()
    coord = {e["seq"]: e for e in _entries(tmp_path / "coordinator.jsonl")}
    inbound = [e for e in _entries(tmp_path / "party-0.jsonl") if e["direction"] == "in"]
    assert len(inbound) == 3
    for e in inbound:
        a = e["anchor"]
        assert a["node"] == "coordinator" and coord[a["seq"]]["hash"] == a["hash"]
        ce = coord[a["seq"]]  # the very instruction: same type and digest as the party logged it
        assert (ce["direction"], ce["payload_type"], ce["sha256"], ce["round"]) == (
            "out",
            e["payload_type"],
            e["sha256"],
            e["round"],
        )
        assert not any(k.startswith(codec.LEDGER_RECORD + ".") for k in e["keys"])
    assert [e["anchor"]["seq"] for e in inbound] == sorted(e["anchor"]["seq"] for e in inbound)


def test_an_instruction_without_a_coordinator_head_is_refused_before_any_work(wire, tmp_path):
    """Fail-closed: what the coordinator did not log is not acted on (the audit could not place it)."""
    guard, party = wire
    mtype, content = guard.outbound(0, _instruction(1), 1, "stats")
    with pytest.raises(Refused):
        serve(mtype, codec.strip_ledger(content), party, "run-1")
    assert party.asked == 0
    (inbound, error) = _entries(tmp_path / "party-0.jsonl")
    assert inbound["verdict"].startswith("rejected: no coordinator ledger head") and "anchor" not in inbound
    assert error["payload_type"] == "error"


def test_a_malformed_coordinator_head_is_refused(wire, tmp_path):
    guard, party = wire
    mtype, content = guard.outbound(0, _instruction(1), 1, "stats")
    content = codec.with_ledger_head(codec.strip_ledger(content), 0, "not-a-hash")
    with pytest.raises(Refused):
        serve(mtype, content, party, "run-1")
    assert party.asked == 0
    assert _entries(tmp_path / "party-0.jsonl")[0]["verdict"].startswith("rejected: ledger head")
