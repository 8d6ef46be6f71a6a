"""The peer graph: with whom each client masks and to whom it gives shares.

Owns: ``complete_graph`` (Bonawitz et al. 2017, the default) and the checks every graph must pass
(symmetric, no self loops, t <= |holders| and 2t > |holders| for every client, where holders are the
client and its peers). A SecAgg+ style sparse graph (Bell et al. 2020) is a function with the same
signature; it must be random and secret from no one, and is not provided yet.

Must not: depend on anything but the sorted roster, so the server and every client compute the same
graph. Hand-written because the protocol is (DESIGN.md section 6: Flower's SecAgg+ only runs in the
legacy workflow).
"""

from __future__ import annotations

from collections.abc import Callable

from distmoe.privacy.secagg.errors import BelowThreshold, InsecureThreshold

PeerGraph = Callable[[int, tuple[int, ...]], frozenset[int]]  # (client, sorted roster) -> its peers


def complete_graph(cid: int, roster: tuple[int, ...]) -> frozenset[int]:
    return frozenset(roster) - {cid}


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
