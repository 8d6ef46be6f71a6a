"""Tests of the secure aggregation (``distmoe.privacy.secagg``).

Owns: end-to-end sums with and without dropouts at every stage, threshold aborts on both sides, the
client abort matrix (modelled on Google FCP's unmasking-state tests), statistical uniformity of a
masked vector, AEAD tamper detection, mask cancellation, key reuse across rounds, Shamir's threshold
property and the no-wrap bit-width check.

Must not: touch the network or ``flwr``; every test is in process and takes well under a second.
The protocol is hand-written on ``cryptography`` instead of Flower's SecAgg+ (``docs/privacy.md`` §9),
so these tests are what stands between it and a silent privacy failure.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest
from scipy import stats

from distmoe.privacy import ring
from distmoe.privacy.secagg import (
    AlreadyDead,
    BelowThreshold,
    BothSharesRequested,
    DuplicateClient,
    InconsistentLists,
    InsecureThreshold,
    KeyDirectory,
    KeySubstitution,
    ListedAsDead,
    LocalFederation,
    PreMask,
    ProtocolViolation,
    ReconstructionFailed,
    RepeatedRequest,
    RepeatedUnmask,
    RoundStart,
    SecAggParams,
    TamperedShare,
    TooFewSurvivors,
    UnknownClient,
    UnmaskRequest,
    UnmaskResponse,
    shamir,
)
from distmoe.privacy.secagg import primitives as P

L = 512


def seeded(seed: int):
    """Per-client deterministic byte sources (tests only; production uses os.urandom)."""
    return lambda cid: random.Random(seed * 100_003 + cid).randbytes


def fed_of(n: int, t: int, *, bits: int = 32, length: int = L, seed: int | None = 0, peers=None, **setup):
    params = SecAggParams(run_id=b"test-run", threshold=t, bits=bits, length=length)
    kw = {"peers": peers} if peers else {}
    fed = LocalFederation(params, range(1, n + 1), rng_for=seeded(seed) if seed is not None else None, **kw)
    fed.setup(**setup)
    return fed


def rand_inputs(n: int, bits: int, length: int = L, seed: int = 1) -> dict[int, np.ndarray]:
    g = np.random.default_rng(seed)
    return {i: g.integers(0, 2**bits, length, dtype=np.uint64).astype(P.word_dtype(bits)) if bits < 64
            else g.integers(0, 2**64, length, dtype=np.uint64) for i in range(1, n + 1)}


def expected(xs: dict[int, np.ndarray], ids, bits: int) -> np.ndarray:
    total = np.zeros(next(iter(xs.values())).shape, dtype=np.uint64)
    for i in ids:
        total += xs[i].astype(np.uint64)  # wraps mod 2^64, a multiple of 2^bits
    return total & np.uint64((1 << bits) - 1)


def masked_stage(fed: LocalFederation, r: int, xs, skip=()):
    """Exchanges 1 (masked input) and 2 (consistency check) by hand: returns (starts, masked inputs by
    sender, unmask request)."""
    starts = fed.server.begin_round(r)
    masked = {i: fed.clients[i].masked_input(s, xs[i]) for i, s in starts.items() if i not in skip}
    return starts, masked, fed.check(r, fed.server.receive_masked(r, masked.values()))


# ---- exact sums -------------------------------------------------------------------------------

@pytest.mark.parametrize("n,t", [(3, 2), (5, 3), (10, 6)])
def test_exact_sum_without_dropouts(n, t):
    fed = fed_of(n, t, seed=None)  # real os.urandom
    for r in (1, 2):
        xs = rand_inputs(n, 32, seed=r)
        res = fed.round(r, xs)
        assert res.included == tuple(range(1, n + 1)) and res.dropped == ()
        np.testing.assert_array_equal(res.total, expected(xs, range(1, n + 1), 32))
    assert fed.exchanges == 2 + 3 * 2  # setup twice, then three exchanges per round


@pytest.mark.parametrize("bits", [1, 12, 33, 64])
def test_exact_sum_other_bit_widths(bits):
    xs = rand_inputs(4, bits)
    res = fed_of(4, 3, bits=bits).round(1, xs)
    assert res.total.dtype == (np.uint32 if bits <= 32 else np.uint64)
    np.testing.assert_array_equal(res.total.astype(np.uint64), expected(xs, range(1, 5), bits))


def test_real_valued_inputs_through_the_ring_codec():
    n, scale, bound = 6, 2.0**16, 3.0
    assert ring.check_fits_ring64(n * (bound * scale + 0.5)) == 22  # |sum| <= 6 * (3 * 2^16 + 1/2) < 2^21
    g = np.random.default_rng(7)
    reals = {i: g.uniform(-bound, bound, L) for i in range(1, n + 1)}
    fed = fed_of(n, 4, bits=64)
    res = fed.round(1, {i: ring.encode_fixed(x, scale) for i, x in reals.items()})
    got = ring.decode_fixed(res.total, scale)
    truth = sum(reals.values())
    assert np.abs(got - truth).max() <= n / (2 * scale)
    assert (got < 0).any() and (got > 0).any()  # negative sums decode too


@pytest.mark.parametrize("drop", [False, True])
def test_a_round_declares_its_own_ring_width(drop):
    """A 64-bit run carries a 32-bit release: the round start declares the width, the inputs and
    the sum are uint32 words, and the server's unmask of a dropped party's masks happens in that width; the
    next round in the same run goes back to 64 bits."""
    n, scale = 5, 2.0**20
    fed = fed_of(n, 3, bits=64)
    g = np.random.default_rng(3)
    reals = {i: g.uniform(-100.0, 100.0, L) for i in range(1, n + 1)}
    words = {i: ring.encode_fixed(x, scale, 32, np.random.default_rng(i)) for i, x in reals.items()}
    res = fed.round(1, words, bits=32, drop_before_masked=(2,) if drop else ())
    assert res.total.dtype == np.uint32
    ids = [i for i in range(1, n + 1) if not (drop and i == 2)]
    got = ring.decode_fixed(res.total, scale)
    assert np.abs(got - sum(reals[i] for i in ids)).max() <= len(ids) / scale
    xs = rand_inputs(n, 64, seed=9)
    res = fed.round(2, xs)
    assert res.total.dtype == np.uint64
    np.testing.assert_array_equal(res.total, expected(xs, res.included, 64))  # 2 rejoins only at round 3


def test_ring_width_is_checked_on_both_sides():
    fed = fed_of(3, 2, bits=32)
    with pytest.raises(ValueError, match="bits 64 outside"):
        fed.server.begin_round(1, None, 64)  # wider than the run's params
    starts = fed.server.begin_round(1, None, 16)
    assert all(s.bits == 16 for s in starts.values())
    with pytest.raises(ValueError, match=r"outside \[0, 2\^16\)"):  # a value the declared ring cannot hold
        fed.clients[1].masked_input(starts[1], np.full(L, 1 << 16, np.uint32))
    forged = dataclasses.replace(starts[2], bits=33)
    with pytest.raises(ProtocolViolation, match="ring width 33"):
        fed.clients[2].masked_input(forged, np.zeros(L, np.uint32))


def test_server_state_keeps_the_round_width():
    from distmoe.privacy.secagg import SecAggServer

    fed = fed_of(3, 2, bits=64)
    starts = fed.server.begin_round(1, None, 32)
    xs = {i: np.full(L, i, np.uint32) for i in starts}
    masked = [fed.clients[i].masked_input(s, xs[i]) for i, s in starts.items()]
    checks = fed.server.receive_masked(1, masked)
    fed.server = SecAggServer.from_state(fed.params, fed.server.to_state())
    request = fed.check(1, checks)
    res = fed.server.finish(1, [fed.clients[i].unmask(request) for i, _, _ in request.signatures])
    assert res.total.dtype == np.uint32 and (res.total == 6).all()


# ---- dropouts -------------------------------------------------------------------------------

def test_dropout_before_share_keys():
    xs = rand_inputs(5, 32)
    fed = fed_of(5, 3, skip_share_keys={2})
    res = fed.round(1, xs)
    assert res.included == (1, 3, 4, 5) and res.dropped == ()
    np.testing.assert_array_equal(res.total, expected(xs, (1, 3, 4, 5), 32))


def test_dropout_after_share_keys_before_masked_input():
    xs = rand_inputs(5, 32)
    fed = fed_of(5, 3)
    res = fed.round(1, xs, drop_before_masked={4})
    assert res.included == (1, 2, 3, 5) and res.dropped == (4,)  # its pairwise masks rebuilt from s shares
    np.testing.assert_array_equal(res.total, expected(xs, (1, 2, 3, 5), 32))


def test_dropout_after_masked_input_before_unmask():
    xs = rand_inputs(5, 32)
    fed = fed_of(5, 3)
    res = fed.round(1, xs, drop_before_unmask={1, 5})
    assert res.included == (1, 2, 3, 4, 5) and res.responders == (2, 3, 4)  # their b from peers' shares
    np.testing.assert_array_equal(res.total, expected(xs, range(1, 6), 32))


def test_mixed_dropouts_over_rounds_and_rejoin():
    n, t = 7, 4
    fed = fed_of(n, t, skip_share_keys={7})
    xs = rand_inputs(n, 32)
    res = fed.round(1, xs, drop_before_masked={6}, drop_before_unmask={5})
    assert res.included == (1, 2, 3, 4, 5) and res.dropped == (6,) and len(res.responders) == 4
    np.testing.assert_array_equal(res.total, expected(xs, (1, 2, 3, 4, 5), 32))
    # round 2: 6 sent no masked input (so no piggybacked keys) -> outside U1; 7 answered exchange 1 of
    # round 1 with its round-2 keys -> back in; 5 piggybacked round-2 keys with its masked input
    res = fed.round(2, xs)
    assert res.included == (1, 2, 3, 4, 5, 7)
    np.testing.assert_array_equal(res.total, expected(xs, (1, 2, 3, 4, 5, 7), 32))
    res = fed.round(3, xs, offline={2})  # 2 was in U1 via piggyback: dropped after share keys
    assert res.included == (1, 3, 4, 5, 6, 7) and res.dropped == (2,)
    np.testing.assert_array_equal(res.total, expected(xs, (1, 3, 4, 5, 6, 7), 32))
    assert fed.exchanges == 2 + 3 * 3  # dropouts never add an exchange


def test_sparse_peer_graph_is_a_parameter():
    def ring(cid, roster):  # k = 2 neighbours on each side of the sorted roster (test graph only)
        i, n = roster.index(cid), len(roster)
        return frozenset(roster[(i + d) % n] for d in (-2, -1, 1, 2))

    xs = rand_inputs(8, 32)
    fed = fed_of(8, 3, peers=ring)
    res = fed.round(1, xs, drop_before_masked={3})
    np.testing.assert_array_equal(res.total, expected(xs, (1, 2, 4, 5, 6, 7, 8), 32))
    roster = tuple(range(1, 9))
    starts = fed.server.begin_round(2)  # 3 is outside U1 of round 2 (it sent no masked input in round 1)
    assert sorted(starts) == [1, 2, 4, 5, 6, 7, 8]
    for u, s in starts.items():  # shares only from the ring neighbours
        assert {e.sender for e in s.shares} == ring(u, roster) - {3}


def test_server_rejects_malformed_masked_input_as_dropout():
    xs = rand_inputs(4, 32)
    fed = fed_of(4, 3)
    starts = fed.server.begin_round(1)
    masked = [fed.clients[i].masked_input(starts[i], xs[i]) for i in (1, 2, 3)]
    bad = fed.clients[4].masked_input(starts[4], xs[4])
    bad = dataclasses.replace(bad, y=bad.y[:-1])
    req = fed.check(1, fed.server.receive_masked(1, [*masked, bad]))
    assert req.alive == (1, 2, 3) and req.dead == (4,) and "shape" in fed.server.rejected[(1, 4)]
    res = fed.server.finish(1, [fed.clients[i].unmask(req) for i in req.alive])
    np.testing.assert_array_equal(res.total, expected(xs, (1, 2, 3), 32))


# ---- threshold aborts, server side ----------------------------------------------------------

def test_below_threshold_at_setup():
    params = SecAggParams(run_id=b"r", threshold=3, bits=32, length=L)
    fed = LocalFederation(params, [1, 2, 3, 4])
    with pytest.raises(BelowThreshold, match="setup: 2 clients .* below threshold t = 3"):
        fed.setup(absent={3, 4})


def test_below_threshold_at_share_keys():
    fed = fed_of(5, 3, skip_share_keys={1, 2, 3})
    with pytest.raises(BelowThreshold, match="round 1, share keys: 2 .* below threshold t = 3"):
        fed.server.begin_round(1)


def test_below_threshold_at_masked_input():
    fed = fed_of(5, 3)
    with pytest.raises(BelowThreshold, match="round 1, masked input: 2 .* below threshold t = 3"):
        fed.round(1, rand_inputs(5, 32), drop_before_masked={1, 2, 3})


def test_below_threshold_at_unmask():
    fed = fed_of(5, 3)
    with pytest.raises(BelowThreshold, match="round 1, unmask: 2 .* below threshold t = 3"):
        fed.round(1, rand_inputs(5, 32), drop_before_unmask={1, 2, 3})


def test_threshold_not_above_half_is_refused():
    params = SecAggParams(run_id=b"r", threshold=2, bits=32, length=L)
    with pytest.raises(InsecureThreshold):
        LocalFederation(params, [1, 2, 3, 4]).setup()


# ---- the client abort matrix ----------------------------------------------------------------

@pytest.fixture
def at_unmask():
    """5 clients (t = 3), all sent masked inputs in round 1; returns (fed, honest request)."""
    fed = fed_of(5, 3)
    _, _, req = masked_stage(fed, 1, rand_inputs(5, 32))
    return fed, req


def test_unmask_sends_exactly_one_share_type_per_peer():
    fed = fed_of(5, 3, skip_share_keys={5})
    _, _, req = masked_stage(fed, 1, rand_inputs(5, 32), skip={4})
    assert req.alive == (1, 2, 3) and req.dead == (4,)
    resp = fed.clients[1].unmask(req)
    assert [o for o, _ in resp.b_shares] == [1, 2, 3]  # survivors: self-mask shares
    assert [o for o, _ in resp.s_shares] == [4]  # dropped after share keys: mask-key share
    # client 5 never shared keys: nothing about it is revealed


def test_abort_fewer_than_t_survivors(at_unmask):
    fed, _ = at_unmask
    with pytest.raises(TooFewSurvivors, match="below threshold t = 3"):
        fed.clients[1].unmask(UnmaskRequest(1, alive=(1, 2), dead=(3, 4, 5)))


def test_abort_when_listed_as_dead(at_unmask):
    fed, _ = at_unmask
    with pytest.raises(ListedAsDead, match="client 1"):
        fed.clients[1].unmask(UnmaskRequest(1, alive=(2, 3, 4, 5), dead=(1,)))


def test_abort_on_nonexistent_client(at_unmask):
    fed, _ = at_unmask
    with pytest.raises(UnknownClient, match=r"\[99\]"):
        fed.clients[1].unmask(UnmaskRequest(1, alive=(1, 2, 3, 4), dead=(5, 99)))


def test_abort_on_client_that_was_already_dead():
    fed = fed_of(5, 3, skip_share_keys={5})  # 5 never shared keys for round 1
    _, _, _ = masked_stage(fed, 1, rand_inputs(5, 32))
    with pytest.raises(AlreadyDead, match=r"\[5\]"):
        fed.clients[1].unmask(UnmaskRequest(1, alive=(1, 2, 3), dead=(4, 5)))


def test_abort_on_inconsistent_lists(at_unmask):
    fed, _ = at_unmask
    with pytest.raises(InconsistentLists, match=r"\[4, 5\] are neither alive nor dead"):
        fed.clients[1].unmask(UnmaskRequest(1, alive=(1, 2, 3), dead=()))


def test_abort_on_same_client_twice(at_unmask):
    fed, _ = at_unmask
    with pytest.raises(DuplicateClient, match="client 3 appears twice"):
        fed.clients[1].unmask(UnmaskRequest(1, alive=(1, 2, 3, 3, 4), dead=(5,)))


def test_abort_when_asked_for_both_shares_of_a_peer(at_unmask):
    fed, _ = at_unmask
    with pytest.raises(BothSharesRequested, match=r"\[4\]"):
        fed.clients[1].unmask(UnmaskRequest(1, alive=(1, 2, 3, 4, 5), dead=(4,)))


def test_abort_on_second_unmask_request(at_unmask):
    fed, req = at_unmask
    fed.clients[1].unmask(req)
    with pytest.raises(RepeatedUnmask):
        fed.clients[1].unmask(UnmaskRequest(1, alive=(1, 2, 3, 4), dead=(5,)))


def test_after_an_abort_the_round_is_closed(at_unmask):
    fed, req = at_unmask
    with pytest.raises(BothSharesRequested):
        fed.clients[2].unmask(UnmaskRequest(1, alive=(1, 2, 3, 4, 5), dead=(3,)))
    with pytest.raises(ProtocolViolation, match="aborted"):
        fed.clients[2].unmask(req)  # a corrected retry is not answered either


def test_abort_on_second_masked_input_request():
    fed = fed_of(4, 3)
    starts = fed.server.begin_round(1)
    x = rand_inputs(4, 32)[1]
    fed.clients[1].masked_input(starts[1], x)
    with pytest.raises(RepeatedRequest):
        fed.clients[1].masked_input(starts[1], x + 1)  # y1 - y2 would be x1 - x2


def test_abort_on_too_few_participants_at_round_start():
    fed = fed_of(5, 3)
    s = fed.server.begin_round(1)[1]
    cut = RoundStart(1, 1, s.participants[:2], tuple(e for e in s.shares if e.sender <= 2))
    with pytest.raises(TooFewSurvivors):
        fed.clients[1].masked_input(cut, rand_inputs(5, 32)[1])


def test_abort_when_directory_substitutes_own_key():
    params = SecAggParams(run_id=b"r", threshold=3, bits=32, length=L)
    fed = LocalFederation(params, [1, 2, 3, 4])
    ads = [c.advertise() for c in fed.clients.values()]
    d = fed.server.register(ads)
    forged = KeyDirectory(d.run_id, tuple((i, P.new_keypair(random.Random(i).randbytes)[1]) if i == 2 else (i, k)
                                          for i, k in d.keys), d.sig_keys)
    with pytest.raises(KeySubstitution):
        fed.clients[2].receive_directory(forged)


# ---- tampering ------------------------------------------------------------------------------

def _flip(b: bytes, i: int = 5) -> bytes:
    return b[:i] + bytes([b[i] ^ 1]) + b[i + 1:]


def test_tampered_encrypted_share_names_the_sender():
    fed = fed_of(5, 3)
    s = fed.server.begin_round(1)[1]
    shares = tuple(dataclasses.replace(e, ciphertext=_flip(e.ciphertext)) if e.sender == 3 else e for e in s.shares)
    with pytest.raises(TamperedShare, match="from client 3") as ei:
        fed.clients[1].masked_input(dataclasses.replace(s, shares=shares), rand_inputs(5, 32)[1])
    assert ei.value.sender == 3 and ei.value.round == 1


def test_swapped_mask_key_breaks_the_share_tag():
    fed = fed_of(5, 3)
    s = fed.server.begin_round(1)[1]
    evil_pk = P.new_keypair(random.Random(0).randbytes)[1]
    parts = tuple((v, evil_pk if v == 4 else pk) for v, pk in s.participants)
    with pytest.raises(TamperedShare, match="from client 4"):
        fed.clients[1].masked_input(dataclasses.replace(s, participants=parts), rand_inputs(5, 32)[1])


def test_corrupt_unmask_share_fails_reconstruction(at_unmask):
    fed, req = at_unmask
    resp = [fed.clients[i].unmask(req) for i in req.alive]
    first = resp[0]
    bad = UnmaskResponse(first.sender, 1, tuple((o, shamir.encode_share((shamir.decode_share(s) + 1) % shamir.PRIME))
                                                for o, s in first.b_shares), first.s_shares)
    with pytest.raises(ReconstructionFailed):
        fed.server.finish(1, [bad, *resp[1:]])


# ---- masks ----------------------------------------------------------------------------------

def _chi2_p(values: np.ndarray, buckets: int) -> float:
    counts = np.bincount(values, minlength=buckets)
    return stats.chisquare(counts).pvalue


@pytest.mark.parametrize("const", [0, 2**31])
def test_masked_vector_is_uniform_and_fresh_each_round(const):
    n, length = 4, 1 << 16
    fed = fed_of(n, 3, length=length)
    x = {i: np.full(length, const, dtype=np.uint32) for i in range(1, n + 1)}
    _, m1, req = masked_stage(fed, 1, x)
    y = m1[1].y
    assert _chi2_p(np.frombuffer(y.tobytes(), dtype=np.uint8), 256) > 1e-4  # all bytes
    assert _chi2_p((y >> 24).astype(np.int64), 256) > 1e-4  # top byte of each value
    fed.server.finish(1, [fed.clients[i].unmask(req) for i in req.alive])
    _, m2, _ = masked_stage(fed, 2, x)
    assert np.mean(m2[1].y == y) < 1e-3  # same input, new masks


def test_masked_vector_uniform_for_narrow_ring():
    fed = fed_of(4, 3, bits=12, length=1 << 15)
    x = {i: np.full(1 << 15, 7, dtype=np.uint32) for i in range(1, 5)}
    _, m, _ = masked_stage(fed, 1, x)
    assert int(m[2].y.max()) < 4096
    assert _chi2_p((m[2].y >> 6).astype(np.int64), 64) > 1e-4


def test_prg_is_deterministic_key_sensitive_and_uniform():
    key = bytes(range(32))
    a, b = P.prg(key, 4096, 32), P.prg(key, 4096, 32)
    np.testing.assert_array_equal(a, b)
    c = P.prg(_flip(key, 0), 4096, 32)
    diff_bits = np.unpackbits(np.frombuffer((a ^ c).tobytes(), dtype=np.uint8)).mean()
    assert 0.48 < diff_bits < 0.52
    assert _chi2_p(P.prg(key, 1 << 14, 5).astype(np.int64), 32) > 1e-4


def test_key_derivations_bind_every_input():
    rng = random.Random(9).randbytes
    (sk_u, pk_u), (sk_v, pk_v) = P.new_keypair(rng), P.new_keypair(rng)
    b = rng(32)
    base = P.self_mask_key(b"run", 3, 7, b)
    assert len({base, *(P.self_mask_key(b"run", 3, 7, _flip(b, i)) for i in range(32))}) == 33  # all 256 bits count
    assert base not in (P.self_mask_key(b"run2", 3, 7, b), P.self_mask_key(b"run", 4, 7, b),
                        P.self_mask_key(b"run", 3, 8, b))
    pair = P.pair_mask_key(b"run", 3, 1, 2, sk_u, pk_v)
    assert pair == P.pair_mask_key(b"run", 3, 2, 1, sk_v, pk_u)  # both ends agree
    assert pair not in (P.pair_mask_key(b"run", 4, 1, 2, sk_u, pk_v), P.pair_mask_key(b"run2", 3, 1, 2, sk_u, pk_v),
                        P.pair_mask_key(b"run", 3, 1, 5, sk_u, pk_v))  # fresh per round, run and pair
    fwd = P.share_key(b"run", 3, 1, 2, sk_u, pk_v)
    assert fwd != P.share_key(b"run", 3, 2, 1, sk_v, pk_u)  # direction-bound
    assert fwd != P.share_key(b"run", 4, 1, 2, sk_u, pk_v)


def test_pairwise_masks_cancel():
    n, t = 5, 3
    fed = fed_of(n, t)
    xs = rand_inputs(n, 32)
    _, masked, req = masked_stage(fed, 1, xs)
    resps = [fed.clients[i].unmask(req) for i in req.alive]
    total = np.zeros(L, dtype=np.uint32)
    for i in range(1, n + 1):
        pts = {shamir.holder_x(r.sender): shamir.decode_share(dict(r.b_shares)[i]) for r in resps}
        b = shamir.reconstruct(pts, t)
        total += masked[i].y - P.prg(P.self_mask_key(b"test-run", 1, i, b), L, 32)
    np.testing.assert_array_equal(total, expected(xs, range(1, n + 1), 32))


def test_keys_advertised_once_and_reused_across_rounds():
    fed = fed_of(4, 3)
    with pytest.raises(RepeatedRequest):
        fed.clients[1].advertise()
    x = {i: np.full(L, 5, dtype=np.uint32) for i in range(1, 5)}
    ys = []
    for r in (1, 2):
        _, masked, req = masked_stage(fed, r, x)
        ys.append(masked[1].y.copy())
        res = fed.server.finish(r, [fed.clients[i].unmask(req) for i in req.alive])
        np.testing.assert_array_equal(res.total, np.full(L, 20))
    assert fed.exchanges == 2  # only the setup exchanges were counted: keys went out once
    assert not np.array_equal(ys[0], ys[1])


def test_fixed_rng_reproduces_masked_vectors():
    xs = rand_inputs(3, 32)
    runs = []
    for _ in range(2):
        fed = fed_of(3, 2, seed=42)
        runs.append(masked_stage(fed, 1, xs)[1][2].y)
    np.testing.assert_array_equal(*runs)


def test_replayed_round_start_is_refused():
    fed = fed_of(4, 3)
    xs = rand_inputs(4, 32)
    starts = fed.server.begin_round(1)
    ms = [fed.clients[i].masked_input(starts[i], xs[i]) for i in starts]
    req = fed.check(1, fed.server.receive_masked(1, ms))
    fed.server.finish(1, [fed.clients[i].unmask(req) for i in req.alive])
    with pytest.raises(RepeatedRequest):
        fed.clients[1].masked_input(starts[1], xs[1])


# ---- Shamir ---------------------------------------------------------------------------------

def test_shamir_any_t_of_n_reconstruct():
    rng = random.Random(3).randbytes
    secret = rng(32)
    shares = shamir.split(secret, [2, 3, 5, 8, 13], 3, rng)
    for subset in itertools.combinations(shares, 3):
        assert shamir.reconstruct({x: shares[x] for x in subset}, 3) == secret
    assert shamir.reconstruct(shares, 3) == secret


def test_shamir_fewer_than_t_shares_reveal_nothing():
    rng = random.Random(4).randbytes
    secret, other = rng(32), rng(32)
    shares = shamir.split(secret, [1, 2, 3, 4, 5], 3, rng)
    two = [(1, shares[1]), (2, shares[2])]
    assert shamir.reconstruct_int(dict(two), 2) != int.from_bytes(secret, "big")
    # every candidate secret is consistent with the two shares: a degree-2 polynomial through
    # (0, candidate) and the two shares exists, and its own third share reconstructs the candidate
    for cand in (secret, other):
        pts = [(0, int.from_bytes(cand, "big")), *two]
        third = shamir.interpolate(pts, 3)
        assert shamir.reconstruct({1: shares[1], 2: shares[2], 3: third}, 3) == cand


def test_shamir_shares_differ_between_secrets_and_sharings():
    rng = random.Random(5).randbytes
    a, b = rng(32), rng(32)
    xs = [1, 2, 3]
    sa, sb, sa2 = shamir.split(a, xs, 2, rng), shamir.split(b, xs, 2, rng), shamir.split(a, xs, 2, rng)
    assert all(sa[x] != sb[x] for x in xs) and all(sa[x] != sa2[x] for x in xs)
    with pytest.raises(ValueError):
        shamir.split(a, [0, 1, 2], 2, rng)  # x = 0 would be the secret itself


# ---- encoding and wrap-around ---------------------------------------------------------------

def test_the_no_wrap_boundary_holds_through_the_protocol():
    """Two inputs whose sum is 2^63 - 1 (the largest that ``ring.check_fits_ring64`` admits) decode exactly
    through a real round; one more unit (2^63, refused by the check) wraps to -2^63."""
    half = 2**62
    for top, ok in ((half - 1, True), (half, False)):
        xs = {1: ring.to_ring64(np.full(4, top)), 2: ring.to_ring64(np.full(4, half)),
              3: ring.to_ring64(np.zeros(4, np.int64))}
        got = ring.from_ring64(fed_of(3, 2, bits=64, length=4).round(1, xs).total)
        assert (got == top + half).all() if ok else (got == -(2**63)).all()
        if ok:
            assert ring.check_fits_ring64(top + half) == 64
        else:
            with pytest.raises(ring.WrapError, match="65 bits"):
                ring.check_fits_ring64(top + half)


def test_round_length_is_declared_per_round_and_bounded():
    """Phases of different sizes share one protocol instance: each round declares its own length."""
    import os

    import numpy as np

    from distmoe.privacy.secagg import LocalFederation, SecAggParams

    params = SecAggParams(run_id=os.urandom(16), threshold=2, bits=64, length=50)
    fed = LocalFederation(params, [1, 2, 3])
    fed.setup()
    rng = np.random.default_rng(0)
    for r, n in ((1, 7), (2, 50), (3, 1)):
        xs = {i: rng.integers(0, 2**40, n, dtype=np.uint64) for i in (1, 2, 3)}
        res = fed.round(r, xs, length=n, drop_before_masked={3} if r == 2 else ())
        assert res.included == ((1, 2) if r >= 2 else (1, 2, 3))  # 3 missed round 2, rejoins at 4
        want = sum(xs[i] for i in res.included)
        assert res.total.shape == (n,) and np.array_equal(res.total, want)
    with pytest.raises(ValueError, match="length"):
        fed.server.begin_round(4, 51)


@pytest.mark.parametrize("bits", [32, 64, 12])
def test_a_premask_gives_the_same_words_and_is_bound_to_its_round(bits):
    """``premask`` (the masks expanded while the party trains) gives exactly the masked words of expanding them
    in ``masked_input``, and the round still sums; one computed for another round or width is refused before
    anything changes; a round without keys gets none."""
    fed, twin = fed_of(3, 2, bits=bits, seed=7), fed_of(3, 2, bits=bits, seed=7)
    starts, starts2 = fed.server.begin_round(1, None, bits), twin.server.begin_round(1, None, bits)
    g = np.random.default_rng(3)
    xs = {i: g.integers(0, 2**bits, L, dtype=np.uint64).astype(P.word_dtype(bits)) for i in starts}
    pre = {i: fed.clients[i].premask(s) for i, s in starts.items()}
    assert all(isinstance(p, PreMask) and p.words.shape == (L,) for p in pre.values())
    got = [fed.clients[i].masked_input(s, xs[i].copy(), premask=pre[i], consume=True) for i, s in starts.items()]
    want = [twin.clients[i].masked_input(s, xs[i].copy()) for i, s in starts2.items()]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.y, b.y)
    checks = fed.server.receive_masked(1, got)
    req = fed.check(1, checks)
    total = fed.server.finish(1, [fed.clients[i].unmask(req) for i, _, _ in req.signatures]).total
    want_total = sum(int(x.astype(np.uint64)[0]) for x in xs.values()) % (1 << bits)
    assert int(total[0]) == want_total
    # round 2: a premask from round 1 (or for another width) is refused, the round is untouched and then masks
    s2 = fed.server.begin_round(2, None, bits)
    with pytest.raises(ValueError, match="another round"):
        fed.clients[1].masked_input(s2[1], xs[1].copy(), premask=pre[1])
    other = PreMask(2, bits, pre[1].digest, pre[1].words)
    with pytest.raises(ValueError, match="another round"):
        fed.clients[1].masked_input(s2[1], xs[1].copy(), premask=other)
    assert fed.clients[1].masked_input(s2[1], xs[1].copy(), premask=fed.clients[1].premask(s2[1])).round == 2
    assert fed.clients[2].premask(starts[2]) is None  # round 1 is closed for it: masked_input names why


def test_a_consumed_input_is_masked_in_place_and_sums_the_same():
    """``consume=True`` (what a party's session passes: its fresh update vector) masks the caller's words in
    place, with exactly the words of the default copying path; a copy is made for anything not owned as words
    of the ring (a read-only or wrong-width array), and without ``consume`` the input is left untouched."""
    fed = fed_of(3, 2, bits=32, seed=4)
    twin = fed_of(3, 2, bits=32, seed=4)  # the same keys: the same masks
    starts, starts2 = fed.server.begin_round(1, None, 32), twin.server.begin_round(1, None, 32)
    xs = {i: np.full(L, 10 * i, np.uint32) for i in starts}
    kept = {i: x.copy() for i, x in xs.items()}
    consumed = {i: fed.clients[i].masked_input(s, xs[i], consume=True) for i, s in starts.items()}
    copied = {i: twin.clients[i].masked_input(s, kept[i].copy()) for i, s in starts2.items()}
    for i in starts:
        assert np.shares_memory(consumed[i].y, xs[i])  # masked in place: the plaintext words are gone
        np.testing.assert_array_equal(xs[i], copied[i].y)
        np.testing.assert_array_equal(consumed[i].y, copied[i].y)
        assert not np.array_equal(consumed[i].y, kept[i])
    fed3 = fed_of(3, 2, bits=32, seed=5)
    s3 = fed3.server.begin_round(1, None, 32)
    frozen = np.full(L, 3, np.uint32)
    frozen.flags.writeable = False
    wide = np.full(L, 3, np.uint64)
    plain = np.full(L, 3, np.uint32)
    ys = [fed3.clients[1].masked_input(s3[1], frozen, consume=True).y,
          fed3.clients[2].masked_input(s3[2], wide, consume=True).y,
          fed3.clients[3].masked_input(s3[3], plain).y]
    assert not any(np.shares_memory(y, x) for y, x in zip(ys, (frozen, wide, plain), strict=True))
    assert (frozen == 3).all() and (wide == 3).all() and (plain == 3).all()
