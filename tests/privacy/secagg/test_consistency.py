"""Tests of the consistency check (Bonawitz et al., CCS 2017 §4, ConsistencyCheck) and the securely
counted contributors of a round (``SecAggClient.consistency`` / ``unmask``, ``SecAggServer.receive_consistency``).

Owns: the split-view attack of a malicious server at n = 5, 7, 10 (run for real: with the check removed
it recovers the target's input exactly; with it, every client aborts and the server recovers nothing),
forged / missing / repeated / foreign signatures, signatures over another survivor set, too few of
them, share-sums off one polynomial, a contributor count below ``min_contributors`` (the single-holder
task), dropouts in the new stage, once-per-round answers, and the pinned signing-key directory.

Must not: touch the network or ``flwr``; every test is in process.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from distmoe.privacy.plan import threshold_for
from distmoe.privacy.secagg import (
    BelowThreshold,
    ConsistencyFailure,
    ConsistencyRequest,
    KeyDirectory,
    KeySubstitution,
    LocalFederation,
    Phase,
    ProtocolViolation,
    RepeatedRequest,
    SecAggAbort,
    SecAggClient,
    SecAggParams,
    TooFewContributors,
    UnmaskRequest,
    shamir,
)
from distmoe.privacy.secagg import primitives as P

L = 64
RUN = b"consistency-run"


def fed_of(n: int, t: int | None = None, seed: int = 0) -> LocalFederation:
    t = threshold_for(n, 2) if t is None else t  # the run's rule: a strict majority (complete graph)
    params = SecAggParams(run_id=RUN, threshold=t, bits=64, length=L)
    fed = LocalFederation(params, range(1, n + 1), rng_for=lambda cid: random.Random(seed * 1000 + cid).randbytes)
    fed.setup()
    return fed


def inputs(n: int, seed: int = 1) -> dict[int, np.ndarray]:
    g = np.random.default_rng(seed)
    return {i: g.integers(0, 2**64, L, dtype=np.uint64) for i in range(1, n + 1)}


def honest_checks(fed: LocalFederation, r: int, xs, contributed=None):
    """Round ``r`` up to the consistency stage: (consistency requests, signed responses by sender)."""
    starts = fed.server.begin_round(r)
    masked = [
        fed.clients[i].masked_input(s, xs[i], contributed=True if contributed is None else contributed[i])
        for i, s in starts.items()
    ]
    checks = fed.server.receive_masked(r, masked)
    return checks, {i: fed.clients[i].consistency(q) for i, q in checks.items()}


# ---- the split-view attack --------------------------------------------------------------------


def split_view_attack(fed: LocalFederation, xs, *, target: int = 1, attach: str = "matching"):
    """A malicious server that wants the target's input y_v - PRG(b_v) - sum_p PRG(s_vp).

    It tells the target that U1 = {v} + P (t - 1 peers), so y_v is masked with P only, and tells every
    other client the full U1. In the unmask stage it shows each other client c a survivor set that lists
    a few members of P as dropped (c reveals their s_sk shares) and v as alive (c reveals its b_v share):
    every p in P is "dead" for t clients and v is "alive" for all, so it gets t shares of b_v and of each
    s_sk_p. Each client is shown (consistency stage) and asked (unmask) about the same set, so no
    per-client check of the lists against U1 can see the lie; only comparing signed sets can.
    ``attach``: "matching" (each request carries the signatures over its own set) or "all".
    Returns (the recovered x_v or None, aborts by client, responses by client)."""
    ids = sorted(fed.clients)
    n, t = len(ids), fed.params.threshold
    peers = [c for c in ids if c != target][: t - 1]
    others = [c for c in ids if c != target]
    starts = fed.server.begin_round(1)
    st = starts[target]
    told = dataclasses.replace(
        st,
        participants=tuple(pv for pv in st.participants if pv[0] in {target, *peers}),
        shares=tuple(e for e in st.shares if e.sender in peers),
    )
    masked = {c: fed.clients[c].masked_input(told if c == target else starts[c], xs[c]) for c in ids}
    dead: dict[int, set[int]] = {c: set() for c in others}
    for p in peers:  # each p "dropped" for t clients; a client may call at most n - t peers dropped
        pick = [c for c in sorted(others, key=lambda c: (len(dead[c]), c)) if c != p and len(dead[c]) < n - t][:t]
        assert len(pick) == t
        for c in pick:
            dead[c].add(p)
    u1 = {target: {target, *peers}} | {c: set(ids) for c in others}
    alive = {target: {target, *peers}} | {c: set(ids) - dead[c] for c in others}
    signed, aborts = {}, {}
    for c in ids:
        shares = tuple(e for m in masked.values() for e in m.count_shares if e.recipient == c and e.sender in alive[c])
        signed[c] = fed.clients[c].consistency(ConsistencyRequest(1, c, tuple(sorted(alive[c])), shares))
    responses = {}
    for c in ids:
        sigs = tuple(
            (s.sender, s.share_sum, s.signature)
            for s in signed.values()
            if attach == "all" or alive[s.sender] == alive[c]
        )
        req = UnmaskRequest(1, tuple(sorted(alive[c])), tuple(sorted(u1[c] - alive[c])), sigs)
        try:
            responses[c] = fed.clients[c].unmask(req)
        except SecAggAbort as exc:
            aborts[c] = exc
    b_pts = {
        shamir.holder_x(c): shamir.decode_share(dict(r.b_shares)[target])
        for c, r in responses.items()
        if target in dict(r.b_shares)
    }
    s_pts = {
        p: {
            shamir.holder_x(c): shamir.decode_share(dict(r.s_shares)[p])
            for c, r in responses.items()
            if p in dict(r.s_shares)
        }
        for p in peers
    }
    if len(b_pts) < t or any(len(v) < t for v in s_pts.values()):
        return None, aborts, responses
    s_pk = dict(st.participants)
    x = masked[target].y - P.prg(P.self_mask_key(RUN, 1, target, shamir.reconstruct(b_pts, t)), L, 64)
    for p in peers:  # target < p: y_v carried +PRG(s_vp)
        x -= P.prg(P.pair_mask_key(RUN, 1, target, p, shamir.reconstruct(s_pts[p], t), s_pk[target]), L, 64)
    return x, aborts, responses


@pytest.mark.parametrize("n", [5, 7, 10])
def test_split_view_attack_works_without_the_consistency_check(n, monkeypatch):
    """Control: with the client's consistency gate removed (the protocol without its consistency check), the split
    view recovers the target's input exactly, so the next test exercises a real attack."""
    monkeypatch.setattr(SecAggClient, "_consistency_gate", lambda self, st, req, k: None)
    xs = inputs(n)
    x, aborts, _ = split_view_attack(fed_of(n), xs)
    assert not aborts and x is not None
    np.testing.assert_array_equal(x, xs[1])


