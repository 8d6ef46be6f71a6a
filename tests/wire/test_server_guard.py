"""``GuardedTransport.exchange`` and its ``ExchangeMemo``: what the instructions of one exchange share is encoded,
hashed and packed once, and nothing is shared between two exchanges; and when a transport hands the guard each reply
as it arrives (``GuardedTransport._arrived``, what the Flower Grid transport does while it waits for the slowest
party), the ledger gets the same entries, in the nodes' order and only once every reply is in, and a reply that is
not the object checked early is checked again. (The guard's checks: ``test_probe_wire``, ``test_packing``,
``test_coordinator_heads``.)"""

from __future__ import annotations

import json

import numpy as np
from flwr.app import RecordDict
from test_packing import W, _poison, _policy, _round_starts

from distmoe.ledger import Ledger, generate_signing_key
from distmoe.wire import codec, inspect, packing
from distmoe.wire.packing import PACKED
from distmoe.wire.schema import ModelUpdate, ProbeInstruction, ProbeReply, SecureInstruction, SftInstruction
from distmoe.wire.server_guard import GuardedTransport, ServerGuard


class Capture(GuardedTransport):
    """Records what each exchange hands to ``_send``: every node's message, packed as the transports pack it."""

    def __init__(self):
        self.exchanges: list[dict] = []

    def node_ids(self):
        return [5, 6, 7]

    def _send(self, out, timeout, memo=None):
        self.exchanges.append({"memo": memo, "out": out,
                               "packed": {n: packing.pack(c, memo, inline_max=0)  # W is small; packed as a model is
                                          for n, (_, c) in out.items()}})
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


# ------------------------------------------------------------------ replies checked as they arrive
NODES = (0, 1, 2)


def _reply(node: int) -> RecordDict:
    rng = np.random.default_rng(node)
    reply = ProbeReply(f"party-{node}", rng.dirichlet(np.ones(4), 2), np.zeros((2, 5), np.int32))
    return packing.pack(codec.with_ledger_head(codec.encode(reply), 3, f"{node:x}" * 64))


class _Arriving(GuardedTransport):
    """Replies come in the order 2, 1, 0; ``early`` hands the first two to ``_arrived`` before the last one is in;
    ``swap`` replaces node 1's reply with a poisoned one after its early check (a transport bug or a race)."""

    def __init__(self, early: bool, swap: bool = False):
        self.early, self.swap, self.lines_at_arrival = early, swap, []

    def node_ids(self):
        return list(NODES)

    def _send(self, out, timeout, memo=None):
        got = {}
        for node in (2, 1, 0):
            got[node] = _reply(node)
            if self.early and self._arrived is not None and node != 0:
                self._arrived(node, got[node])
                self.lines_at_arrival.append(len(self.guard.ledger.path.read_text().splitlines()))
        if self.swap:
            got[1] = _poison(_reply(1), "probe", "routing", np.nan)
        return got


def _exchange(tmp_path, name: str, transport: _Arriving):
    ledger = Ledger(tmp_path / f"{name}.jsonl", generate_signing_key(tmp_path / f"{name}.key"))
    transport.attach(ServerGuard(ledger, "run-1", _policy()))
    instr = ProbeInstruction(4, "h", ("p",), W)
    replies, errors = transport.exchange(dict.fromkeys(NODES, instr), ProbeReply, 60.0, rnd=4, phase="probe")
    entries = [json.loads(x) for x in ledger.path.read_text().splitlines()]
    return replies, errors, entries


def _facts(entries):
    keep = ("round", "phase", "direction", "payload_type", "keys", "shapes", "bytes", "sha256", "verdict", "peer",
            "anchor")
    return [{k: e.get(k) for k in keep} for e in entries]


def test_replies_checked_as_they_arrive_are_logged_after_all_are_in_in_the_nodes_order(tmp_path):
    early = _Arriving(early=True)
    r_early, err_early, log_early = _exchange(tmp_path, "early", early)
    r_late, err_late, log_late = _exchange(tmp_path, "late", _Arriving(early=False))
    assert not err_early and not err_late and sorted(r_early) == list(NODES)
    assert {n: r.party for n, r in r_early.items()} == {n: r.party for n, r in r_late.items()}
    assert _facts(log_early) == _facts(log_late)  # the same entries, in the same order
    assert [e["peer"] for e in log_early if e["direction"] == "in"] == ["node-0", "node-1", "node-2"]
    outs = sum(e["direction"] == "out" for e in log_early)
    assert early.lines_at_arrival == [outs, outs]  # nothing logged while replies were still awaited


def test_a_reply_swapped_after_its_early_check_is_checked_again_and_refused(tmp_path):
    replies, errors, entries = _exchange(tmp_path, "swap", _Arriving(early=True, swap=True))
    assert sorted(replies) == [0, 2] and list(errors) == [1]
    assert "NaN" in str(errors[1])
    ins = {e["peer"]: e["verdict"] for e in entries if e["direction"] == "in"}
    assert ins["node-1"].startswith("rejected") and ins["node-0"] == ins["node-2"] == "accepted"
