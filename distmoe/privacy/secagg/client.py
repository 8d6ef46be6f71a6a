"""The client state machine of the secure aggregation.

Owns: a client's secrets (the run's share-encryption key c_sk, each round's mask key s_sk and
self-mask seed b), the shares it holds for its peers, and every check it makes before answering the
server: it computes the dropped set itself from the participant list it saw, never reveals both
shares of one peer, answers each stage of a round at most once, and aborts (``SecAggAbort``) when the
server's lists are inconsistent or leave fewer than t parties. Before it reveals any share it runs the
consistency check of Bonawitz et al. (CCS 2017 §4, ConsistencyCheck): it signs the survivor set U2 it
was told (once per round, with its run's Ed25519 key, pinned by every party in the key directory) and
reveals shares only for that same U2 and only with enough valid signatures over it from other
survivors (``required_signatures``); the same signatures carry shares of the round's contributor count
sum_{u in U2} c_u, which must reach the caller's ``min_contributors``.
Where: the key setup, key sharing, the saved state and the checks every stage shares are here; the masking
stage is :mod:`~distmoe.privacy.secagg.masking`, the consistency and unmask stages
:mod:`~distmoe.privacy.secagg.unmasking` (the bases of ``SecAggClient``), the per-round state
:mod:`~distmoe.privacy.secagg.rounds`.

Must not: import ``flwr``, do I/O, trust the server's lists, send a second masked input or second
share set for one round (the difference of two masked inputs under the same masks is the difference
of the inputs), or keep a round's secrets after it ends. Hand-written on ``cryptography`` rather than
Flower's SecAgg+ because Flower's client answers an unmask request that lists a peer as both alive
and dead (revealing that peer's vector), seeds its masks with 32 bits, and cannot recover from a
dropout before key sharing (``docs/privacy.md`` §9).

State between messages: ``to_state()`` / ``SecAggClient.from_state(params, blob)`` (a Flower SuperNode
runs every message in a new process: ``docs/architecture.md`` §1). The blob is secret material.

Per-round states: SHARED (after ``share_keys``) -> MASKED (after ``masked_input``) -> CHECKED (after
``consistency``) -> DONE (after ``unmask``); any abort moves the round to ABORTED, after which nothing
more is answered for it.

Why a signature round: without it a server can tell client A that v dropped (A reveals v's s_sk share)
and client B that v survived (B reveals v's b share); with t of each it unmasks y_v completely. An
honest client signs one U2 per round, and a set needs ``required_signatures`` >= max(t, n/2 + 1) of
them, so two different sets cannot both collect enough.
"""

from __future__ import annotations

from collections.abc import Iterable

from distmoe.privacy.secagg import primitives as P
from distmoe.privacy.secagg import shamir
from distmoe.privacy.secagg import state as S
from distmoe.privacy.secagg.errors import (
    DuplicateClient,
    KeySubstitution,
    ProtocolViolation,
    RepeatedRequest,
    RepeatedUnmask,
    StateCorrupt,
    StateError,
    StateMismatch,
    UnknownClient,
)
from distmoe.privacy.secagg.graph import PeerGraph, check_holders, complete_graph, holders_of
from distmoe.privacy.secagg.masking import Masking
from distmoe.privacy.secagg.messages import (
    EncryptedShares,
    KeyAdvert,
    KeyDirectory,
    SecAggParams,
    ShareKeys,
)
from distmoe.privacy.secagg.rounds import ClientRound, Phase
from distmoe.privacy.secagg.unmasking import Unmasking


