"""The consistency and unmask stages of a SecAgg client: the signature over the survivor set U2, the contributor
count, and the reveal of exactly one share per peer (Bonawitz et al., CCS 2017 §4, ConsistencyCheck and Unmasking).

Owns: signing one U2 per round, checking enough valid signatures over that same U2 (``required_signatures``), the
contributor count sum_{u in U2} c_u that must reach ``min_contributors``, and the rule that a peer's self-mask
share (a survivor) and mask-key share (a dropped peer) are never both revealed.

Must not: import ``flwr``, do I/O, or trust the server's lists. Used as a base of ``SecAggClient`` (``client.py``),
whose state it reads.
"""

from __future__ import annotations

from distmoe.privacy.secagg import primitives as P
from distmoe.privacy.secagg import shamir
from distmoe.privacy.secagg.errors import (
    AlreadyDead,
    BothSharesRequested,
    ConsistencyFailure,
    DuplicateClient,
    InconsistentLists,
    ListedAsDead,
    ProtocolViolation,
    SecAggAbort,
    StateCorrupt,
    TamperedShare,
    TooFewContributors,
    TooFewSurvivors,
)
from distmoe.privacy.secagg.messages import (
    ConsistencyRequest,
    ConsistencyResponse,
    CountShare,
    UnmaskRequest,
    UnmaskResponse,
)
from distmoe.privacy.secagg.rounds import ClientRound, Phase


