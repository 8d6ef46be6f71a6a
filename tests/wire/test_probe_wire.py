"""The routing probe on the wire: its instruction and plaintext reply round-trip through the codec, the prompts are
bounded, and the run's allow-list admits the probe only when the run probes, through both guards."""

from __future__ import annotations

import json
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


def test_one_probe_for_several_nodes_is_encoded_and_hashed_once(tmp_path, monkeypatch):
    """``exchange`` sends the same instruction object to three nodes: one encoding and one digest, each node's
    message its own dict (its own ledger head) over the same records, each logged with that digest."""
    from distmoe.wire import inspect
    from distmoe.wire.server_guard import GuardedTransport

    guard = ServerGuard(Ledger(tmp_path / "c.jsonl", generate_signing_key(tmp_path / "c.key")), "run-1",
                        _policy(True))
    counts = {"encode": 0, "describe": 0}
    for mod, name in ((codec, "encode"), (inspect, "describe")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: counts.__setitem__(_n, counts[_n] + 1)
                            or _r(*a, **k))

    class Capture(GuardedTransport):
        def node_ids(self):
            return [0, 1, 2]

        def _send(self, out, timeout, memo=None):
            self.sent = out
            return {}

    t = Capture()
    t.attach(guard)
    instr = _instr()
    t.exchange({n: instr for n in (0, 1, 2)}, ProbeReply, 1.0, rnd=4, phase="probe")
    assert counts == {"encode": 1, "describe": 1}
    heads = [codec.ledger_head(c) for _, c in t.sent.values()]
    assert len({id(c) for _, c in t.sent.values()}) == 3 and len(set(heads)) == 3
    contents = [c for _, c in t.sent.values()]
    assert all(c[name] is contents[0][name] for c in contents for name in contents[0] if name != codec.LEDGER_RECORD)
    outs = [e for e in map(json.loads, (tmp_path / "c.jsonl").read_text().splitlines()) if e["direction"] == "out"]
    assert len(outs) == 3 and len({e["sha256"] for e in outs}) == 1
    assert outs[0]["sha256"] == inspect.digest(codec.strip_ledger(contents[0]))


def test_no_reply_says_how_long_was_waited_not_the_whole_timeout(tmp_path):
    """A transport that returns before the round timeout (its nodes left the federation) must not be reported as
    "no reply within <timeout>": the reason says how long the exchange waited, beside the timeout."""
    from distmoe.wire.server_guard import GuardedTransport

    class GoneNodes(GuardedTransport):
        def node_ids(self):
            return [0, 1]

        def _send(self, out, timeout, memo=None):
            return {}  # Flower returned without replies long before the timeout

    t = GoneNodes()
    t.attach(ServerGuard(Ledger(tmp_path / "c.jsonl", generate_signing_key(tmp_path / "c.key")), "run-1",
                         _policy(True)))
    replies, errors = t.exchange({n: _instr() for n in (0, 1)}, ProbeReply, 900.0, rnd=4, phase="probe")
    assert not replies and set(errors) == {0, 1}
    text = str(errors[0])
    assert text.startswith("no reply after 0 s") and "round-timeout 900 s" in text and "within 900" not in text
