"""The server side of the secure aggregation.

Owns: the run's key directory, the share keys collected for upcoming rounds, the survivor sets of each
round (U1 shared keys, U2 sent a masked input, U2' signed U2 in the consistency check, U3 answered the
unmask request), the relay of the contributor-bit shares and the check of the signed contributor count
(the same check every client makes before it unmasks), Shamir reconstruction
of the survivors' self-mask seeds and the dropped parties' mask keys, and the exact sum of the U2
inputs mod 2^bits. Malformed or duplicate client messages are rejected (that client counts as dropped
at that stage, the reason is kept in ``rejected``); only a shortfall below the threshold, or a
reconstruction that fails its commitment, aborts the round.
The consistency and unmask stages (the signatures, the contributor count, reconstruction and the sum) are
:mod:`~distmoe.privacy.secagg.server_unmask`, a base of ``SecAggServer``.

Must not: import ``flwr``, see any individual input, or ask a client for both shares of a peer (the
clients enforce it anyway). Hand-written on ``cryptography`` rather than Flower's SecAgg+ workflow,
which needs the legacy ``LegacyContext``, fails a round on a dropout before key sharing, and lets
metrics and ``num_examples`` travel in the clear (``docs/privacy.md`` §9).

State: ``to_state()`` / ``SecAggServer.from_state(params, blob)`` survive a ServerApp restart at any
point between stage calls.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from distmoe.privacy.secagg import primitives as P
from distmoe.privacy.secagg import shamir
from distmoe.privacy.secagg import state as S
from distmoe.privacy.secagg.errors import (
    BelowThreshold,
    KeySubstitution,
    ProtocolViolation,
    RepeatedRequest,
    StateCorrupt,
    StateError,
    StateMismatch,
)
from distmoe.privacy.secagg.graph import PeerGraph, check_graph, complete_graph, holders_of
from distmoe.privacy.secagg.messages import (
    ConsistencyRequest,
    CountShare,
    EncryptedShares,
    KeyAdvert,
    KeyDirectory,
    MaskedInput,
    RoundStart,
    SecAggParams,
    ShareKeys,
)
from distmoe.privacy.secagg.server_unmask import ServerUnmasking


@dataclass
class _ServerRound:
    round: int
    u1: tuple[int, ...]
    s_pk: dict[int, bytes]
    commits: dict[int, bytes]
    stage: str = "masked"  # masked -> consistency -> unmask -> done
    u2: tuple[int, ...] = ()
    acc: np.ndarray | None = None  # [length] running sum of the masked inputs
    length: int = 0  # this round's vector length
    bits: int = 64  # this round's ring Z_{2^bits} (<= params.bits)
    inbox: dict[int, list[CountShare]] | None = None  # recipient -> count shares from U2 (consistency stage)
    signatures: tuple[tuple[int, bytes, bytes], ...] = ()  # (signer, share-sum, signature), unmask stage
    contributors: int = -1  # sum_{u in U2} c_u, once the signatures are checked


class SecAggServer(ServerUnmasking):
    def __init__(self, params: SecAggParams, *, peers: PeerGraph = complete_graph):
        self.params = params
        self._graph = peers
        self._keys: dict[int, bytes] | None = None
        self._sig_keys: dict[int, bytes] = {}
        self._holders: dict[int, frozenset[int]] = {}
        self._pending: dict[int, dict[int, ShareKeys]] = {}  # round -> sender -> share keys
        self._rounds: dict[int, _ServerRound] = {}
        self._last_begun: int | None = None
        self.rejected: dict[tuple[int, int], str] = {}  # (round, client) -> reason; round -1 = setup

    @property
    def roster(self) -> tuple[int, ...]:
        return tuple(sorted(self._keys or ()))

    def round_keys(self, round_: int) -> tuple[tuple[int, bytes], ...]:
        """Round ``round_``'s U1 as ``(node id, s_pk)`` sorted by id: the public material every party's
        ``RoundStart`` listed (kept until the round's state is dropped)."""
        if round_ not in self._rounds:
            raise StateError(f"no state for round {round_}")
        return tuple(sorted(self._rounds[round_].s_pk.items()))

    def has_share_keys(self, round_: int) -> frozenset[int]:
        """Clients whose share keys for ``round_`` are held (they will be in U1)."""
        return frozenset(self._pending.get(round_, ()))

    # ---- persistence --------------------------------------------------------------------------
    def to_state(self) -> bytes:
        """Everything the server holds, as a versioned, deterministic blob (canonical JSON in a
        checksummed envelope, ``secagg.state``; no pickle), to survive a ServerApp restart.

        It holds no party's secret, but it holds the running sum of masked inputs and the encrypted
        shares in transit: keep it with the run's server state, not in public artefacts. Save it after
        every stage call and before sending what the call returned."""
        rounds = []
        for r in sorted(self._rounds):
            rs = self._rounds[r]
            acc = None if rs.acc is None else S.b64(rs.acc.astype(rs.acc.dtype.newbyteorder("<")).tobytes())
            rounds.append({"round": rs.round, "u1": list(rs.u1), "stage": rs.stage, "u2": list(rs.u2),
                           "length": rs.length, "bits": rs.bits,
                           "s_pk": [[v, S.b64(k)] for v, k in sorted(rs.s_pk.items())],
                           "commits": [[v, S.b64(k)] for v, k in sorted(rs.commits.items())], "acc": acc,
                           "inbox": None if rs.inbox is None else [
                               [e.sender, e.recipient, S.b64(e.nonce), S.b64(e.ciphertext)]
                               for u in sorted(rs.inbox) for e in rs.inbox[u]],
                           "signatures": [[v, S.b64(a), S.b64(b)] for v, a, b in rs.signatures],
                           "contributors": rs.contributors})
        pending = [[r, [[v, _share_keys_json(m)] for v, m in sorted(by.items())]]
                   for r, by in sorted(self._pending.items())]
        body = {
            "kind": "server", "params": S.params_json(self.params),
            "keys": None if self._keys is None else [[v, S.b64(k)] for v, k in sorted(self._keys.items())],
            "sig_keys": [[v, S.b64(k)] for v, k in sorted(self._sig_keys.items())],
            "graph": S.holders_digest({u: tuple(sorted(h)) for u, h in self._holders.items()}),
            "pending": pending, "rounds": rounds, "last_begun": self._last_begun,
            "rejected": [[r, c, why] for (r, c), why in self.rejected.items()],
        }
        return S.seal_state(S.KIND_SERVER, body)

    @classmethod
    def from_state(cls, params: SecAggParams, data: bytes, *, peers: PeerGraph = complete_graph) -> SecAggServer:
        """Restore a server saved by ``to_state``. Raises ``StateCorrupt`` for a torn or altered blob,
        ``StateMismatch`` for another run, other parameters, another peer graph or a client blob."""
        body = S.open_state(data, S.KIND_SERVER)
        S.check_params(body.get("params"), params, "server")
        try:
            return cls._restore(params, body, peers)
        except StateError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StateCorrupt(f"server state: malformed content ({type(exc).__name__})") from None

    @classmethod
    def _restore(cls, params: SecAggParams, body: dict, peers: PeerGraph) -> SecAggServer:
        srv = cls(params, peers=peers)
        if body["keys"] is not None:
            srv._keys = {S.as_int(v): S.unb64(k, P.KEY_BYTES) for v, k in body["keys"]}
            roster = tuple(sorted(srv._keys))
            srv._holders = {u: frozenset(holders_of(peers, u, roster)) for u in roster}
            srv._sig_keys = {S.as_int(v): S.unb64(k, P.KEY_BYTES) for v, k in body["sig_keys"]}
            if srv._sig_keys.keys() != srv._keys.keys():
                raise StateCorrupt("server state: signing keys do not match the roster")
        if S.holders_digest({u: tuple(sorted(h)) for u, h in srv._holders.items()}) != body["graph"]:
            raise StateMismatch("server state was saved under another peer graph")
        for r, by in body["pending"]:
            srv._pending[S.as_int(r)] = {S.as_int(v): _share_keys_from(m) for v, m in by}
        for d in body["rounds"]:
            acc = None
            length = S.as_int(d["length"])
            bits = S.as_int(d.get("bits", params.bits))
            if not 1 <= length <= params.length:
                raise ValueError("round length")
            if not 1 <= bits <= params.bits:
                raise ValueError("round bits")
            dt = P.word_dtype(bits)
            if d["acc"] is not None:
                raw = S.unb64(d["acc"], length * dt.itemsize)
                acc = np.frombuffer(raw, dtype=dt.newbyteorder("<")).astype(dt)
            if d["stage"] not in ("masked", "consistency", "unmask", "done"):
                raise ValueError("unknown round stage")
            rs = _ServerRound(S.as_int(d["round"]), S.ints(d["u1"]),
                              {S.as_int(v): S.unb64(k, P.KEY_BYTES) for v, k in d["s_pk"]},
                              {S.as_int(v): S.unb64(k, 32) for v, k in d["commits"]}, d["stage"], S.ints(d["u2"]), acc,
                              length, bits)
            if (rs.stage in ("consistency", "unmask")) != (acc is not None):
                raise StateCorrupt("server state: a running sum at the wrong stage")
            if d["inbox"] is not None:
                rs.inbox = {u: [] for u in rs.u2}
                for snd, rcp, nonce, ct in d["inbox"]:
                    rs.inbox[S.as_int(rcp)].append(CountShare(S.as_int(snd), S.as_int(rcp), rs.round, S.unb64(nonce),
                                                              S.unb64(ct)))
            rs.signatures = tuple((S.as_int(v), S.unb64(a, shamir.SHARE_BYTES), S.unb64(b, P.SIG_BYTES))
                                  for v, a, b in d["signatures"])
            rs.contributors = S.as_int(d["contributors"], -1)
            srv._rounds[rs.round] = rs
        srv._last_begun = None if body["last_begun"] is None else S.as_int(body["last_begun"])
        for r, c, why in body["rejected"]:
            if not isinstance(why, str):
                raise TypeError("rejection reason")
            srv.rejected[(S.as_int(r, -1), S.as_int(c))] = why
        return srv

    def _reject(self, r: int, cid: int, why: str) -> None:
        self.rejected.setdefault((r, cid), why)

    # ---- stage 0: setup -----------------------------------------------------------------------
    def register(self, adverts: Iterable[KeyAdvert]) -> KeyDirectory:
        if self._keys is not None:
            raise RepeatedRequest("setup: keys were already registered for this run")
        keys: dict[int, bytes] = {}
        sig_keys: dict[int, bytes] = {}
        for a in adverts:
            if a.sender in keys:
                self._reject(-1, a.sender, "second key advert")
                continue
            keys[a.sender], sig_keys[a.sender] = a.c_pk, a.sig_pk
        if len(set(keys.values())) != len(keys) or len(set(sig_keys.values())) != len(sig_keys):
            raise KeySubstitution("setup: two clients advertised the same key")
        t = self.params.threshold
        if len(keys) < t:
            raise BelowThreshold(f"setup: {len(keys)} clients advertised keys, below threshold t = {t}")
        roster = tuple(sorted(keys))
        check_graph(self._graph, roster, t)
        self._keys, self._sig_keys = keys, sig_keys
        self._holders = {u: frozenset(holders_of(self._graph, u, roster)) for u in roster}
        return KeyDirectory(self.params.run_id, tuple((u, keys[u]) for u in roster),
                            tuple((u, sig_keys[u]) for u in roster))

    def required_signatures(self) -> int:
        """As ``SecAggClient.required_signatures``: max(t, n // 2 + 1) over the run's roster."""
        return max(self.params.threshold, len(self._keys or ()) // 2 + 1)

    # ---- stage 1: share keys ------------------------------------------------------------------
    def add_share_keys(self, msgs: Iterable[ShareKeys]) -> None:
        if self._keys is None:
            raise ProtocolViolation("share keys before setup")
        for m in msgs:
            if why := self._share_keys_problem(m):
                self._reject(m.round, m.sender, why)
                continue
            self._pending.setdefault(m.round, {})[m.sender] = m

    def _share_keys_problem(self, m: ShareKeys) -> str | None:
        if m.sender not in self._keys:
            return "not in the run"
        if self._last_begun is not None and m.round <= self._last_begun:
            return f"share keys for round {m.round}, which has already begun"
        if m.sender in self._pending.get(m.round, {}):
            return "second share keys for the round"
        if any(e.sender != m.sender or e.round != m.round for e in m.shares):
            return "an envelope with a wrong sender or round"
        recipients = [e.recipient for e in m.shares]
        if sorted(recipients) != sorted(self._holders[m.sender] - {m.sender}):
            return "envelopes not addressed to exactly its peers"
        return None

    def begin_round(self, r: int, length: int | None = None, bits: int | None = None) -> dict[int, RoundStart]:
        """Close U1 for round ``r`` and build each participant's ``RoundStart``; ``length``: this round's
        vector length (default ``params.length``, at most that); ``bits``: this round's ring width (the
        release's declared word size, default ``params.bits``, at most that)."""
        if self._keys is None:
            raise ProtocolViolation("round before setup")
        bits = self.params.bits if bits is None else bits
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= self.params.bits:
            raise ValueError(f"round {r}: bits {bits!r} outside [1, params.bits = {self.params.bits}]")
        length = self.params.length if length is None else length
        if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= self.params.length:
            raise ValueError(f"round {r}: length {length!r} outside [1, params.length = {self.params.length}]")
        if self._last_begun is not None and r <= self._last_begun:
            raise RepeatedRequest(f"round {r}: rounds must increase (last begun: {self._last_begun})")
        for old in [k for k in self._pending if k < r]:
            del self._pending[old]
        for old in [k for k in self._rounds if k < r - 1]:
            del self._rounds[old]
        pend = self._pending.pop(r, {})
        t = self.params.threshold
        u1 = set(pend)
        changed = True
        while changed:  # with a sparse graph a participant needs t holders in U1 to be recoverable
            changed = False
            for u in sorted(u1):
                if len(self._holders[u] & u1) < t:
                    u1.discard(u)
                    self._reject(r, u, "fewer than t of its holders shared keys")
                    changed = True
        self._last_begun = r
        if len(u1) < t:
            raise BelowThreshold(f"round {r}, share keys: {len(pend)} clients shared keys ({len(u1)} with t holders "
                                 f"among them), below threshold t = {t}")
        order = tuple(sorted(u1))
        participants = tuple((v, pend[v].s_pk) for v in order)
        inbox: dict[int, list[EncryptedShares]] = {u: [] for u in order}
        for v in order:
            for e in pend[v].shares:
                if e.recipient in u1:
                    inbox[e.recipient].append(e)
        self._rounds[r] = _ServerRound(r, order, {v: pend[v].s_pk for v in order},
                                       {v: pend[v].b_commit for v in order}, length=length, bits=bits)
        return {u: RoundStart(r, u, participants, tuple(sorted(inbox[u], key=lambda e: e.sender)), length, bits)
                for u in order}

    # ---- stage 2: masked input ----------------------------------------------------------------
    def receive_masked(self, r: int, msgs: Iterable[MaskedInput]) -> dict[int, ConsistencyRequest]:
        """Sum the masked inputs (U2), store piggybacked share keys, return the consistency request of
        every member of U2 (U2 and the count shares addressed to it by the other members of U2)."""
        rs = self._stage(r, "masked")
        p = self.params
        bits = rs.bits
        dt = P.word_dtype(bits)
        n = rs.length
        acc = np.zeros(n, dtype=dt)  # [length]
        got: list[int] = []
        nxt: list[ShareKeys] = []
        counts: list[CountShare] = []
        for m in msgs:
            why = None
            if m.round != r or m.sender not in rs.u1:
                why = "not a participant of the round"
            elif m.sender in got:
                why = "second masked input"
            elif m.y.shape != (n,) or m.y.dtype != dt:
                why = f"masked input of shape {m.y.shape} {m.y.dtype}, expected ({n},) {dt}"
            elif bits not in (32, 64) and int(m.y.max()) > P.ring_mask(bits):
                why = f"masked input outside Z_2^{bits}"
            elif m.next_keys is not None and (m.next_keys.sender != m.sender or m.next_keys.round != r + 1):
                why = "piggybacked share keys of another client or round"
            elif any(e.sender != m.sender or e.round != r for e in m.count_shares):
                why = "a count share with a wrong sender or round"
            elif sorted(e.recipient for e in m.count_shares) != sorted(set(self._keys) - {m.sender}):
                why = "count shares not addressed to exactly the other parties of the run"
            if why:
                self._reject(r, m.sender, why)
                continue
            acc += m.y
            got.append(m.sender)
            counts.extend(m.count_shares)
            if m.next_keys is not None:
                nxt.append(m.next_keys)
        self.add_share_keys(nxt)
        t = p.threshold
        if len(got) < t:
            rs.stage = "done"
            raise BelowThreshold(f"round {r}, masked input: {len(got)} masked inputs, below threshold t = {t}")
        rs.u2, rs.acc, rs.stage = tuple(sorted(got)), acc, "consistency"
        rs.inbox = {u: [] for u in rs.u2}
        for e in counts:
            if e.recipient in rs.inbox:
                rs.inbox[e.recipient].append(e)
        return {u: ConsistencyRequest(r, u, rs.u2, tuple(sorted(rs.inbox[u], key=lambda e: e.sender)))
                for u in rs.u2}

    # ---- stage 3: consistency check (Bonawitz et al. CCS 2017 §4) -----------------------------

    def _stage(self, r: int, stage: str) -> _ServerRound:
        rs = self._rounds.get(r)
        if rs is None:
            raise ProtocolViolation(f"round {r} was not begun")
        if rs.stage != stage:
            raise RepeatedRequest(f"round {r}: {stage} stage requested while the round is at '{rs.stage}'")
        return rs


def _share_keys_json(m: ShareKeys) -> dict:
    return {"sender": m.sender, "round": m.round, "s_pk": S.b64(m.s_pk), "b_commit": S.b64(m.b_commit),
            "shares": [[e.recipient, S.b64(e.nonce), S.b64(e.ciphertext)] for e in m.shares]}


def _share_keys_from(d: dict) -> ShareKeys:
    sender, r = S.as_int(d["sender"]), S.as_int(d["round"])
    shares = tuple(EncryptedShares(sender, S.as_int(h), r, S.unb64(n), S.unb64(ct)) for h, n, ct in d["shares"])
    return ShareKeys(sender, r, S.unb64(d["s_pk"]), S.unb64(d["b_commit"]), shares)