@pytest.mark.parametrize("attach", ["matching", "all"])
@pytest.mark.parametrize("n", [5, 7, 10])
def test_split_view_attack_recovers_nothing(n, attach):
    """Defence: the consistency check. Every client signed the set it was shown, and no set has enough
    signatures (honest clients sign once, a set needs max(t, n//2 + 1)), or the signatures are over other
    sets: every client aborts before revealing a share, and the server cannot rebuild the target."""
    xs = inputs(n)
    fed = fed_of(n)
    x, aborts, responses = split_view_attack(fed, xs, attach=attach)
    assert x is None and responses == {}
    assert sorted(aborts) == sorted(fed.clients)
    for exc in aborts.values():
        assert isinstance(exc, ConsistencyFailure) and "consistency" in str(exc)
    assert all(c.phase(1) is Phase.ABORTED for c in fed.clients.values())


# ---- signatures in the unmask request -------------------------------------------------------------


@pytest.fixture
def checked():
    """5 clients (t = 3), all signed round 1: (fed, honest unmask request)."""
    fed = fed_of(5)
    _, signed = honest_checks(fed, 1, inputs(5))
    return fed, fed.server.receive_consistency(1, signed.values())


def _refused(fed, req, exc_type, match, cid=1, **kw):
    with pytest.raises(exc_type, match=match):
        fed.clients[cid].unmask(req, **kw)
    assert fed.clients[cid].phase(1) is Phase.ABORTED  # nothing revealed, and nothing will be for this round


def _flip(b: bytes) -> bytes:
    return b[:7] + bytes([b[7] ^ 1]) + b[8:]


