"""An in-process driver of the protocol: one server and n clients passing the message dataclasses.

Owns: the reference schedule (two setup exchanges once per run, then three exchanges per round:
masked input, consistency check, unmask) with
dropouts injected at any stage, and per-client byte counts. Tests, benchmarks and the later Flower
wiring use it as the executable description of who sends what when.

Must not: be used as a transport in a real run (everything is in one process, so it protects nothing),
or reach into client or server internals: it calls only their public stage methods. Exists because the
protocol is ours, not Flower's SecAgg+ (``docs/privacy.md`` §9), so its schedule has to be written down
somewhere runnable.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import numpy as np

from distmoe.privacy.secagg.client import SecAggClient
from distmoe.privacy.secagg.graph import PeerGraph, complete_graph
from distmoe.privacy.secagg.messages import AggregateResult, SecAggParams, payload_bytes
from distmoe.privacy.secagg.primitives import RandomBytes
from distmoe.privacy.secagg.server import SecAggServer


class LocalFederation:
    def __init__(self, params: SecAggParams, ids: Collection[int], *, peers: PeerGraph = complete_graph,
                 rng_for: Callable[[int], RandomBytes] | None = None):
        self.params = params
        self.server = SecAggServer(params, peers=peers)
        self.clients = {i: SecAggClient(params, i, peers=peers, rng=rng_for(i) if rng_for else None)
                        for i in sorted(ids)}
        self.exchanges = 0  # request/reply exchanges so far (each reaches all online clients at once)
        self.up: dict[int, int] = {}  # bytes client -> server in the last round (or setup)
        self.down: dict[int, int] = {}  # bytes server -> client in the last round (or setup)

    def _count(self, cid: int, up: object = None, down: object = None) -> None:
        if up is not None:
            self.up[cid] = self.up.get(cid, 0) + payload_bytes(up)
        if down is not None:
            self.down[cid] = self.down.get(cid, 0) + payload_bytes(down)

    def setup(self, *, first_round: int = 1, absent: Collection[int] = (), skip_share_keys: Collection[int] = ()
              ) -> None:
        """Exchange A: keys advertised. Exchange B: directory down, share keys of ``first_round`` up.
        ``absent`` never join the run; ``skip_share_keys`` join but drop before sharing keys."""
        self.up, self.down = {}, {}
        adverts = [c.advertise() for i, c in self.clients.items() if i not in absent]
        for a in adverts:
            self._count(a.sender, up=a)
        directory = self.server.register(adverts)
        self.exchanges += 1
        keys = []
        for i in self.server.roster:
            self.clients[i].receive_directory(directory)
            self._count(i, down=directory)
            if i not in skip_share_keys:
                keys.append(self.clients[i].share_keys(first_round))
                self._count(i, up=keys[-1])
        self.server.add_share_keys(keys)
        self.exchanges += 1

    def round(self, r: int, inputs: Mapping[int, np.ndarray], *, drop_before_masked: Collection[int] = (),
              drop_before_consistency: Collection[int] = (), drop_before_unmask: Collection[int] = (),
              offline: Collection[int] = (), length: int | None = None, bits: int | None = None,
              contributed: Mapping[int, bool] | None = None, min_contributors: int = 0) -> AggregateResult:
        """Exchange 1: RoundStart (+ the training request) down, masked input + contributor-bit shares +
        next share keys up; an online client outside U1 answers with next share keys only and rejoins at
        r + 1. Exchange 2 (consistency check): U2 and count shares down, signed share-sum up. Exchange 3:
        unmask request with the signatures down, shares up. ``contributed``: each client's contributor
        bit (default: all contributed); ``min_contributors``: what the server and every client require."""
        self.up, self.down = {}, {}
        starts = self.server.begin_round(r, length, bits)
        masked, late_keys = [], []
        for i in self.server.roster:
            if i in offline or i in drop_before_masked:
                continue
            c = self.clients[i]
            if i in starts:
                self._count(i, down=starts[i])
                masked.append(c.masked_input(starts[i], inputs[i],
                                             contributed=True if contributed is None else contributed[i]))
                self._count(i, up=masked[-1])
            else:
                late_keys.append(c.share_keys(r + 1))
                self._count(i, up=late_keys[-1])
        self.exchanges += 1
        self.server.add_share_keys(late_keys)
        checks = self.server.receive_masked(r, masked)
        signed = []
        for i, req in checks.items():
            if i in offline or i in drop_before_consistency:
                continue
            self._count(i, down=req)
            signed.append(self.clients[i].consistency(req))
            self._count(i, up=signed[-1])
        self.exchanges += 1
        request = self.server.receive_consistency(r, signed, min_contributors=min_contributors)
        responses = []
        for i, _, _ in request.signatures:
            if i in offline or i in drop_before_unmask:
                continue
            self._count(i, down=request)
            responses.append(self.clients[i].unmask(request, min_contributors=min_contributors))
            self._count(i, up=responses[-1])
        self.exchanges += 1
        return self.server.finish(r, responses)

    def check(self, r: int, checks: Mapping[int, object], *, skip: Collection[int] = ()):
        """The consistency exchange by hand (tests): every client in ``checks`` but ``skip`` signs; returns
        the server's unmask request."""
        signed = [self.clients[i].consistency(req) for i, req in checks.items() if i not in skip]
        return self.server.receive_consistency(r, signed)
