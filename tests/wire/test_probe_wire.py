"""The routing probe on the wire: its instruction and plaintext reply round-trip through the codec, the prompts are
bounded, and the run's allow-list admits the probe only when the run probes, through both guards."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, RecordDict

from distmoe.ledger import Ledger, generate_signing_key
from distmoe.wire import codec
from distmoe.wire.at_rest import check_allow_list
from distmoe.wire.codec import WireError
from distmoe.wire.party_guard import serve
from distmoe.wire.schema import ProbeInstruction, ProbeReply
from distmoe.wire.server_guard import ServerGuard, build_policy, check_against_policy

L, E, N = 2, 4, 30
TRAINABLE = {"w": (3, 2)}
PROMPTS = ("Compute\n1+2", "Look up k3")


def _instr(prompts=PROMPTS) -> ProbeInstruction:
    return ProbeInstruction(4, "h", prompts, {"w": np.zeros(TRAINABLE["w"], np.float32)})


def _reply(n=N) -> ProbeReply:
    rng = np.random.default_rng(0)
    return ProbeReply("party-0", rng.dirichlet(np.ones(E), L), rng.integers(0, E, (L, n)).astype(np.int32))


def _policy(secure: bool, prompts=PROMPTS):
    return build_policy(secure=secure, n_parties=3, trainable=TRAINABLE, layers=L, experts=E, update_length=8,
                        stats_length=8, rl_update_length=8, tasks=("t",), eval_length=8, probe_prompts=prompts,
                        probe_tokens=len(prompts) * 64)


def test_probe_payloads_round_trip():
    back = codec.decode(codec.encode(_instr()), ProbeInstruction)
    assert back.prompts == PROMPTS and back.round == 4 and codec.message_type_of(back) == "query.probe"
    r = _reply()
    got = codec.decode(codec.encode(r), ProbeReply)
    np.testing.assert_array_equal(got.routing, r.routing)
    np.testing.assert_array_equal(got.top1, r.top1)
    assert got.top1.dtype == np.int32 and got.routing.dtype == np.float64


@pytest.mark.parametrize("prompts", [(), ("x" * 2001,), tuple(f"p{i}" for i in range(257)), ("",)])
def test_prompts_are_bounded(prompts):
    with pytest.raises(WireError, match="prompts must be"):
        codec.encode(_instr(prompts))


@pytest.mark.parametrize("secure", [True, False])
def test_the_allow_list_admits_the_probe_only_when_the_run_probes(secure):
    pol = _policy(secure)
    assert check_allow_list(pol) == []
    reply = codec.encode(_reply())
    from distmoe.wire import inspect

    assert check_against_policy(pol, "probe-reply", inspect.describe(reply)) is None
    assert check_against_policy(pol, "probe-instruction", inspect.describe(codec.encode(_instr()))) is None
    off = _policy(secure, prompts=())
    assert "probe-reply" not in off and "probe-instruction" not in off
    assert "not on the run's allow-list" in check_against_policy(off, "probe-reply", inspect.describe(reply))
    wrong = codec.encode(ProbeReply("party-0", np.ones((L, E + 1)) / (E + 1), _reply().top1))
    assert "shape" in check_against_policy(pol, "probe-reply", inspect.describe(wrong))


@dataclass
class _Party:
    name: str
    ledger: Ledger
    canaries: list[bytes] = field(default_factory=list)
    secure: bool = True
    reply: object = None

    def answer(self, mtype, instruction):
        assert isinstance(instruction, ProbeInstruction) and instruction.prompts == PROMPTS
        return self.reply, None


def test_a_probe_exchange_through_both_guards(tmp_path):
    guard = ServerGuard(Ledger(tmp_path / "c.jsonl", generate_signing_key(tmp_path / "c.key")), "run-1",
                        _policy(True))
    party = _Party("party-0", Ledger(tmp_path / "p.jsonl", generate_signing_key(tmp_path / "p.key")), reply=_reply())
    mtype, content = guard.outbound(0, _instr(), 4, "probe")
    assert mtype == "query.probe"
    back = guard.inbound(0, serve(mtype, content, party, "run-1"), ProbeReply, 4, "probe")
    np.testing.assert_array_equal(back.top1, party.reply.top1)
    # an extra record (say, a party's hidden states) never passes the party's guard or the server's
    rd = codec.encode(_reply())
    smuggled = RecordDict({**dict(rd.items()), "hidden": ArrayRecord(array_dict={"x": Array(np.ones(3))})})
    with pytest.raises(WireError):
        codec.decode(smuggled, ProbeReply)
    with pytest.raises(WireError, match="rejected by the server guard"):
        guard.inbound(0, codec.with_ledger_head(smuggled, 1, "0" * 64), ProbeReply, 4, "probe")