def test_honest_request_carries_enough_valid_signatures(checked):
    fed, req = checked
    assert [v for v, _, _ in req.signatures] == [1, 2, 3, 4, 5]
    assert fed.server.contributors(1) == 5
    res = fed.server.finish(1, [fed.clients[i].unmask(req, min_contributors=5) for i in req.alive])
    assert res.contributors == 5 and res.included == (1, 2, 3, 4, 5)


def test_forged_signature_is_refused(checked):
    """Defence: Ed25519 verification against the pinned key of the signer."""
    fed, req = checked
    sigs = list(req.signatures)
    v, s, g = sigs[1]
    sigs[1] = (v, s, _flip(g))
    _refused(fed, dataclasses.replace(req, signatures=tuple(sigs)), ConsistencyFailure, "client 2 does not verify")


def test_share_sum_altered_under_a_valid_signature_is_refused(checked):
    """Defence: the signature covers the share-sum (the count cannot be steered by the server)."""
    fed, req = checked
    sigs = list(req.signatures)
    v, s, g = sigs[0]
    sigs[0] = (v, shamir.encode_share((shamir.decode_share(s) + 1) % shamir.PRIME), g)
    _refused(fed, dataclasses.replace(req, signatures=tuple(sigs)), ConsistencyFailure, "does not verify")


def test_missing_signatures_below_the_required_number_are_refused(checked):
    """Defence: at least max(t, n//2 + 1) valid signatures over the set."""
    fed, req = checked
    _refused(
        fed,
        dataclasses.replace(req, signatures=req.signatures[:2]),
        ConsistencyFailure,
        "2 valid signatures over the survivor set, 3 needed",
    )


def test_no_signatures_at_all_are_refused(checked):
    fed, req = checked
    _refused(fed, dataclasses.replace(req, signatures=()), ConsistencyFailure, "0 valid signatures")


def test_duplicate_signature_is_refused(checked):
    """Defence: one signature per party (a repeated one would count twice towards the threshold)."""
    fed, req = checked
    sigs = req.signatures[:2] + (req.signatures[1],)
    _refused(fed, dataclasses.replace(req, signatures=sigs), ConsistencyFailure, "client 2 signs twice")


def test_signature_over_another_survivor_set_is_refused(checked):
    """Defence: the signed message binds the sorted survivor set (a signature taken from another view does
    not verify over this one). The other set's signature is made with client 2's real key, as a server
    would hold it after showing client 2 another set."""
    fed, req = checked
    other = P.sign(fed.clients[2]._sig_sk, P.consistency_message(RUN, 1, 2, (1, 2, 3, 4), req.signatures[1][1]))
    sigs = (req.signatures[0], (2, req.signatures[1][1], other), req.signatures[2])
    _refused(fed, dataclasses.replace(req, signatures=sigs), ConsistencyFailure, "client 2 does not verify")


def test_signature_from_outside_the_survivor_set_is_refused():
    fed = fed_of(5)
    xs = inputs(5)
    starts = fed.server.begin_round(1)
    masked = [fed.clients[i].masked_input(s, xs[i]) for i, s in starts.items() if i != 5]
    checks = fed.server.receive_masked(1, masked)
    signed = [fed.clients[i].consistency(q) for i, q in checks.items()]
    req = fed.server.receive_consistency(1, signed)
    fake = P.sign(fed.clients[5]._sig_sk, P.consistency_message(RUN, 1, 5, req.alive, bytes(66)))
    _refused(
        fed,
        dataclasses.replace(req, signatures=req.signatures + ((5, bytes(66), fake),)),
        ConsistencyFailure,
        "client 5, not a survivor",
    )


def test_survivor_set_other_than_the_signed_one_is_refused(checked):
    """Defence: the unmask request must name exactly the set this client signed."""
    fed, req = checked
    _refused(fed, UnmaskRequest(1, (1, 2, 3, 4), (5,), req.signatures), ConsistencyFailure, "split view")