class SecAggClient(Masking, Unmasking):
    """One party. Methods map 1:1 onto the protocol stages; each returns the message to send."""

    def __init__(self, params: SecAggParams, cid: int, *, peers: PeerGraph = complete_graph,
                 rng: P.RandomBytes | None = None):
        if not 0 <= cid <= P.MAX_ID:
            raise ValueError(f"client id {cid} outside [0, 2^64)")
        self.params = params
        self.cid = cid
        self._graph = peers
        self._rng = rng or P.default_rng()
        self._c_sk: bytes | None = None
        self._c_pk: bytes | None = None
        self._roster: dict[int, bytes] | None = None  # id -> c_pk
        self._sig_sk: bytes | None = None  # this run's Ed25519 signing key (never leaves the client)
        self._sig_pk: bytes | None = None
        self._sig_keys: dict[int, bytes] = {}  # id -> sig_pk, pinned from the accepted directory
        self.fingerprint: str | None = None  # directory_fingerprint of the accepted directory
        self._holders: tuple[int, ...] = ()  # this client and its peers, sorted
        self._peers: frozenset[int] = frozenset()
        self._rounds: dict[int, ClientRound] = {}
        self._used_rounds: set[int] = set()

    # ---- introspection (tests, logs) ----------------------------------------------------------
    def phase(self, round_: int) -> Phase | None:
        st = self._rounds.get(round_)
        return st.phase if st else None

    @property
    def roster(self) -> tuple[int, ...]:
        return tuple(sorted(self._roster or ()))

    # ---- persistence between messages -------------------------------------------------------
    def to_state(self) -> bytes:
        """Everything this client knows, as a versioned, deterministic blob (``secagg.state``: canonical
        JSON in a checksummed envelope, no pickle).

        SECRET MATERIAL: the blob holds the run's share-encryption private key, the current rounds' mask
        private keys and self-mask seeds, and the Shamir shares this client holds for its peers. Keep it
        only in this party's own node state (``context.state``) or work directory; never send it to the
        server or another party, never log it. Save it after every stage call and BEFORE sending the
        reply that call returned (also after a call that raised ``SecAggAbort``): restoring an older
        blob would let this client answer a stage twice (a second masked input under the same masks
        reveals the difference of the two inputs). Rounds that ended keep no secrets in the blob, only
        the fact that they ended.
        """
        rounds = []
        for r in sorted(self._rounds):
            st = self._rounds[r]
            rounds.append({
                "round": st.round, "phase": st.phase.value, "s_sk": S.b64(st.s_sk), "s_pk": S.b64(st.s_pk),
                "b": S.b64(st.b), "u1": list(st.u1), "u2": list(st.u2),
                "own_count": None if st.own_count is None else S.b64(shamir.encode_share(st.own_count)),
                "share_sum": None if st.share_sum is None else S.b64(shamir.encode_share(st.share_sum)),
                "held": [[o, S.b64(shamir.encode_share(bs) + shamir.encode_share(ss))]
                         for o, (bs, ss) in sorted(st.held.items())],
            })
        body = {
            "kind": "client", "params": S.params_json(self.params), "cid": self.cid,
            "c_sk": None if self._c_sk is None else S.b64(self._c_sk),
            "c_pk": None if self._c_pk is None else S.b64(self._c_pk),
            "roster": None if self._roster is None else [[v, S.b64(k)] for v, k in sorted(self._roster.items())],
            "sig_sk": None if self._sig_sk is None else S.b64(self._sig_sk),
            "sig_keys": [[v, S.b64(k)] for v, k in sorted(self._sig_keys.items())],
            "holders": list(self._holders), "used_rounds": sorted(self._used_rounds), "rounds": rounds,
        }
        return S.seal_state(S.KIND_CLIENT, body)

    @classmethod
    def from_state(cls, params: SecAggParams, data: bytes, *, cid: int | None = None,
                   peers: PeerGraph = complete_graph, rng: P.RandomBytes | None = None) -> SecAggClient:
        """Restore a client saved by ``to_state``; every protocol check carries over (rounds answered,
        aborted or closed stay so). ``params`` and ``peers`` must be the run's; ``cid``, when given,
        must be the saved client's. ``rng`` is not state (``os.urandom`` unless a test injects one).

        Raises ``StateCorrupt`` for a torn, truncated or altered blob (checksum or structure) and
        ``StateMismatch`` for an intact blob of another run, other parameters, another client, another
        peer graph or a server. The blob is secret material: see ``to_state``."""
        body = S.open_state(data, S.KIND_CLIENT)
        S.check_params(body.get("params"), params, "client")
        try:
            return cls._restore(params, body, cid, peers, rng)
        except StateError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StateCorrupt(f"client state: malformed content ({type(exc).__name__})") from None

    @classmethod
    def _restore(cls, params: SecAggParams, body: dict, cid: int | None, peers: PeerGraph,
                 rng: P.RandomBytes | None) -> SecAggClient:
        saved = S.as_int(body["cid"])
        if cid is not None and cid != saved:
            raise StateMismatch(f"client state of client {saved}, restored as client {cid}")
        c = cls(params, saved, peers=peers, rng=rng)
        if body["c_sk"] is not None:
            c._c_sk, c._c_pk = S.unb64(body["c_sk"], P.KEY_BYTES), S.unb64(body["c_pk"], P.KEY_BYTES)
            if P.public_from_private(c._c_sk) != c._c_pk:
                raise StateCorrupt("client state: share-encryption key pair does not match")
            c._sig_sk = S.unb64(body["sig_sk"], P.KEY_BYTES)
            c._sig_pk = P.signing_public(c._sig_sk)
        if body["roster"] is not None:
            if c._c_sk is None:
                raise StateCorrupt("client state: a roster without a key")
            c._roster = {S.as_int(v): S.unb64(k, P.KEY_BYTES) for v, k in body["roster"]}
            holders = S.ints(body["holders"])
            if holders_of(peers, saved, tuple(sorted(c._roster))) != holders:
                raise StateMismatch("client state was saved under another peer graph")
            c._holders, c._peers = holders, frozenset(holders) - {saved}
            c._sig_keys = {S.as_int(v): S.unb64(k, P.KEY_BYTES) for v, k in body["sig_keys"]}
            if c._sig_keys.keys() != c._roster.keys() or c._sig_keys[saved] != c._sig_pk:
                raise StateCorrupt("client state: the pinned signing keys do not match the roster")
            c.fingerprint = P.directory_fingerprint(params.run_id, tuple(sorted(c._roster.items())),
                                                    tuple(sorted(c._sig_keys.items())))
        elif body["holders"]:
            raise StateCorrupt("client state: holders without a roster")
        c._used_rounds = set(S.ints(body["used_rounds"]))
        for d in body["rounds"]:
            phase = Phase(d["phase"])
            secret_len = (P.KEY_BYTES,) if phase is Phase.SHARED else (0,)
            st = ClientRound(S.as_int(d["round"]), S.unb64(d["s_sk"], secret_len), S.unb64(d["s_pk"], P.KEY_BYTES),
                        S.unb64(d["b"], (shamir.SECRET_BYTES,) if phase is Phase.SHARED else (0,)), phase,
                        S.ints(d["u1"]), u2=S.ints(d["u2"]))
            for key in ("own_count", "share_sum"):
                if d[key] is not None:
                    setattr(st, key, shamir.decode_share(S.unb64(d[key], shamir.SHARE_BYTES)))
            for o, sh in d["held"]:
                raw = S.unb64(sh, 2 * shamir.SHARE_BYTES)
                st.held[S.as_int(o)] = (shamir.decode_share(raw[:shamir.SHARE_BYTES]),
                                        shamir.decode_share(raw[shamir.SHARE_BYTES:]))
            if st.round in c._rounds or st.round not in c._used_rounds or c._roster is None:
                raise StateCorrupt("client state: a round that was never opened, or listed twice")
            if phase in (Phase.DONE, Phase.ABORTED) and st.held:
                raise StateCorrupt("client state: a closed round still holds shares")
            c._rounds[st.round] = st
        return c

    # ---- stage 0: setup, once per run ---------------------------------------------------------
    def advertise(self) -> KeyAdvert:
        if self._c_sk is not None:
            raise RepeatedRequest("setup: this client already advertised its key for this run")
        self._c_sk, self._c_pk = P.new_keypair(self._rng)
        self._sig_sk, self._sig_pk = P.new_signing_key(self._rng)
        return KeyAdvert(self.cid, self._c_pk, self._sig_pk)

    def receive_directory(self, directory: KeyDirectory) -> None:
        if self._c_sk is None:
            raise ProtocolViolation("setup: key directory received before this client advertised")
        if self._roster is not None:
            raise RepeatedRequest("setup: a second key directory in the same run")
        if directory.run_id != self.params.run_id:
            raise ProtocolViolation("setup: key directory of another run")
        ids = [cid for cid, _ in directory.keys]
        self._no_duplicates(ids, "setup", "key directory")
        keys = dict(directory.keys)
        if keys.get(self.cid) != self._c_pk:
            raise KeySubstitution(f"setup: the directory does not hold client {self.cid}'s own key")
        if len(set(keys.values())) != len(keys):
            raise KeySubstitution("setup: two clients in the directory have the same key")
        sig_ids = [cid for cid, _ in directory.sig_keys]
        self._no_duplicates(sig_ids, "setup", "signing-key directory")
        sig_keys = dict(directory.sig_keys)
        if sig_keys.keys() != keys.keys():
            raise KeySubstitution("setup: the signing-key directory does not name exactly the clients of the run")
        if sig_keys[self.cid] != self._sig_pk:
            raise KeySubstitution(f"setup: the directory does not hold client {self.cid}'s own signing key")
        if len(set(sig_keys.values())) != len(sig_keys):
            raise KeySubstitution("setup: two clients in the directory have the same signing key")
        roster = tuple(sorted(keys))
        holders = holders_of(self._graph, self.cid, roster)
        if not set(holders) <= keys.keys():
            raise ProtocolViolation("setup: the peer graph names clients outside the directory")
        check_holders(self.cid, len(holders), self.params.threshold)
        self._roster, self._holders, self._sig_keys = keys, holders, sig_keys
        self._peers = frozenset(holders) - {self.cid}
        self.fingerprint = P.directory_fingerprint(self.params.run_id, tuple(sorted(keys.items())),
                                                   tuple(sorted(sig_keys.items())))

    # ---- stage 1: share keys (standalone, or piggybacked on the previous masked input) --------
    def share_keys(self, round_: int) -> ShareKeys:
        """Fresh mask key pair and self-mask seed for ``round_``, Shamir-shared to every holder."""
        if self._roster is None or self._c_sk is None:
            raise ProtocolViolation(f"round {round_}: share keys requested before setup finished")
        if round_ in self._used_rounds:
            raise RepeatedRequest(f"round {round_}: this client already generated share keys for it")
        self._used_rounds.add(round_)
        for old in [k for k in self._rounds if k <= round_ - 2]:  # a round two back can no longer finish
            self._rounds.pop(old).wipe()
        p, rng = self.params, self._rng
        s_sk, s_pk = P.new_keypair(rng)
        b = rng(shamir.SECRET_BYTES)
        xs = [shamir.holder_x(h) for h in self._holders]
        b_sh = shamir.split(b, xs, p.threshold, rng)
        s_sh = shamir.split(s_sk, xs, p.threshold, rng)
        out = []
        for h in self._holders:
            if h == self.cid:
                continue
            key = P.share_key(p.run_id, round_, self.cid, h, self._c_sk, self._roster[h])
            x = shamir.holder_x(h)
            pt = shamir.encode_share(b_sh[x]) + shamir.encode_share(s_sh[x])
            nonce, ct = P.seal(key, pt, P.share_ad(p.run_id, round_, self.cid, h, s_pk), rng)
            out.append(EncryptedShares(self.cid, h, round_, nonce, ct))
        own = shamir.holder_x(self.cid)
        st = ClientRound(round_, s_sk, s_pk, b, held={self.cid: (b_sh[own], s_sh[own])})
        self._rounds[round_] = st
        commit = P.commit(b, P.b_commit_ctx(p.run_id, round_, self.cid))
        return ShareKeys(self.cid, round_, s_pk, commit, tuple(out))

    # ---- stage 2: masked input ----------------------------------------------------------------

    def _state(self, r: int, expect: Phase, stage: str) -> ClientRound:
        st = self._rounds.get(r)
        if st is None:
            if r in self._used_rounds:
                raise RepeatedRequest(f"round {r}: {stage} requested for a round this client has closed")
            raise ProtocolViolation(f"round {r}: {stage} requested, but this client holds no keys for it")
        if st.phase is expect:
            return st
        if st.phase is Phase.ABORTED:
            raise ProtocolViolation(f"round {r}: {stage} requested after this client aborted the round")
        if stage == "unmask" and st.phase is Phase.DONE:
            raise RepeatedUnmask(f"round {r}: a second unmask request; this client answers once per round")
        if stage == "unmask" and st.phase is Phase.MASKED:
            raise ProtocolViolation(f"round {r}: unmask requested before this client's consistency check")
        if stage == "unmask":
            raise ProtocolViolation(f"round {r}: unmask requested before this client sent its masked input")
        if stage == "consistency" and st.phase is Phase.SHARED:
            raise ProtocolViolation(f"round {r}: consistency check requested before this client sent its masked input")
        raise RepeatedRequest(f"round {r}: {stage} requested a second time")

    def _abort(self, st: ClientRound) -> None:
        st.phase = Phase.ABORTED
        st.wipe()

    def _no_duplicates(self, ids: Iterable[int], r: int | str, what: str) -> None:
        seen: set[int] = set()
        for v in ids:
            if v in seen:
                raise DuplicateClient(f"round {r}: client {v} appears twice in the {what}")
            seen.add(v)

    def _check_ids(self, ids: Iterable[int], r: int, what: str) -> None:
        ids = list(ids)
        self._no_duplicates(ids, r, what)
        if unknown := sorted(set(ids) - self._roster.keys()):
            raise UnknownClient(f"round {r}: the {what} names client(s) {unknown} that are not in this run")
