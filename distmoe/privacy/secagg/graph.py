"""The peer graph: with whom each client masks and to whom it gives shares.

Owns: ``complete_graph`` (Bonawitz et al. 2017, the default), ``harary_graph`` (the SecAgg+ sparse
graph of Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", CCS 2020,
https://eprint.iacr.org/2020/704: a Harary graph H(n, k) over a public random permutation of the roster),
``harary_degree`` (the smallest degree k that keeps the protocol's three guarantees at n parties, see
below), ``peer_graph`` / ``graph_threshold`` (the graph and the Shamir threshold that
``privacy.secagg-graph`` names, from public facts only), and the checks every graph must pass
(symmetric, no self loops, t <= |holders| and 2t > |holders| for every client, where holders are the
client and its peers).

Must not: depend on anything but public facts (the sorted roster, the run id and the degree rule), so
the server and every client compute the same graph. Hand-written because the protocol is (``docs/privacy.md``
§9: Flower's SecAgg+ only runs in the legacy workflow).

Why a sparse graph and what it costs. With the complete graph each client expands n PRG masks of the
vector, Shamir-shares two secrets to n holders and encrypts n - 1 share envelopes; the server, per
dropped client, re-expands n - 1 pairwise masks. With a k-regular graph those n become k + 1. The
price is a weaker, probabilistic guarantee: a client is protected only if fewer than t of its own k + 1
holders collude with the server, its masked input is recoverable only if t of them survive, and the
honest survivors' graph must stay connected (else the server learns the sums of the components).

``harary_degree(n)`` is the smallest even k such that, for a fixed set of ceil(gamma n) colluding and
ceil(delta n) dropped clients and the public random permutation (each neighbourhood a uniform k-subset
of the others, exact hypergeometric tails, union bound over the n clients), with t = floor((k+1)/2) + 1:

  security      n * P[a client has >= t colluding holders] + P[the survivors' ring is cut] <= 2^-sigma
  correctness   n * P[a client has < t surviving holders]                                  <= 2^-eta

where cutting H(n, k) needs two runs of k/2 consecutive removed positions (bounded by n^2/2 rho^k,
rho = (ceil(gamma n) + ceil(delta n)) / n). These are Bell et al.'s three conditions evaluated exactly
for this construction, not their asymptotic constants. Defaults: gamma = delta = 0.1, sigma = 40,
eta = 20. If no k < n - 1 meets them, the graph is the complete one: with these defaults that is
every n up to 25 (then k = 22 at n = 30 and 50, 24 at 100, 36 at 200, 54 at 1000; bench/scale.py).

The permutation is keyed by the run id, which the server picks: a malicious server could try run ids
until colluding clients land next to a target. That is within the protocol's semi-honest server
model (``docs/privacy.md`` §1: key authentication and the consistency round are not implemented either).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from functools import lru_cache

from distmoe.privacy.secagg.errors import BelowThreshold, InsecureThreshold

PeerGraph = Callable[[int, tuple[int, ...]], frozenset[int]]  # (client, sorted roster) -> its peers
GRAPHS = ("complete", "harary")

COLLUDING_FRACTION = 0.1  # gamma: clients that may collude with the server
DROPOUT_FRACTION = 0.1  # delta: clients that may drop out of a round
SECURITY_BITS = 40  # sigma
CORRECTNESS_BITS = 20  # eta


def complete_graph(cid: int, roster: tuple[int, ...]) -> frozenset[int]:
    return frozenset(roster) - {cid}


# ---- SecAgg+ (Bell et al. 2020): Harary graph over a public random permutation ------------------

def _hyp_tail(population: int, marked: int, draws: int, at_least: int) -> float:
    """P[X >= at_least] for X ~ Hypergeometric(population, marked, draws), exact."""
    if at_least <= 0:
        return 1.0
    hi = min(marked, draws)
    if at_least > hi:
        return 0.0
    num = sum(math.comb(marked, x) * math.comb(population - marked, draws - x) for x in range(at_least, hi + 1))
    return num / math.comb(population, draws)


@lru_cache(maxsize=256)
def harary_degree(n: int, gamma: float = COLLUDING_FRACTION, delta: float = DROPOUT_FRACTION,
                  sigma: int = SECURITY_BITS, eta: int = CORRECTNESS_BITS) -> int:
    """The smallest even degree k < n - 1 meeting the security and correctness bounds above, else n - 1
    (the complete graph)."""
    if n < 2:
        raise ValueError(f"a peer graph needs at least 2 clients, got {n}")
    if not (0 <= gamma < 0.5 and 0 <= delta < 0.5):
        raise ValueError(f"colluding and dropout fractions must be in [0, 0.5), got {gamma}, {delta}")
    c, d = math.ceil(gamma * n), math.ceil(delta * n)
    rho = (c + d) / n
    for k in range(2, n - 1, 2):
        t = (k + 1) // 2 + 1
        sec = n * _hyp_tail(n - 1, c, k, t) + n * n / 2 * rho ** k
        cor = n * _hyp_tail(n - 1, d, k, k + 2 - t)  # more than k + 1 - t dropped holders
        if sec <= 2.0 ** -sigma and cor <= 2.0 ** -eta:
            return k
    return n - 1


@lru_cache(maxsize=64)
def _ring(seed: bytes, roster: tuple[int, ...]) -> tuple[dict[int, int], tuple[int, ...]]:
    order = tuple(sorted(roster, key=lambda v: (hashlib.sha256(b"distmoe-secagg/v1|harary|" + seed +
                                                               v.to_bytes(8, "big")).digest(), v)))
    return {v: i for i, v in enumerate(order)}, order


def harary_graph(seed: bytes, degree: int | Callable[[int], int] = harary_degree) -> PeerGraph:
    """H(n, k) over the roster permuted by SHA-256(seed, id): each client's peers are the k/2 clients on
    either side of it on that ring. ``seed``: the run id (public). ``degree``: k, or a rule n -> k
    (default ``harary_degree``); an odd k is rounded up, k >= n - 1 gives the complete graph."""
    if not isinstance(seed, bytes) or not seed:
        raise ValueError("harary_graph needs a non-empty public seed (the run id)")

    def peers(cid: int, roster: tuple[int, ...]) -> frozenset[int]:
        n = len(roster)
        k = degree(n) if callable(degree) else int(degree)
        if k < 2:
            raise ValueError(f"harary graph degree must be at least 2, got {k}")
        if k >= n - 1:
            return complete_graph(cid, roster)
        pos, order = _ring(seed, roster)
        i, half = pos[cid], (k + 1) // 2
        return frozenset(order[(i + s) % n] for s in range(-half, half + 1) if s)

    peers.kind, peers.seed, peers.degree = "harary", seed, degree  # introspection (bench, logs)
    return peers


def graph_degree(kind: str, n_invited: int) -> int:
    """The degree k of the named graph for a run that invited ``n_invited`` parties (n - 1: complete)."""
    if kind not in GRAPHS:
        raise ValueError(f"unknown peer graph {kind!r}; allowed: {', '.join(GRAPHS)}")
    if kind == "complete" or n_invited < 4:
        return max(n_invited - 1, 1)
    k = harary_degree(n_invited)
    return n_invited - 1 if k >= n_invited - 1 else k + (k % 2)


def peer_graph(kind: str, seed: bytes, n_invited: int) -> PeerGraph:
    """The graph named by ``privacy.secagg-graph`` for a run that invited ``n_invited`` parties, keyed by the
    run's public SecAgg id: the server and every party call it with the same three public facts (the
    ``SetupRequest`` carries the id and the count). The degree is fixed from ``n_invited``, so a roster
    smaller than the invitation keeps a valid threshold (``graph_threshold``)."""
    if kind == "complete":
        return complete_graph
    if kind == "harary":
        return harary_graph(seed, graph_degree(kind, n_invited))
    raise ValueError(f"unknown peer graph {kind!r}; allowed: {', '.join(GRAPHS)}")


def graph_threshold(kind: str, n_invited: int, min_parties: int) -> int:
    """Shamir threshold t: a strict majority of each client's k + 1 holders and at least ``min_parties``.
    Complete graph: n // 2 + 1 (``distmoe.privacy.plan.threshold_for``); Harary: floor((k + 1) / 2) + 1."""
    return max(int(min_parties), (graph_degree(kind, n_invited) + 1) // 2 + 1, 2)


# ---- checks -------------------------------------------------------------------------------------

def holders_of(peers: PeerGraph, cid: int, roster: tuple[int, ...]) -> tuple[int, ...]:
    """The client and its peers, sorted: who holds shares of the client's secrets."""
    return tuple(sorted(peers(cid, roster) | {cid}))


def check_holders(cid: int, n_holders: int, t: int) -> None:
    if n_holders < t:
        raise BelowThreshold(f"client {cid} has {n_holders} share holders, below threshold t = {t}")
    if 2 * t <= n_holders:
        raise InsecureThreshold(f"threshold t = {t} is not above half of client {cid}'s {n_holders} holders: "
                                "a server telling holders different stories could obtain both shares")


def check_graph(peers: PeerGraph, roster: tuple[int, ...], t: int) -> None:
    members = frozenset(roster)
    for u in roster:
        nu = peers(u, roster)
        if u in nu or not nu <= members:
            raise ValueError(f"peer graph: client {u} has itself or a non-member as a peer")
        for v in nu:
            if u not in peers(v, roster):
                raise ValueError(f"peer graph is not symmetric: {u} -> {v} but not {v} -> {u}")
        check_holders(u, len(nu) + 1, t)