def test_share_sums_off_one_polynomial_are_refused():
    """With more than t signatures every share-sum must lie on one polynomial of degree t - 1. A party
    that signs a wrong share-sum (here: client 4 with its own key) cannot shift the count unnoticed."""
    fed = fed_of(5)
    _, signed = honest_checks(fed, 1, inputs(5))
    bad = (shamir.decode_share(signed[4].share_sum) + 1) % shamir.PRIME
    enc = shamir.encode_share(bad)
    signed[4] = dataclasses.replace(
        signed[4],
        share_sum=enc,
        signature=P.sign(fed.clients[4]._sig_sk, P.consistency_message(RUN, 1, 4, (1, 2, 3, 4, 5), enc)),
    )
    with pytest.raises(ConsistencyFailure, match="one contributor count"):
        fed.server.receive_consistency(1, signed.values())
    honest = fed_of(5, seed=3)
    _, s2 = honest_checks(honest, 1, inputs(5))
    req = honest.server.receive_consistency(1, s2.values())
    sigs = list(req.signatures)
    enc = shamir.encode_share((shamir.decode_share(sigs[3][1]) + 1) % shamir.PRIME)
    sigs[3] = (4, enc, P.sign(honest.clients[4]._sig_sk, P.consistency_message(RUN, 1, 4, req.alive, enc)))
    _refused(honest, dataclasses.replace(req, signatures=tuple(sigs)), ConsistencyFailure, "one polynomial")


# ---- the contributor count (a release needs min-parties contributors) ----------------------------


@pytest.mark.parametrize(
    "pattern,count", [((1, 0, 0, 0, 0), 1), ((1, 1, 0, 1, 0), 3), ((0, 0, 0, 0, 0), 0), ((1, 1, 1, 1, 1), 5)]
)
def test_contributor_count_is_the_sum_of_the_bits(pattern, count):
    fed = fed_of(5)
    _, signed = honest_checks(fed, 1, inputs(5), contributed={i + 1: bool(b) for i, b in enumerate(pattern)})
    req = fed.server.receive_consistency(1, signed.values())
    assert fed.server.contributors(1) == count
    assert fed.clients[2].contributors(req, req.alive) == count  # every party interpolates the same count


def test_single_holder_release_is_refused_by_the_server_before_unmasking():
    """The single-holder task: one party holds the task, the others send zero vectors. Defence: the
    server's count check (``min_contributors``) ends the round before any unmask request exists."""
    fed = fed_of(5)
    with pytest.raises(TooFewContributors, match="1 of the 5 survivors contributed data"):
        fed.round(1, inputs(5), contributed={1: True, 2: False, 3: False, 4: False, 5: False}, min_contributors=2)
    assert all(c.phase(1) is Phase.CHECKED for c in fed.clients.values())  # signed, nothing revealed


def test_single_holder_release_is_refused_by_every_party_even_if_the_server_asks():
    """Defence in depth: a server that skips its own count check still gets no share: each party
    interpolates the count from the signed share-sums and refuses below privacy.min-parties."""
    fed = fed_of(5)
    _, signed = honest_checks(fed, 1, inputs(5), contributed={1: True, 2: False, 3: False, 4: False, 5: False})
    req = fed.server.receive_consistency(1, signed.values())  # min_contributors not checked
    for cid in (1, 2, 3):
        _refused(fed, req, TooFewContributors, "1 of the 5 survivors contributed data", cid=cid, min_contributors=2)
    with pytest.raises(BelowThreshold):  # the two that would answer are below t
        fed.server.finish(1, [fed.clients[i].unmask(req, min_contributors=1) for i in (4, 5)])


# ---- the stage itself -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "drops",
    [
        {"drop_before_masked": {2}},
        {"drop_before_consistency": {2}},
        {"drop_before_unmask": {2}},
        {"drop_before_masked": {7}, "drop_before_consistency": {2}, "drop_before_unmask": {5}},
    ],
)
def test_dropouts_at_every_stage_still_give_the_survivors_sum(drops):
    fed = fed_of(7)  # t = 4
    xs = inputs(7)
    res = fed.round(1, xs, **drops, min_contributors=2)
    dropped_masked = drops.get("drop_before_masked", set())
    expect = np.zeros(L, np.uint64)
    for i in sorted(set(xs) - dropped_masked):
        expect += xs[i]
    np.testing.assert_array_equal(res.total, expect)
    assert res.contributors == 7 - len(dropped_masked)
    assert not set(res.responders) & drops.get("drop_before_consistency", set())  # did not sign: not asked


def test_too_few_signatures_end_the_round_at_the_server():
    fed = fed_of(5)
    with pytest.raises(BelowThreshold, match="2 signatures over the survivor set, 3 needed"):
        fed.round(1, inputs(5), drop_before_consistency={1, 2, 3})


