"""The consistency and unmask stages of the SecAgg server: collecting the signatures over U2 and the contributor
count, then reconstructing the survivors' self-mask seeds and the dropped parties' mask keys and removing every
mask: the exact sum of the U2 inputs mod 2^bits (Bonawitz et al., CCS 2017 §4, ConsistencyCheck and Unmasking).

Owns: the check of the signed contributor count (the same check every client makes before it unmasks), Shamir
reconstruction with its commitment check, and the final sum.

Must not: import ``flwr``, see any individual input, or ask a client for both shares of a peer. Used as a base of
``SecAggServer`` (``server.py``), whose state it reads.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from distmoe.privacy.secagg import primitives as P
from distmoe.privacy.secagg import shamir
from distmoe.privacy.secagg.errors import (
    BelowThreshold,
    ConsistencyFailure,
    ReconstructionFailed,
    TooFewContributors,
)
from distmoe.privacy.secagg.messages import (
    AggregateResult,
    ConsistencyResponse,
    UnmaskRequest,
    UnmaskResponse,
)


class ServerUnmasking:
    """The consistency- and unmask-stage methods of ``SecAggServer``."""

    def receive_consistency(self, r: int, msgs: Iterable[ConsistencyResponse], *,
                            min_contributors: int = 0) -> UnmaskRequest:
        """Keep the valid signatures over U2 (a bad one counts as a dropout at this stage), interpolate the
        contributor count sum_{u in U2} c_u from the signed share-sums, and return the unmask request (it
        goes to the signers, ``request.signatures``). Raises ``BelowThreshold`` with too few signatures and
        ``TooFewContributors`` below ``min_contributors``: the round ends, nothing is asked for."""
        rs = self._stage(r, "consistency")
        p, t = self.params, self.params.threshold
        sigs: dict[int, tuple[int, bytes, bytes]] = {}
        for m in msgs:
            why = None
            if m.round != r or m.sender not in rs.u2:
                why = "consistency response from a non-survivor"
            elif m.sender in sigs:
                why = "second consistency response"
            elif not P.verify(self._sig_keys[m.sender], m.signature,
                              P.consistency_message(p.run_id, r, m.sender, rs.u2, m.share_sum)):
                why = "a signature that does not verify over the survivor set"
            else:
                try:
                    shamir.decode_share(m.share_sum)
                except ValueError:
                    why = "a share-sum outside the field"
            if why:
                self._reject(r, m.sender, why)
                continue
            sigs[m.sender] = (m.sender, m.share_sum, m.signature)
        rs.inbox = None
        need = self.required_signatures()
        if len(sigs) < need:
            rs.stage, rs.acc = "done", None
            raise BelowThreshold(f"round {r}, consistency: {len(sigs)} signatures over the survivor set, {need} needed")
        rs.signatures = tuple(sigs[v] for v in sorted(sigs))
        pts = sorted((shamir.holder_x(v), shamir.decode_share(s)) for v, s, _ in rs.signatures)
        base = pts[:t]
        if any(shamir.interpolate(base, x) != y for x, y in pts[t:]) or (
                count := shamir.interpolate(base, 0)) > len(rs.u2):
            rs.stage, rs.acc = "done", None
            raise ConsistencyFailure(f"round {r}, consistency: the signed share-sums do not give one contributor count "
                                     "(a corrupt share-sum)")
        rs.contributors = count
        if count < min_contributors:
            rs.stage, rs.acc = "done", None
            raise TooFewContributors(f"round {r}: {count} of the {len(rs.u2)} survivors contributed data, below "
                                     f"privacy.min-parties = {min_contributors}: the sum is not unmasked")
        rs.stage = "unmask"
        return UnmaskRequest(r, alive=rs.u2, dead=tuple(sorted(set(rs.u1) - set(rs.u2))), signatures=rs.signatures)

    def contributors(self, r: int) -> int:
        """sum_{u in U2} c_u of round ``r`` once its signatures were checked (-1 before)."""
        rs = self._rounds.get(r)
        return -1 if rs is None else rs.contributors

    # ---- stage 4: unmask ----------------------------------------------------------------------
    def finish(self, r: int, responses: Iterable[UnmaskResponse]) -> AggregateResult:
        """Reconstruct b of every U2 member and s_sk of every dropped participant, remove the masks."""
        rs = self._stage(r, "unmask")
        p, t = self.params, self.params.threshold
        alive, dead = frozenset(rs.u2), frozenset(rs.u1) - frozenset(rs.u2)
        b_pts: dict[int, dict[int, int]] = {v: {} for v in alive}  # owner -> {x: share}
        s_pts: dict[int, dict[int, int]] = {v: {} for v in dead}
        signers = {v for v, _, _ in rs.signatures}
        responders: list[int] = []
        for m in responses:
            if m.round != r or m.sender not in alive or m.sender not in signers:
                self._reject(r, m.sender, "unmask response from a non-survivor (or a survivor that did not sign)")
                continue
            if m.sender in responders:
                self._reject(r, m.sender, "second unmask response")
                continue
            mine = self._holders[m.sender] & frozenset(rs.u1)
            ob, os_ = [o for o, _ in m.b_shares], [o for o, _ in m.s_shares]
            if sorted(ob) != sorted(mine & alive) or sorted(os_) != sorted(mine & dead):
                self._reject(r, m.sender, "unmask response with the wrong set of shares")
                continue
            try:
                decoded = [(o, shamir.decode_share(s), b_pts) for o, s in m.b_shares]
                decoded += [(o, shamir.decode_share(s), s_pts) for o, s in m.s_shares]
            except ValueError as exc:
                self._reject(r, m.sender, f"malformed share: {exc}")
                continue
            x = shamir.holder_x(m.sender)
            for owner, y, table in decoded:
                table[owner][x] = y
            responders.append(m.sender)
        rs.stage = "done"
        if len(responders) < t:
            raise BelowThreshold(f"round {r}, unmask: {len(responders)} unmask responses, below threshold t = {t}")
        terms: list[tuple[bytes, int]] = []  # every mask to remove, checked before any is expanded
        for v in sorted(alive):  # remove self masks of the survivors
            b = self._reconstruct(r, v, b_pts[v], "self-mask seed")
            if P.commit(b, P.b_commit_ctx(p.run_id, r, v)) != rs.commits[v]:
                raise ReconstructionFailed(f"round {r}: the self-mask seed of client {v} does not match its "
                                           "commitment (a corrupt share)", owner=v, round=r)
            terms.append((P.self_mask_key(p.run_id, r, v, b), -1))
        for v in sorted(dead):  # remove the pairwise masks survivors hold with dropped participants
            sk = self._reconstruct(r, v, s_pts[v], "mask key")
            if P.public_from_private(sk) != rs.s_pk[v]:
                raise ReconstructionFailed(f"round {r}: the mask key of client {v} does not match its public key "
                                           "(a corrupt share)", owner=v, round=r)
            for u in sorted(alive & self._holders[v]):  # y_u carried +PRG(s_uv) for v > u, -PRG(s_uv) for v < u
                terms.append((P.pair_mask_key(p.run_id, r, u, v, sk, rs.s_pk[u]), -1 if v > u else 1))
        total = np.ascontiguousarray(rs.acc)
        rs.acc = None
        P.combine_masks(total, terms, rs.bits, threads=P.MASK_THREADS)  # in place, chunk by chunk
        return AggregateResult(r, total, rs.u2, tuple(sorted(dead)), tuple(sorted(responders)), rs.contributors)

    def _reconstruct(self, r: int, owner: int, pts: dict[int, int], what: str) -> bytes:
        t = self.params.threshold
        if len(pts) < t:
            raise BelowThreshold(f"round {r}, unmask: {len(pts)} shares of client {owner}'s {what}, "
                                 f"below threshold t = {t}")
        secret = shamir.reconstruct(pts, t)
        if secret is None:
            raise ReconstructionFailed(f"round {r}: shares of client {owner}'s {what} do not interpolate to a "
                                       "32-byte secret (a corrupt share)", owner=owner, round=r)
        return secret
