"""Tests of the SecAgg peer graphs (``distmoe.privacy.secagg.graph``): the complete graph and the SecAgg+
Harary graph (Bell et al. 2020) behind ``privacy.secagg-graph``.

Owns: the graph's structure (symmetric, k-regular, the same from the same public facts on every side,
keyed by the run id), the degree bound (complete up to 25 parties, sparse above, the security and
correctness conditions met at the chosen degree and not two below), the threshold per neighbourhood
(``check_graph`` and the client refuse a threshold that is not a strict majority of a party's holders
or exceeds them), exact sums with dropouts at every stage over a sparse graph, restore under another
graph refused. The config key and a whole run through the party session and the coordinator are in
``test_graph_wiring.py``.

Must not: touch the network or ``flwr`` beyond the in-process transport. The graph is hand-written
because the protocol is (``docs/privacy.md`` §9).
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from distmoe.privacy import secagg as sa
from distmoe.privacy.secagg import graph as G

L = 256


def seeded(seed: int):
    return lambda cid: random.Random(seed * 100_003 + cid).randbytes


def inputs(ids, seed: int = 1) -> dict[int, np.ndarray]:
    g = np.random.default_rng(seed)
    return {i: g.integers(0, 2**32, L, dtype=np.uint64).astype(np.uint32) for i in ids}


def expected(xs, ids) -> np.ndarray:
    total = np.zeros(L, dtype=np.uint64)
    for i in ids:
        total += xs[i].astype(np.uint64)
    return (total & np.uint64(2**32 - 1)).astype(np.uint32)


def harary_fed(n: int, degree: int | None = None, run_id: bytes = b"graph-run", **setup):
    peers = G.peer_graph("harary", run_id, n) if degree is None else G.harary_graph(run_id, degree)
    k = len(peers(1, tuple(range(1, n + 1))))
    t = max(2, (k + 1) // 2 + 1)
    params = sa.SecAggParams(run_id=run_id, threshold=t, bits=32, length=L)
    fed = sa.LocalFederation(params, range(1, n + 1), peers=peers, rng_for=seeded(0))
    fed.setup(**setup)
    return fed, peers, t


# ---- structure ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(8, 4), (13, 6), (30, 22), (60, 10)])
def test_harary_graph_is_symmetric_regular_and_passes_check_graph(n, k):
    roster = tuple(range(10, 10 + n))
    peers = G.harary_graph(b"run-a", k)
    t = (k + 1) // 2 + 1
    G.check_graph(peers, roster, t)
    assert all(len(peers(u, roster)) == k for u in roster)
    # a ring: following the permutation, each party's peers are its k/2 neighbours on either side
    order = G._ring(b"run-a", roster)[1]
    for i, u in enumerate(order):
        assert peers(u, roster) == {order[(i + s) % n] for s in range(-k // 2, k // 2 + 1) if s}


def test_harary_graph_is_derived_from_public_facts_only():
    roster = tuple(range(1, 41))
    a, b = G.peer_graph("harary", b"run-1", 40), G.peer_graph("harary", b"run-1", 40)
    assert all(a(u, roster) == b(u, roster) for u in roster)  # server and party compute the same graph
    c = G.peer_graph("harary", b"run-2", 40)
    assert any(a(u, roster) != c(u, roster) for u in roster)  # keyed by the run id
    assert a(1, roster) != frozenset(range(2, 2 + len(a(1, roster))))  # permuted, not the sorted ring


def test_harary_equals_complete_up_to_25_parties_and_is_sparse_above():
    for n in range(3, 26):
        assert G.graph_degree("harary", n) == n - 1
        assert G.graph_threshold("harary", n, 2) == G.graph_threshold("complete", n, 2) == max(2, n // 2 + 1)
    for n, k in ((30, 22), (50, 22), (100, 24), (200, 36), (1000, 54)):
        assert G.graph_degree("harary", n) == k
        assert G.graph_threshold("harary", n, 2) == (k + 1) // 2 + 1
    assert G.graph_threshold("harary", 50, 20) == 20  # privacy.min-parties still floors it


def test_degree_bound_holds_at_k_and_fails_two_below():
    n, gamma, delta = 100, G.COLLUDING_FRACTION, G.DROPOUT_FRACTION
    k = G.harary_degree(n)
    c, d = math.ceil(gamma * n), math.ceil(delta * n)

    def ok(kk: int) -> bool:
        t = (kk + 1) // 2 + 1
        sec = n * G._hyp_tail(n - 1, c, kk, t) + n * n / 2 * ((c + d) / n) ** kk
        cor = n * G._hyp_tail(n - 1, d, kk, kk + 2 - t)
        return sec <= 2.0 ** -G.SECURITY_BITS and cor <= 2.0 ** -G.CORRECTNESS_BITS

    assert ok(k) and not ok(k - 2)
    assert G.harary_degree(n, sigma=80) > k and G.harary_degree(n, gamma=0.2) > k  # stricter -> denser
    assert G._hyp_tail(10, 3, 4, 0) == 1.0 and G._hyp_tail(10, 3, 4, 4) == 0.0
    assert G._hyp_tail(10, 3, 4, 1) == pytest.approx(1 - math.comb(7, 4) / math.comb(10, 4))


def test_unknown_graph_is_refused():
    with pytest.raises(ValueError, match="unknown peer graph"):
        G.peer_graph("ring", b"x", 10)
    with pytest.raises(ValueError, match="unknown peer graph"):
        G.graph_threshold("ring", 10, 2)


# ---- thresholds per neighbourhood ---------------------------------------------------------------

def test_check_graph_needs_a_majority_of_each_neighbourhood():
    roster = tuple(range(1, 31))
    peers = G.harary_graph(b"run-t", 8)  # 9 holders per party
    G.check_graph(peers, roster, 5)
    with pytest.raises(sa.InsecureThreshold):
        G.check_graph(peers, roster, 4)  # 2t = 8 <= 9 holders
    with pytest.raises(sa.BelowThreshold):
        G.check_graph(peers, roster, 10)  # more than its 9 holders


def test_client_refuses_a_threshold_that_is_not_a_majority_of_its_holders():
    n, run_id = 12, b"run-c"
    peers = G.harary_graph(run_id, 4)  # 5 holders: t must be 3
    params = sa.SecAggParams(run_id=run_id, threshold=2, bits=32, length=L)
    clients = {i: sa.SecAggClient(params, i, peers=peers) for i in range(1, n + 1)}
    ads = {i: c.advertise() for i, c in clients.items()}
    directory = sa.KeyDirectory(run_id, tuple((i, a.c_pk) for i, a in sorted(ads.items())),
                                tuple((i, a.sig_pk) for i, a in sorted(ads.items())))
    with pytest.raises(sa.InsecureThreshold):
        clients[1].receive_directory(directory)
    with pytest.raises(sa.InsecureThreshold):  # the server refuses it at registration too
        sa.SecAggServer(params, peers=peers).register(list(ads.values()))


# ---- sums over a sparse graph -------------------------------------------------------------------

def test_exact_sum_over_the_derived_harary_graph_with_dropouts_at_every_stage():
    n = 30  # k = 22, t = 12
    fed, peers, t = harary_fed(n, skip_share_keys={30})
    assert t == 12 and len(peers(1, tuple(range(1, n + 1)))) == 22
    xs = inputs(range(1, n + 1))
    res = fed.round(1, xs, drop_before_masked={3, 17}, drop_before_unmask={5, 8, 21})
    alive = [i for i in range(1, n) if i not in (3, 17)]
    assert res.included == tuple(alive) and res.dropped == (3, 17)
    np.testing.assert_array_equal(res.total, expected(xs, alive))
    # a party masks with, and gives shares to, its 22 peers only, never the other 7
    starts = fed.server.begin_round(2)
    roster = tuple(range(1, n + 1))
    for u, s in starts.items():
        assert {e.sender for e in s.shares} <= peers(u, roster)
        assert len(s.shares) <= 22


def test_sparse_graph_sum_and_per_neighbourhood_threshold_on_both_sides():
    n, k = 12, 4  # 5 holders, t = 3
    fed, peers, t = harary_fed(n, degree=k)
    assert t == 3
    roster = tuple(range(1, n + 1))
    xs = inputs(roster, seed=3)
    res = fed.round(1, xs, drop_before_masked={2}, drop_before_unmask={7})
    np.testing.assert_array_equal(res.total, expected(xs, [i for i in roster if i != 2]))
    # round 2: 3 of a party's 4 peers drop before the masked input; globally 8 of 12 survive (>= t), but
    # that party has 2 surviving holders: it refuses to unmask (its own neighbourhood is below t)
    victim = 6
    off = sorted(peers(victim, roster) - {2})[:3]
    with pytest.raises(sa.TooFewSurvivors, match="survivors among this client's holders"):
        fed.round(2, xs, drop_before_masked=off)
    # round 3: those peers sent nothing in round 2, so they are outside U1; the server leaves out every
    # party with fewer than t holders in U1 (the victim among them) and sums the rest exactly
    res3 = fed.round(3, xs)
    assert victim not in res3.included and set(off).isdisjoint(res3.included)
    assert "fewer than t of its holders" in fed.server.rejected[(3, victim)]
    np.testing.assert_array_equal(res3.total, expected(xs, res3.included))


def test_restore_under_another_graph_is_refused():
    fed, peers, t = harary_fed(30)
    blob = fed.clients[1].to_state()
    sa.SecAggClient.from_state(fed.params, blob, peers=peers)  # the same graph: fine
    with pytest.raises(sa.StateMismatch):
        sa.SecAggClient.from_state(fed.params, blob, peers=sa.complete_graph)
    with pytest.raises(sa.StateMismatch):
        sa.SecAggServer.from_state(fed.params, fed.server.to_state(), peers=G.peer_graph("harary", b"other", 30))