class Unmasking:
    """The consistency- and unmask-stage methods of ``SecAggClient``."""

    def required_signatures(self) -> int:
        """Valid signatures over one survivor set needed before this client unmasks: max(t, n // 2 + 1)
        for the n parties of the pinned directory (= t with the complete graph, where 2t > n). Honest
        clients sign one set per round, so no two different sets can both reach this."""
        return max(self.params.threshold, len(self._roster or ()) // 2 + 1)

    def consistency(self, request: ConsistencyRequest) -> ConsistencyResponse:
        """Check the survivor set U2 against this client's U1, sum the contributor-bit shares of U2 (a share
        of sum_{u in U2} c_u: Shamir shares are linear) and sign (run, round, self, U2, share-sum). Answered
        at most once per round."""
        st = self._state(request.round, Phase.MASKED, "consistency")
        try:
            resp = self._consistency(st, request)
        except SecAggAbort:
            self._abort(st)
            raise
        st.phase = Phase.CHECKED
        st.own_count = None
        return resp

    def _consistency(self, st: ClientRound, req: ConsistencyRequest) -> ConsistencyResponse:
        p, r = self.params, st.round
        if req.recipient != self.cid:
            raise ProtocolViolation(f"round {r}: consistency request addressed to client {req.recipient}")
        self._check_ids(req.survivors, r, "survivor list")
        u2, u1 = frozenset(req.survivors), frozenset(st.u1)
        if self.cid not in u2:
            raise ListedAsDead(f"round {r}, consistency: the survivor list omits client {self.cid}")
        if stray := sorted(u2 - u1):
            raise InconsistentLists(f"round {r}, consistency: survivor(s) {stray} were not participants")
        if len(u2 & set(self._holders)) < p.threshold:
            raise TooFewSurvivors(f"round {r}, consistency: {len(u2 & set(self._holders))} survivors among this "
                                  f"client's holders, below threshold t = {p.threshold}")
        if len(u2) < (need := self.required_signatures()):
            raise TooFewSurvivors(f"round {r}, consistency: {len(u2)} survivors, below the {need} signatures "
                                  "the consistency check needs")
        got: dict[int, CountShare] = {}
        for e in req.count_shares:
            if e.recipient != self.cid or e.round != r:
                raise ProtocolViolation(f"round {r}: a count share for client {e.recipient} round {e.round}")
            if e.sender in got:
                raise DuplicateClient(f"round {r}: two count shares from client {e.sender}")
            if e.sender not in u2 or e.sender == self.cid:
                raise ProtocolViolation(f"round {r}: count share from client {e.sender}, not another survivor")
            got[e.sender] = e
        if missing := sorted(u2 - got.keys() - {self.cid}):
            raise ProtocolViolation(f"round {r}: no count share from survivor(s) {missing}")
        total = st.own_count
        if total is None:
            raise StateCorrupt(f"round {r}: this client's own count share is missing")
        for v in sorted(got):
            e = got[v]
            key = P.count_key(p.run_id, r, v, self.cid, self._c_sk, self._roster[v])
            pt = P.open_sealed(key, e.nonce, e.ciphertext, P.count_ad(p.run_id, r, v, self.cid))
            if pt is None:
                raise TamperedShare(f"round {r}: the count share from client {v} failed authentication", sender=v,
                                    round=r)
            try:
                total = (total + shamir.decode_share(pt)) % shamir.PRIME
            except ValueError as exc:
                raise ProtocolViolation(f"round {r}: malformed count share from client {v}: {exc}") from None
        st.u2, st.share_sum = tuple(sorted(u2)), total
        enc = shamir.encode_share(total)
        sig = P.sign(self._sig_sk, P.consistency_message(p.run_id, r, self.cid, st.u2, enc))
        return ConsistencyResponse(self.cid, r, enc, sig)

    # ---- stage 4: unmask ----------------------------------------------------------------------
    def unmask(self, request: UnmaskRequest, *, min_contributors: int = 0) -> UnmaskResponse:
        """Reveal one share per peer, only after the consistency check: the request names exactly the U2
        this client signed, carries at least ``required_signatures`` valid signatures over it, and the
        contributor count interpolated from the signed share-sums is at least ``min_contributors``."""
        st = self._state(request.round, Phase.CHECKED, "unmask")
        try:
            resp = self._unmask(st, request, min_contributors)
        except SecAggAbort:
            self._abort(st)
            raise
        st.phase = Phase.DONE
        st.wipe()
        return resp

    def contributors(self, req: UnmaskRequest, u2: tuple[int, ...]) -> int:
        """Check the signatures of ``req`` over ``u2`` and return sum_{u in U2} c_u; ``ConsistencyFailure``
        otherwise (missing, forged, repeated, over another set, too few, or share-sums off one polynomial)."""
        p, r, t = self.params, req.round, self.params.threshold
        points: dict[int, int] = {}
        for signer, share_sum, sig in req.signatures:
            if signer not in self._sig_keys:
                raise ConsistencyFailure(f"round {r}, consistency: a signature of client {signer}, not in this run")
            if shamir.holder_x(signer) in points:
                raise ConsistencyFailure(f"round {r}, consistency: client {signer} signs twice")
            if signer not in u2:
                raise ConsistencyFailure(f"round {r}, consistency: a signature of client {signer}, not a survivor")
            if not P.verify(self._sig_keys[signer], sig, P.consistency_message(p.run_id, r, signer, u2, share_sum)):
                raise ConsistencyFailure(f"round {r}, consistency: the signature of client {signer} does not verify "
                                         "over this round's survivor set (forged, or signed over another set)")
            try:
                points[shamir.holder_x(signer)] = shamir.decode_share(share_sum)
            except ValueError as exc:
                raise ConsistencyFailure(f"round {r}, consistency: share-sum of client {signer}: {exc}") from None
        if len(points) < (need := self.required_signatures()):
            raise ConsistencyFailure(f"round {r}, consistency: {len(points)} valid signatures over the survivor set, "
                                     f"{need} needed")
        xs = sorted(points)
        base = [(x, points[x]) for x in xs[:t]]
        for x in xs[t:]:  # more than t: all on one polynomial of degree t - 1
            if shamir.interpolate(base, x) != points[x]:
                raise ConsistencyFailure(f"round {r}, consistency: the signed share-sums do not lie on one "
                                         f"polynomial of degree {t - 1}")
        count = shamir.interpolate(base, 0)
        if count > len(u2):
            raise ConsistencyFailure(f"round {r}, consistency: the contributor count is not in [0, {len(u2)}]")
        return count

    def _consistency_gate(self, st: ClientRound, req: UnmaskRequest, min_contributors: int) -> None:
        """The consistency check before any share leaves (the defence the split-view tests exercise)."""
        r, alive = st.round, tuple(sorted(req.alive))
        if alive != st.u2:
            raise ConsistencyFailure(f"round {r}, consistency: the unmask request's survivor set differs from the "
                                     f"one this client signed ({len(alive)} vs {len(st.u2)} parties): a split view")
        count = self.contributors(req, st.u2)
        if count < min_contributors:
            raise TooFewContributors(f"round {r}, unmask: {count} of the {len(st.u2)} survivors contributed data, "
                                     f"below privacy.min-parties = {min_contributors}: nothing is unmasked")

    def _unmask(self, st: ClientRound, req: UnmaskRequest, min_contributors: int) -> UnmaskResponse:
        r, t = st.round, self.params.threshold
        self._check_ids(req.alive, r, "alive list")
        self._check_ids(req.dead, r, "dead list")
        alive, dead, u1 = frozenset(req.alive), frozenset(req.dead), frozenset(st.u1)
        if both := sorted(alive & dead):
            raise BothSharesRequested(f"round {r}, unmask: the server asks for both shares of client(s) {both}")
        if self.cid in dead or self.cid not in alive:
            raise ListedAsDead(f"round {r}, unmask: the server lists client {self.cid} as dropped")
        if earlier := sorted(dead - u1):
            raise AlreadyDead(f"round {r}, unmask: client(s) {earlier} listed as dropped in this round, but they "
                              "never shared keys in it (already dead)")
        if stray := sorted(alive - u1):
            raise InconsistentLists(f"round {r}, unmask: client(s) {stray} listed as alive, but not participants")
        if unlisted := sorted(u1 - alive - dead):
            raise InconsistentLists(f"round {r}, unmask: participant(s) {unlisted} are neither alive nor dead")
        holders = u1 & set(self._holders)
        my_alive = sorted(holders & alive)
        my_dead = sorted(holders - alive)  # computed here from U1, never taken from the server
        if len(my_alive) < t:
            raise TooFewSurvivors(f"round {r}, unmask: {len(my_alive)} survivors among this client's holders, "
                                  f"below threshold t = {t}")
        self._consistency_gate(st, req, min_contributors)
        enc = shamir.encode_share
        return UnmaskResponse(self.cid, r, tuple((v, enc(st.held[v][0])) for v in my_alive),
                              tuple((v, enc(st.held[v][1])) for v in my_dead))

    # ---- helpers ------------------------------------------------------------------------------
