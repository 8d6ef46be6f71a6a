"""Tests of saving and restoring the secure-aggregation state machines (``to_state`` / ``from_state``).

Owns: a multi-round protocol (dropouts, a rejoin) in which every client call and every server call runs
on a state machine freshly restored from its blob, as in Flower deployment where each message gets a
new ClientApp process; that the blobs are deterministic and byte-identical to the in-memory run's;
that restored clients keep every refusal; corruption and mismatch detection; blob sizes.

Must not: touch the network or ``flwr``. Exists because a SuperNode keeps nothing in memory between
messages (``docs/architecture.md`` §1), so a protocol check that does not survive a restore does not exist.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from distmoe.privacy.secagg import (
    BothSharesRequested,
    LocalFederation,
    Phase,
    ProtocolViolation,
    RepeatedRequest,
    RepeatedUnmask,
    SecAggClient,
    SecAggParams,
    SecAggServer,
    StateCorrupt,
    StateMismatch,
    UnmaskRequest,
)
from distmoe.privacy.secagg import state as S

L = 64
N, T = 10, 6
PARAMS = SecAggParams(run_id=b"state-run", threshold=T, bits=32, length=L)


def rng_of(cid: int, seed: int = 0):
    return random.Random(seed * 100_003 + cid).randbytes


def inputs(r: int) -> dict[int, np.ndarray]:
    g = np.random.default_rng(r)
    return {i: g.integers(0, 2**32, L, dtype=np.uint64).astype(np.uint32) for i in range(1, N + 1)}


def expected(xs: dict[int, np.ndarray], ids) -> np.ndarray:
    return (sum(xs[i].astype(np.uint64) for i in ids) % 2**32).astype(np.uint32)


class PersistedFederation:
    """``LocalFederation``'s schedule, but every stage call runs on a client or server restored from its
    blob, and the blob is saved right after the call (before its reply would be sent)."""

    def __init__(self, params: SecAggParams, ids):
        self.params = params
        self.rngs = {i: rng_of(i) for i in ids}  # the byte source is not state (os.urandom in production)
        self.blobs = {i: SecAggClient(params, i, rng=self.rngs[i]).to_state() for i in ids}
        self.server_blob = SecAggServer(params).to_state()
        self.sizes: dict[str, int] = {}

    def call(self, i: int, method: str, *args, **kw):
        c = SecAggClient.from_state(self.params, self.blobs[i], cid=i, rng=self.rngs[i])
        try:
            return getattr(c, method)(*args, **kw)
        finally:
            self.blobs[i] = c.to_state()  # also after an abort: the round stays closed
            self.sizes[f"client after {method}"] = max(self.sizes.get(f"client after {method}", 0),
                                                       len(self.blobs[i]))

    def serve(self, method: str, *args):
        s = SecAggServer.from_state(self.params, self.server_blob)
        out = getattr(s, method)(*args)
        self.server_blob = s.to_state()
        self.sizes[f"server after {method}"] = max(self.sizes.get(f"server after {method}", 0),
                                                   len(self.server_blob))
        return out

    def roster(self) -> tuple[int, ...]:
        return SecAggServer.from_state(self.params, self.server_blob).roster

    def setup(self, first_round: int = 1) -> None:
        adverts = [self.call(i, "advertise") for i in sorted(self.blobs)]
        directory = self.serve("register", adverts)
        keys = []
        for i in self.roster():
            self.call(i, "receive_directory", directory)
            keys.append(self.call(i, "share_keys", first_round))
        self.serve("add_share_keys", keys)

    def round(self, r, xs, *, drop_before_masked=(), drop_before_consistency=(), drop_before_unmask=(), offline=()):
        starts = self.serve("begin_round", r)
        masked, late = [], []
        for i in self.roster():
            if i in offline or i in drop_before_masked:
                continue
            if i in starts:
                masked.append(self.call(i, "masked_input", starts[i], xs[i]))
            else:
                late.append(self.call(i, "share_keys", r + 1))
        self.serve("add_share_keys", late)
        checks = self.serve("receive_masked", r, masked)
        signed = [self.call(i, "consistency", q) for i, q in checks.items()
                  if i not in offline and i not in drop_before_consistency]
        request = self.serve("receive_consistency", r, signed)
        responses = [self.call(i, "unmask", request) for i, _, _ in request.signatures
                     if i not in offline and i not in drop_before_unmask]
        return self.serve("finish", r, responses), request


SCHEDULE = [  # round -> dropouts; client 3 drops after sharing keys for 2, misses 3, rejoins at 4
    (1, {}),
    (2, {"drop_before_masked": {3}}),
    (3, {"drop_before_unmask": {5}}),
    (4, {"drop_before_consistency": {8}}),
    (5, {"drop_before_masked": {7}, "drop_before_unmask": {2}}),
]


@pytest.fixture(scope="module")
def both_runs():
    mem = LocalFederation(PARAMS, range(1, N + 1), rng_for=rng_of)
    mem.setup()
    per = PersistedFederation(PARAMS, range(1, N + 1))
    per.setup()
    log = []
    for r, drops in SCHEDULE:
        xs = inputs(r)
        a = mem.round(r, xs, **drops)
        b, request = per.round(r, xs, **drops)
        log.append((r, xs, a, b, request, dict(per.blobs), {i: c.to_state() for i, c in mem.clients.items()},
                    per.server_blob, mem.server.to_state()))
    return mem, per, log


def test_persisted_run_gives_the_in_memory_sums(both_runs):
    _, per, log = both_runs
    for _r, xs, a, b, _, _, _, _, _ in log:
        assert b.included == a.included and b.dropped == a.dropped and b.responders == a.responders
        np.testing.assert_array_equal(b.total, a.total)
        np.testing.assert_array_equal(b.total, expected(xs, b.included))
    by_round = {r: (b.included, b.dropped) for r, _, _, b, *_ in log}
    assert 3 in by_round[2][1] and 3 not in by_round[3][0] and 3 in by_round[4][0]  # dropout, missed, rejoin
    assert 5 in by_round[3][0] and 2 in by_round[5][0] and 7 in by_round[5][1]
    print("\nstate sizes (bytes, 10 clients, max over the run):",
          ", ".join(f"{k} {v}" for k, v in sorted(per.sizes.items())))


def test_blobs_are_deterministic_and_identical_to_the_in_memory_state(both_runs):
    for *_, per_c, mem_c, per_s, mem_s in both_runs[2]:
        assert per_c == mem_c
        assert per_s == mem_s
    for blob in both_runs[1].blobs.values():
        assert SecAggClient.from_state(PARAMS, blob).to_state() == blob
    srv = both_runs[1].server_blob
    assert SecAggServer.from_state(PARAMS, srv).to_state() == srv


def test_blob_is_canonical_json_without_code_and_sizes_are_small(both_runs):
    _, per, _ = both_runs
    blob = per.blobs[1]
    body = json.loads(blob[S._HEADER:-32])
    assert body["kind"] == "client" and body["cid"] == 1 and blob.startswith(S.MAGIC)
    assert b"\x80\x04" not in blob[:2]  # not a pickle
    assert max(v for k, v in per.sizes.items() if k.startswith("client")) < 6_000
    # the server blob peaks after receive_masked: it then also holds the n(n-1) count shares in transit
    assert max(v for k, v in per.sizes.items() if k.startswith("server")) < 60_000


def test_closed_rounds_keep_no_secrets(both_runs):
    _, per, _ = both_runs
    c = SecAggClient.from_state(PARAMS, per.blobs[1])
    assert c.phase(5) is Phase.DONE and c.phase(6) is Phase.SHARED
    assert c._rounds[5].held == {} and c._rounds[5].s_sk == c._rounds[5].b == b""


def test_restored_client_refuses_repeats_and_remembers_done_rounds(both_runs):
    _, per, log = both_runs
    r, _, _, _, request, blobs, *_ = log[-1]
    c = SecAggClient.from_state(PARAMS, blobs[1], cid=1)
    with pytest.raises(RepeatedUnmask):
        c.unmask(request)
    c = SecAggClient.from_state(PARAMS, blobs[1])
    with pytest.raises(RepeatedRequest):
        c.share_keys(r)  # round r's keys were generated long ago
    with pytest.raises(RepeatedRequest):
        c.share_keys(2)  # an old round
    with pytest.raises(RepeatedRequest):
        c.advertise()
    with pytest.raises(RepeatedRequest):
        c.unmask(UnmaskRequest(1, alive=tuple(range(1, N + 1)), dead=()))  # round 1 is closed


def test_restored_client_refuses_both_shares_and_a_second_masked_input():
    per = PersistedFederation(PARAMS, range(1, N + 1))
    per.setup()
    xs = inputs(1)
    starts = per.serve("begin_round", 1)
    masked = [per.call(i, "masked_input", starts[i], xs[i]) for i in sorted(starts)]
    with pytest.raises(RepeatedRequest):  # a replayed round start must not yield a second masked input
        per.call(1, "masked_input", starts[1], xs[1])
    checks = per.serve("receive_masked", 1, masked)
    request = per.serve("receive_consistency", 1, [per.call(i, "consistency", q) for i, q in checks.items()])
    bad = UnmaskRequest(1, alive=request.alive, dead=(2,), signatures=request.signatures)
    with pytest.raises(BothSharesRequested):
        per.call(1, "unmask", bad)
    with pytest.raises(ProtocolViolation, match="aborted"):  # the abort was saved: the round stays closed
        per.call(1, "unmask", request)
    responses = [per.call(i, "unmask", request) for i in request.alive if i != 1]
    with pytest.raises(RepeatedUnmask):
        per.call(2, "unmask", request)
    res = per.serve("finish", 1, responses)
    np.testing.assert_array_equal(res.total, expected(xs, res.included))


def test_server_restored_mid_round_gives_the_right_sum():
    fed = LocalFederation(PARAMS, range(1, N + 1), rng_for=rng_of)
    fed.setup()
    xs = inputs(7)
    starts = fed.server.begin_round(1)
    masked = [fed.clients[i].masked_input(starts[i], xs[i]) for i in sorted(starts) if i != 4]
    checks = fed.server.receive_masked(1, masked)
    blob = fed.server.to_state()
    fed.server = SecAggServer.from_state(PARAMS, blob)  # restarted before the consistency stage
    request = fed.check(1, checks)
    blob = fed.server.to_state()
    fed.server = None  # the ServerApp restarts
    srv = SecAggServer.from_state(PARAMS, blob)
    responses = [fed.clients[i].unmask(request) for i in request.alive if i != 6]
    res = srv.finish(1, responses)
    assert 4 in res.dropped and 6 not in res.responders
    np.testing.assert_array_equal(res.total, expected(xs, res.included))
    assert srv.has_share_keys(2) == frozenset(request.alive)  # piggybacked keys survived too
    with pytest.raises(RepeatedRequest):
        SecAggServer.from_state(PARAMS, srv.to_state()).finish(1, responses)


def _some_blobs():
    fed = LocalFederation(PARAMS, range(1, N + 1), rng_for=rng_of)
    fed.setup()
    starts = fed.server.begin_round(1)
    fed.clients[1].masked_input(starts[1], inputs(1)[1])
    return fed.clients[1].to_state(), fed.server.to_state()


@pytest.mark.parametrize("who", ["client", "server"])
def test_a_flipped_byte_or_a_torn_blob_is_detected(who):
    blob = _some_blobs()[who == "server"]
    load = (lambda b: SecAggClient.from_state(PARAMS, b)) if who == "client" else \
        (lambda b: SecAggServer.from_state(PARAMS, b))
    load(blob)
    positions = sorted({0, 9, 12, S._HEADER, len(blob) // 2, len(blob) - 33, len(blob) - 1,
                        *random.Random(5).sample(range(len(blob)), 40)})
    for pos in positions:
        for bit in (0x01, 0x80):
            bad = bytearray(blob)
            bad[pos] ^= bit
            with pytest.raises(StateCorrupt):
                load(bytes(bad))
    for bad in (blob[:-1], blob[: len(blob) // 2], blob[:20], b"", blob + b"\x00"):
        with pytest.raises(StateCorrupt):
            load(bad)


def test_structurally_bad_but_checksummed_blob_is_corrupt():
    blob = _some_blobs()[0]
    body = json.loads(blob[S._HEADER:-32])
    body["rounds"][0]["s_sk"] = "not base64!"
    with pytest.raises(StateCorrupt):
        SecAggClient.from_state(PARAMS, S.seal_state(S.KIND_CLIENT, body))
    body = json.loads(blob[S._HEADER:-32])
    body["c_pk"] = body["roster"][1][1]  # a key pair that does not match
    with pytest.raises(StateCorrupt):
        SecAggClient.from_state(PARAMS, S.seal_state(S.KIND_CLIENT, body))


def test_restoring_under_another_run_params_client_or_graph_is_refused():
    cblob, sblob = _some_blobs()
    other_run = SecAggParams(run_id=b"other-run", threshold=T, bits=32, length=L)
    with pytest.raises(StateMismatch, match="another run"):
        SecAggClient.from_state(other_run, cblob)
    with pytest.raises(StateMismatch, match="another run"):
        SecAggServer.from_state(other_run, sblob)
    for p in (SecAggParams(PARAMS.run_id, T + 1, 32, L), SecAggParams(PARAMS.run_id, T, 16, L),
              SecAggParams(PARAMS.run_id, T, 32, L + 1)):
        with pytest.raises(StateMismatch, match="other parameters"):
            SecAggClient.from_state(p, cblob)
        with pytest.raises(StateMismatch, match="other parameters"):
            SecAggServer.from_state(p, sblob)
    with pytest.raises(StateMismatch, match="client 1, restored as client 2"):
        SecAggClient.from_state(PARAMS, cblob, cid=2)
    with pytest.raises(StateMismatch, match="client state expected"):
        SecAggClient.from_state(PARAMS, sblob)
    with pytest.raises(StateMismatch, match="server state expected"):
        SecAggServer.from_state(PARAMS, cblob)

    def ring(cid, roster):  # a different (sparse) graph: 2 neighbours each side
        i, n = roster.index(cid), len(roster)
        return frozenset(roster[(i + d) % n] for d in (-2, -1, 1, 2))

    with pytest.raises(StateMismatch, match="peer graph"):
        SecAggClient.from_state(PARAMS, cblob, peers=ring)
    with pytest.raises(StateMismatch, match="peer graph"):
        SecAggServer.from_state(PARAMS, sblob, peers=ring)


def test_fresh_client_state_round_trips():
    c = SecAggClient(PARAMS, 42)
    blob = c.to_state()
    d = SecAggClient.from_state(PARAMS, blob, cid=42)
    assert d.to_state() == blob and d.roster == ()
    d.advertise()  # nothing was advertised yet
    with pytest.raises(RepeatedRequest):
        SecAggClient.from_state(PARAMS, d.to_state()).advertise()
