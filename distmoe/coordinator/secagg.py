"""The coordinator's side of secure aggregation over a transport: setup once per run, then one secure
sum per round, with the privacy gate before anything is unmasked.

Owns: the ``SecAggServer`` of the run (state in ``<run>/privacy/secagg-server.state``), the run's
roster (the parties that completed setup) and names, the server's per-party accountants
(``<run>/privacy/ledger.json``), and the order of a round:

1. ``begin_round``: RoundStart for every party that shared keys (U1); the others get the instruction
   without one and answer with share keys for the next round (they rejoin there);
2. exchange 1: phase instruction down, masked input (+ next round's share keys) up;
3. gate: at least ``privacy.min-parties`` masked inputs;
4. exchange 2, the consistency check (Bonawitz et al. CCS 2017 §4): the survivor set U2 and the
   contributor-bit shares down to each survivor, a signed share of the contributor count up; the round
   is refused (recorded in ``ledger.json`` under ``refused``, nothing unmasked) when fewer than
   ``privacy.min-parties`` survivors contributed data, or too few signed;
5. gate: for a DP release no included party's budget exceeded at the survivors' ``z_eff`` (else the run
   stops before unmasking: the sum stays masked, nothing is released);
6. exchange 3: unmask request with the signatures to the signers, shares up, ``finish`` -> the sum of
   U2's inputs. Every party checks the signatures and the count itself before it reveals a share.

A round that cannot complete (below the threshold at any stage, a corrupt share) releases nothing
and the model or anchor stays unchanged; the next round starts from whoever shared keys for it.

Resume: a restarted coordinator calls ``restore_accountants`` (the accountants in ``ledger.json`` are
the latest ones and are never rolled back, even when the model falls back to an older checkpoint:
privacy spent stays spent), then ``setup`` again with fresh SecAgg keys, ``first_round`` = the next
round and the setup ``epoch`` of this resume; the ``SetupRequest`` names the logical run so that each
party continues its own accountant (``distmoe.party.session``).

The protocol's math (key agreement, masks, Shamir shares, the server state machine) is
``distmoe.privacy.secagg``; this module only drives it over the transport.

Must not: see any individual input, import ``flwr``, or read party data.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from distmoe.config import RunConfig
from distmoe.coordinator.errors import PrivacyStop
from distmoe.io import write_json_atomic, write_text_atomic
from distmoe.privacy import secagg as sa
from distmoe.privacy.accountant import Accountant, BudgetExceeded, PrivacyEvent
from distmoe.privacy.plan import PrivacyPlan, threshold_for
from distmoe.rundir import MissingRunFile, RunDir, RunFileError, read_json
from distmoe.wire.allow_list import ProbeBounds
from distmoe.wire.schema import (
    ConsistencyRequestMsg,
    ConsistencyResponseMsg,
    DirectoryRequest,
    KeyAdvertReply,
    MaskedReply,
    SecureInstruction,
    SetupRequest,
    ShareKeysReply,
    UnmaskRequestMsg,
    UnmaskResponseMsg,
)


@dataclass
class SecureSum:
    total: np.ndarray  # [length] uint32/uint64 (the release's ring): the sum of the included parties' inputs
    included: tuple[str, ...]
    dropped: tuple[str, ...]
    responders: tuple[str, ...]
    n_active: int
    contributors: int = 0  # survivors whose input held any of their data (securely counted)


class SecureRounds:
    def __init__(self, cfg: RunConfig, plan: PrivacyPlan, transport, run_dir: Path, say: Callable[[str], None],
                 report_errors: Callable[[str, dict[int, str]], None]):
        self.cfg, self.plan, self.transport = cfg, plan, transport
        self.files = RunDir(run_dir)  # privacy/ledger.json (the accountants) and privacy/secagg-server.state
        self.say, self.report_errors = say, report_errors
        self.server: sa.SecAggServer | None = None
        self.roster: tuple[int, ...] = ()
        self.threshold = 0
        self.accountants: dict[str, Accountant] = {}
        self.refused: list[dict] = []  # rounds refused by the contributor count (ledger.json "refused")
        self.caps: dict[str, float] = {}  # party -> its declared epsilon-max (node config), from its key advert
        self.probes: dict = {}  # node -> the routing probe carried beside its masked input in the last round

    @property
    def names(self) -> dict[int, str]:
        return self.transport.guard.names

    def name(self, node: int) -> str:
        return self.transport.guard.peer(node)

    # ------------------------------------------------------------------ setup
    def restore_accountants(self) -> dict[str, Accountant]:
        """Load the per-party accountants of an interrupted run from ``privacy/ledger.json`` (before ``setup``)."""
        path = self.files.accounts
        try:
            d = read_json(path, "the server's privacy ledger")
        except MissingRunFile:
            raise PrivacyStop(f"{path} is missing: the privacy spent before the restart is unknown, so the run "
                              "cannot resume (it never resets an accountant)") from None
        except RunFileError as exc:
            raise PrivacyStop(f"{path} {exc.why}: the privacy spent before the restart is unknown, so the run cannot "
                              "resume") from None
        try:
            self.accountants = {str(k): Accountant.from_state_dict(v) for k, v in d["parties"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise PrivacyStop(f"{path} is unreadable ({type(exc).__name__}: {exc}): the privacy spent before the "
                              "restart is unknown, so the run cannot resume") from None
        return self.accountants

    def setup(self, nodes: list[int], max_length: int, *, first_round: int = 1, logical_run: str = "",
              epoch: int = 0) -> None:
        p, timeout = self.cfg.privacy, self.cfg.federation.setup_timeout
        t = threshold_for(len(nodes), p.min_parties, p.secagg_graph)
        params = sa.SecAggParams(os.urandom(16), t, 64, max_length)
        self.server = sa.SecAggServer(params, peers=sa.peer_graph(p.secagg_graph, params.run_id, len(nodes)))
        self.threshold = t
        req = SetupRequest(params.run_id, t, max_length, len(nodes), self.plan.noise_multiplier,
                           self.plan.update_noise_multiplier, logical_run, epoch)
        replies, errors = self.transport.exchange({n: req for n in nodes}, KeyAdvertReply, timeout, rnd=0,
                                                  phase="setup")
        self.report_errors("setup", errors)
        self.caps = {self.name(n): float(r.epsilon_max) for n, r in replies.items() if r.epsilon_max > 0}
        self._check_caps()
        adverts = [sa.KeyAdvert(n, r.c_pk, r.sig_pk) for n, r in replies.items()]
        try:
            directory = self.server.register(adverts)
        except sa.SecAggAbort as exc:
            raise PrivacyStop(f"secure-aggregation setup failed: {exc} ({len(adverts)} of {len(nodes)} parties "
                              f"answered; threshold t = {t})") from None
        roster = self.server.roster
        names = tuple((n, self.name(n)) for n in roster)
        replies, errors = self.transport.exchange({n: DirectoryRequest(directory, first_round, names) for n in roster},
                                                  ShareKeysReply, timeout, rnd=0, phase="setup")
        self.report_errors("setup", errors)
        self.server.add_share_keys([r.keys for r in replies.values()])
        self.roster = roster
        for n in roster:  # the server accounts each party against its own budget: min(privacy.epsilon, its cap)
            budget = min(p.epsilon, self.caps.get(self.name(n), p.epsilon))
            self.accountants.setdefault(self.name(n), Accountant(p.delta, budget))
        self._save()
        left = sorted(set(nodes) - set(roster))
        self.say(f"secure aggregation: {len(roster)} parties in the run, threshold t = {t}, "
                 f"{len(replies)} shared keys for round {first_round}"
                 + (f"; left out (no key advert): {left}" if left else ""))

    def _check_caps(self) -> None:
        """Refuse to start a schedule that a party's declared cap (node config ``epsilon-max``, sent in its
        key advert) cannot cover: that party would refuse every release over its cap (a statistics release
        with no anchor built, the rounds after it with no keys) and the run would go on with nothing
        released. Raised before any directory or data-bearing message is sent."""
        planned = self.plan.planned_epsilon
        short = {party: cap for party, cap in sorted(self.caps.items()) if cap < planned * (1 - 1e-9)}
        if short:
            who = "; ".join(f"party {party} declares epsilon-max = {cap:g}" for party, cap in short.items())
            p = self.plan
            raise PrivacyStop(
                f"{who}, below the planned epsilon {planned:.4f} of this schedule ({p.stats_releases} router-"
                f"statistics, {p.update_releases} update and {p.eval_releases} evaluation release(s) at "
                f"privacy.epsilon = {p.epsilon:g}, delta = {p.delta:g}): that party would refuse its releases, so "
                f"the run does not start; set privacy.epsilon to at most {min(short.values()):g} (the noise is "
                "derived from it) or ask the data owner to raise its cap")

    def _save(self) -> None:
        write_text_atomic(self.files.secagg_state, self.server.to_state())
        write_json_atomic(self.files.accounts, {
            "epsilon_budget": self.cfg.privacy.epsilon, "delta": self.cfg.privacy.delta, "plan": self.plan.as_dict(),
            "threshold": self.threshold, "roster": [self.name(n) for n in self.roster],
            "parties": {k: a.state_dict() for k, a in sorted(self.accountants.items())},
            "epsilon": {k: {"prv": a.epsilon()[0], "rdp": a.epsilon()[1]} for k, a in sorted(self.accountants.items())},
            "refused": self.refused,
        })

    # ------------------------------------------------------------------ one round
    def round(self, rnd: int, phase: str, instr: object, release: str, length: int,
              dp_event: Callable[[int], PrivacyEvent] | None = None, *, bits: int = 64,
              probe: ProbeBounds | None = None) -> SecureSum | None:
        """One secure sum in Z_2^bits (the release's declared width, sent in every ``RoundStart``);
        ``dp_event(n_active)`` gives the release's event at ``n_active`` survivors (None: not a DP
        release). Returns None when the round released nothing. ``probe``: the instruction carries the routing
        probe (the bounds each reply's must meet); the probes that came beside the masked inputs are in ``probes``."""
        timeout = self.cfg.federation.round_timeout
        try:
            starts = self.server.begin_round(rnd, length, bits)
        except sa.BelowThreshold as exc:
            starts = {}
            self.say(f"round {rnd}: too few parties shared keys ({exc}); collecting keys for the next round")
        msgs = {n: SecureInstruction(instr, starts.get(n), release) for n in self.roster}
        replies, errors = self.transport.exchange(msgs, MaskedReply, timeout, rnd=rnd, phase=phase,
                                                  lengths={n: length for n in starts}, probe=probe)
        self.probes = {n: r.probe for n, r in replies.items() if r.probe is not None}  # in the clear: public inputs
        self.report_errors(phase, errors)
        masked = [r.masked for r in replies.values() if r.masked is not None]
        self.server.add_share_keys([r.late_keys for r in replies.values() if r.late_keys is not None])
        if not starts:
            self._save()
            return None
        try:
            checks = self.server.receive_masked(rnd, masked)
        except sa.SecAggAbort as exc:
            self._save()
            self.say(f"round {rnd}: nothing released: {exc}")
            return None
        n_active, mp = len(checks), self.cfg.privacy.min_parties
        included = tuple(self.name(n) for n in sorted(checks))
        if n_active < mp:
            self._save()
            self.say(f"round {rnd}: only {n_active} masked inputs, below privacy.min-parties = {mp}: not unmasked, "
                     "nothing released")
            return None
        request = self._consistency(rnd, phase, release, checks)
        if request is None:
            return None
        if dp_event is not None:
            ev = dp_event(n_active)
            for party in included:
                acc = self.accountants[party]
                if acc.would_exceed(ev):
                    self._save()
                    raise PrivacyStop(f"round {rnd}: releasing {release} would exceed party {party}'s privacy "
                                      f"budget privacy.epsilon = {acc.epsilon_budget:g} (now "
                                      f"{acc.primary_epsilon():.3f}, after {acc.epsilon_after(ev):.3f}); the sum "
                                      "was not unmasked and the run stops here")
        signers = [v for v, _, _ in request.signatures]
        replies, errors = self.transport.exchange({n: UnmaskRequestMsg(request) for n in signers},
                                                  UnmaskResponseMsg, self.cfg.federation.unmask_timeout, rnd=rnd,
                                                  phase=phase)
        self.report_errors(f"{phase} unmask", errors)
        try:
            res = self.server.finish(rnd, [r.response for r in replies.values()])
        except sa.SecAggAbort as exc:
            self._save()
            self.say(f"round {rnd}: unmasking failed, nothing released: {exc}")
            return None
        if dp_event is not None:
            ev = dp_event(n_active)
            for party in included:
                try:
                    self.accountants[party].spend(ev)
                except BudgetExceeded as exc:  # checked above; only a race could get here
                    raise PrivacyStop(str(exc)) from None
        self._save()
        return SecureSum(res.total, included, tuple(self.name(n) for n in res.dropped),
                         tuple(self.name(n) for n in res.responders), n_active, res.contributors)

    def _consistency(self, rnd: int, phase: str, release: str, checks: dict) -> sa.UnmaskRequest | None:
        """Exchange 2: each survivor signs U2 with its share of the contributor count. None (nothing is
        unmasked) when too few signed, or fewer than ``privacy.min-parties`` survivors contributed data:
        that refusal is recorded in ``ledger.json`` (``refused``) with the count, never with who."""
        mp = self.cfg.privacy.min_parties
        replies, errors = self.transport.exchange({n: ConsistencyRequestMsg(q) for n, q in checks.items()},
                                                  ConsistencyResponseMsg, self.cfg.federation.unmask_timeout,
                                                  rnd=rnd, phase=phase)
        self.report_errors(f"{phase} consistency", errors)
        try:
            return self.server.receive_consistency(rnd, [r.response for r in replies.values()], min_contributors=mp)
        except sa.TooFewContributors:
            k = self.server.contributors(rnd)
            self.refused.append({"round": rnd, "release": release, "reason": "too-few-contributors",
                                 "contributors": k, "survivors": len(checks), "min_parties": mp})
            self._save()
            self.say(f"round {rnd}: {release} refused: {k} of the {len(checks)} survivors contributed data, below "
                     f"privacy.min-parties = {mp}; not unmasked, nothing released")
        except sa.SecAggAbort as exc:
            self._save()
            self.say(f"round {rnd}: consistency check failed, nothing released: {exc}")
        return None

    def epsilon(self) -> dict[str, dict[str, float]]:
        return {k: {"prv": a.epsilon()[0], "rdp": a.epsilon()[1]} for k, a in sorted(self.accountants.items())}