def test_consistency_is_answered_once_and_in_order():
    fed = fed_of(4)
    xs = inputs(4)
    starts = fed.server.begin_round(1)
    early = ConsistencyRequest(1, 1, (1, 2, 3, 4), ())
    with pytest.raises(ProtocolViolation, match="before this client sent its masked input"):
        fed.clients[1].consistency(early)
    masked = [fed.clients[i].masked_input(s, xs[i]) for i, s in starts.items() if i != 1]
    checks = fed.server.receive_masked(1, masked)
    with pytest.raises(ProtocolViolation, match="before this client's consistency check"):
        fed.clients[2].unmask(UnmaskRequest(1, (2, 3, 4), (1,)))
    fed.clients[3].consistency(checks[3])
    with pytest.raises(RepeatedRequest):  # a second set to sign in the same round: refused
        fed.clients[3].consistency(dataclasses.replace(checks[3], survivors=(2, 3)))


@pytest.mark.parametrize(
    "edit,exc,match",
    [
        (lambda q: dataclasses.replace(q, survivors=(1, 3, 4)), ProtocolViolation, "omits client 2"),
        (lambda q: dataclasses.replace(q, survivors=(2, 3)), Exception, "below"),
        (lambda q: dataclasses.replace(q, count_shares=q.count_shares[1:]), ProtocolViolation, "no count share"),
        (
            lambda q: dataclasses.replace(q, count_shares=q.count_shares[:1] * 2 + q.count_shares[1:]),
            ProtocolViolation,
            "two count shares",
        ),
        (
            lambda q: dataclasses.replace(
                q,
                count_shares=(dataclasses.replace(q.count_shares[0], ciphertext=_flip(q.count_shares[0].ciphertext)),)
                + q.count_shares[1:],
            ),
            SecAggAbort,
            "failed authentication",
        ),
    ],
)
def test_consistency_request_checks(edit, exc, match):
    fed = fed_of(4)
    starts = fed.server.begin_round(1)
    xs = inputs(4)
    checks = fed.server.receive_masked(1, [fed.clients[i].masked_input(s, xs[i]) for i, s in starts.items()])
    with pytest.raises(exc, match=match):
        fed.clients[2].consistency(edit(checks[2]))
    assert fed.clients[2].phase(1) is Phase.ABORTED


# ---- the signing-key directory --------------------------------------------------------------------


def _setup(n: int = 4):
    params = SecAggParams(run_id=RUN, threshold=3, bits=64, length=L)
    fed = LocalFederation(params, range(1, n + 1))
    ads = [c.advertise() for c in fed.clients.values()]
    return fed, fed.server.register(ads)


def test_directory_pins_signing_keys_and_gives_one_fingerprint():
    fed, d = _setup()
    for c in fed.clients.values():
        c.receive_directory(d)
    assert len({c.fingerprint for c in fed.clients.values()}) == 1


def test_directory_substituting_a_signing_key_is_caught_by_the_victim_and_by_fingerprints():
    """A coordinator that swaps client 3's signing key: client 3 refuses (its own key), and the others
    accept but pin a directory whose fingerprint differs from client 3's honest view: the owners' out-of-
    band comparison is what catches a substitution of another party's key (docs/privacy.md §1)."""
    fed, d = _setup()
    evil = P.new_signing_key(random.Random(9).randbytes)[1]
    forged = KeyDirectory(d.run_id, d.keys, tuple((v, evil if v == 3 else k) for v, k in d.sig_keys))
    with pytest.raises(KeySubstitution, match="own signing key"):
        fed.clients[3].receive_directory(forged)
    fed.clients[1].receive_directory(forged)
    fed.clients[2].receive_directory(d)
    assert fed.clients[1].fingerprint != fed.clients[2].fingerprint


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda d: KeyDirectory(d.run_id, d.keys, d.sig_keys[:-1]), "exactly the clients"),
        (lambda d: KeyDirectory(d.run_id, d.keys, d.sig_keys[:1] * 2 + d.sig_keys[2:]), "appears twice"),
        (
            lambda d: KeyDirectory(
                d.run_id, d.keys, tuple((v, d.sig_keys[0][1]) if v == 4 else (v, k) for v, k in d.sig_keys)
            ),
            "same signing key",
        ),
    ],
)
def test_directory_with_missing_repeated_or_shared_signing_keys_is_refused(edit, match):
    fed, d = _setup()
    with pytest.raises(ProtocolViolation, match=match):
        fed.clients[1].receive_directory(edit(d))
