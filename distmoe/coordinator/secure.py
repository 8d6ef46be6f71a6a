"""The secure form of the ``Aggregator``: every reply of every phase is one secure sum, opened through the release
table.

Owns: the dispatch of a round's ``SumRequest`` to its release module (``distmoe.privacy.releases.RELEASES``: the
layout, DP event, decoding and bound check of ``update``, ``stats`` and ``eval`` releases, the same modules the
parties encode with), the public facts a release is opened with (``ServerFacts``: roster size, threshold, round,
the model's shapes, the round's U1 key material for the canary seed, the epsilon spent), and the release entry in
the coordinator's ledger with its survivors, DP parameters and the release's info (a rejected sum is logged with
its reason and not applied; its privacy cost is spent). The round itself (setup, masked input, the privacy gate,
unmasking) is ``distmoe.coordinator.secagg.SecureRounds``.

Must not: see any party's individual reply (only ``SecureRounds``' sums), branch on the release kind (the table
does), or import ``flwr``.
"""

from __future__ import annotations

from distmoe.coordinator.aggregator import Aggregator, Skip, SumRequest
from distmoe.coordinator.secagg import SecureRounds, SecureSum
from distmoe.privacy.releases import RELEASES
from distmoe.privacy.releases.base import ServerFacts


class SecureAggregator(Aggregator):
    def __init__(self, co, transport, guard, rounds: SecureRounds):
        super().__init__(co, transport, guard)
        self.rounds = rounds

    def facts(self) -> ServerFacts:
        """The public facts this round's release is opened with (``distmoe.privacy.releases.base``)."""
        co, sec = self.co, self.rounds
        srv = sec.server
        return ServerFacts(privacy=co.cfg.privacy, max_eval_examples=co.cfg.data.max_eval_examples, plan=sec.plan,
                           n=len(sec.roster), t=sec.threshold, rnd=co.s.round, shapes=co.tspec.shapes,
                           layers=co.mspec.num_moe_layers, experts=co.mspec.num_experts,
                           round_keys=lambda: (srv.params.run_id, srv.round_keys(co.s.round)), epsilon=sec.epsilon)

    def collect(self, instr, req: SumRequest):
        """The round's one secure sum of the release ``req`` asks for (``RELEASES``), opened, checked, logged."""
        co, rnd, release = self.co, self.co.s.round, RELEASES[req.sum]
        prep = release.prepare(self.facts(), req.kind, req.release, instr)
        res = self.rounds.round(rnd, req.kind, instr, req.release, prep.length, prep.event_at, bits=prep.bits,
                                probe=req.probe)
        self.probes = self.rounds.probes  # carried on the masked inputs, whatever the sum's fate
        if res is None:
            return Skip(f"no secure sum this round: {release.UNCHANGED}")
        opened = prep.open(res)
        for text in opened.warnings:
            co.say(text, wrapped=True)  # the release's warnings (e.g. the row-noise check)
        self._log(res, req.kind, req.release, opened.dp, opened.problem, **opened.info)
        if opened.privacy and any((co.record.get("privacy") or {}).get(k) != v for k, v in opened.privacy.items()):
            co.record.update(privacy={**(co.record.get("privacy") or {}), **opened.privacy})  # the report's scales
        return opened.result

    def _log(self, res: SecureSum, phase: str, release: str, dp: dict | None, problem: str | None, **info) -> None:
        self.guard.log_release(rnd=self.co.s.round, phase=phase, release=release, total=res.total, dp=dp,
                               info={"mode": "secagg", "release": release, "included": list(res.included),
                                     "dropped": list(res.dropped), "responders": list(res.responders), **info,
                                     "applied": problem is None, **({"rejected": problem} if problem else {})},
                               verdict="accepted" if problem is None else f"rejected: {problem}")
        if problem is not None:
            what = {"router-stats": "router statistics", "eval": "evaluation numbers"}.get(release, release)
            self.co.say(f"round {self.co.s.round}: the secure sum of {what} is rejected: {problem}")
