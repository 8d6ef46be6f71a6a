"""``GuardedTransport.exchange`` and its ``ExchangeMemo``: what the instructions of one exchange share is encoded,
hashed and packed once, and nothing is shared between two exchanges. (The guard's checks: ``test_probe_wire``,
``test_packing``, ``test_coordinator_heads``.)"""

from __future__ import annotations

from test_packing import W, _policy, _round_starts

from distmoe.ledger import Ledger, generate_signing_key
from distmoe.wire import codec, inspect, packing
from distmoe.wire.packing import PACKED
from distmoe.wire.schema import ModelUpdate, SecureInstruction, SftInstruction
from distmoe.wire.server_guard import GuardedTransport, ServerGuard


class Capture(GuardedTransport):
    """Records what each exchange hands to ``_send``: every node's message, packed as the transports pack it."""

    def __init__(self):
        self.exchanges: list[dict] = []

    def node_ids(self):
        return [5, 6, 7]

    def _send(self, out, timeout, memo=None):
        self.exchanges.append({"memo": memo, "out": out,
                               "packed": {n: packing.pack(c, memo) for n, (_, c) in out.items()}})
        return {}


def test_one_exchange_encodes_hashes_and_packs_what_its_instructions_share_once_and_two_exchanges_share_nothing(
        tmp_path, monkeypatch):
    t = Capture()
    t.attach(ServerGuard(Ledger(tmp_path / "c.jsonl", generate_signing_key(tmp_path / "c.key")), "run-1", _policy()))
    encoded = []
    real = codec.encode
    monkeypatch.setattr(codec, "encode", lambda p, memo=None: (encoded.append(type(p).__name__), real(p, memo))[1])
    starts = _round_starts()
    phase = SftInstruction(1, "t", W, "h", 0, None, 0)  # one phase instruction (the weights) for every party
    for _ in range(2):
        t.exchange({n: SecureInstruction(phase, starts[n], "model-update") for n in starts}, ModelUpdate, 1.0,
                   rnd=1, phase="sft")
    assert encoded.count("SftInstruction") == 2 and encoded.count("SecureInstruction") == 6  # once per exchange
    one, two = t.exchanges
    assert one["memo"] is not two["memo"]
    assert one["memo"].made["encode"] == 1 and two["memo"].made["encode"] == 1  # the phase instruction: once each
    for ex in (one, two):
        contents = [c for _, c in ex["out"].values()]
        assert contents[0]["arrays"] is contents[1]["arrays"] is contents[2]["arrays"]
        packs = [p[PACKED]["arrays"].data for p in ex["packed"].values()]
        assert packs[0] is packs[1] is packs[2]  # packed once
        for node, (_, c) in ex["out"].items():  # each node's digest is its own, as made without sharing
            assert inspect.digest(codec.strip_ledger(c)) == inspect.digest(real(SecureInstruction(phase, starts[node],
                                                                                                   "model-update")))
    assert one["out"][5][1]["arrays"] is not two["out"][5][1]["arrays"]  # the next exchange made its own
    assert one["packed"][5][PACKED]["arrays"].data is not two["packed"][5][PACKED]["arrays"].data
