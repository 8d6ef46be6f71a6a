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

import enum
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from distmoe.privacy.secagg import primitives as P
from distmoe.privacy.secagg import shamir
from distmoe.privacy.secagg import state as S
from distmoe.privacy.secagg.errors import (
    AlreadyDead,
    BothSharesRequested,
    ConsistencyFailure,
    DuplicateClient,
    InconsistentLists,
    KeySubstitution,
    ListedAsDead,
    ProtocolViolation,
    RepeatedRequest,
    RepeatedUnmask,
    SecAggAbort,
    StateCorrupt,
    StateError,
    StateMismatch,
    TamperedShare,
    TooFewContributors,
    TooFewSurvivors,
    UnknownClient,
)
from distmoe.privacy.secagg.graph import PeerGraph, check_holders, complete_graph, holders_of
from distmoe.privacy.secagg.messages import (
    ConsistencyRequest,
    ConsistencyResponse,
    CountShare,
    EncryptedShares,
    KeyAdvert,
    KeyDirectory,
    MaskedInput,
    RoundStart,
    SecAggParams,
    ShareKeys,
    UnmaskRequest,
    UnmaskResponse,
)


class Phase(enum.Enum):
    SHARED = "shared"
    MASKED = "masked"
    CHECKED = "checked"
    DONE = "done"
    ABORTED = "aborted"


@dataclass
class _Round:
    round: int
    s_sk: bytes  # this round's mask key (wiped once the masked input is computed)
    s_pk: bytes
    b: bytes  # this round's self-mask seed (wiped once the masked input is computed)
    phase: Phase = Phase.SHARED
    u1: tuple[int, ...] = ()  # participants as the server announced them in RoundStart
    held: dict[int, tuple[int, int]] = field(default_factory=dict)  # owner -> (b-share, s-share)
    own_count: int | None = None  # this client's share of its own contributor bit (until the consistency stage)
    u2: tuple[int, ...] = ()  # the survivor set this client signed (consistency stage)
    share_sum: int | None = None  # its share of sum_{u in U2} c_u

    def wipe(self) -> None:
        self.s_sk = self.b = b""
        self.held.clear()
        self.own_count = None


@dataclass(frozen=True)
class PreMask:
    """A round's combined mask, expanded ahead of the input (``SecAggClient.premask``): ``words`` ``[length]``
    in Z_2^bits; ``digest`` binds it to the round's mask terms (keys and signs), so ``masked_input`` can check
    that it is the mask that round needs."""

    round: int
    bits: int
    digest: bytes
    words: np.ndarray


def _terms_digest(terms: list[tuple[bytes, int]]) -> bytes:
    h = hashlib.sha256(b"distmoe-premask")
    for key, sign in terms:
        h.update(key + sign.to_bytes(1, "big", signed=True))
    return h.digest()


class SecAggClient:
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
        self._rounds: dict[int, _Round] = {}
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
            st = _Round(S.as_int(d["round"]), S.unb64(d["s_sk"], secret_len), S.unb64(d["s_pk"], P.KEY_BYTES),
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
        st = _Round(round_, s_sk, s_pk, b, held={self.cid: (b_sh[own], s_sh[own])})
        self._rounds[round_] = st
        commit = P.commit(b, P.b_commit_ctx(p.run_id, round_, self.cid))
        return ShareKeys(self.cid, round_, s_pk, commit, tuple(out))

    # ---- stage 2: masked input ----------------------------------------------------------------
    def premask(self, start: RoundStart) -> PreMask | None:
        """This round's combined mask ``M = PRG(b) + sum_{v>u} PRG(s_uv) - sum_{v<u} PRG(s_uv)  mod 2^bits``
        (``[length]`` words), expanded before the input exists: it does not depend on it, so a party can expand
        it on a spare core while it trains, and ``masked_input(..., premask=M)`` then costs one add. Reads this
        round's state and changes nothing (safe in a second thread while the caller trains); None where the
        start would not be accepted (``masked_input`` without it raises the reason and aborts the round)."""
        try:
            st = self._state(start.round, Phase.SHARED, "premask")
            terms, _held, _u1, length, bits = self._terms(st, start)
        except SecAggAbort:
            return None
        words = np.empty(length, P.word_dtype(bits))  # [length]
        threads = max(1, P.MASK_THREADS - 1)  # the caller's work keeps one core
        P.combine_masks(words, [(terms[0][0], 0), *terms[1:]], bits, threads=threads)
        return PreMask(start.round, bits, _terms_digest(terms), words)

    def masked_input(self, start: RoundStart, x: np.ndarray, *, share_next: bool = True,
                     contributed: bool = True, consume: bool = False, premask: PreMask | None = None
                     ) -> MaskedInput:
        """``x``: ``[start.length]`` integers in [0, 2^bits), ``bits`` = ``start.bits`` or ``params.bits``
        (``distmoe.privacy.ring.encode_fixed``/``to_ring`` in that width). With
        ``share_next`` the share keys of round + 1 ride along, so the next round needs no extra
        exchange. ``contributed``: whether ``x`` holds any of this party's data (its contributor bit c_u,
        Shamir-shared to every other member of U1, encrypted under the pairwise c-keys). ``consume``: the
        caller hands ``x`` over; when it already is a writeable contiguous array of the ring's words it is
        masked in place and returned as ``y`` (no copy of the vector, and the unmasked words are gone from
        memory once masked); otherwise, and by default, ``x`` is left untouched. ``premask``: this round's
        ``premask(start)``, added instead of expanding the masks here (the same words; one computed for
        another round or start is refused with ``ValueError``)."""
        st = self._state(start.round, Phase.SHARED, "masked input")
        try:
            y = self._mask(st, start, x, consume, premask)
        except SecAggAbort:
            self._abort(st)
            raise
        counts = self._count_shares(st, bool(contributed))
        nxt = self.share_keys(start.round + 1) if share_next else None
        return MaskedInput(self.cid, start.round, y, nxt, counts)

    def _count_shares(self, st: _Round, contributed: bool) -> tuple[CountShare, ...]:
        """Shares of c_u in {0, 1} on a random polynomial of degree t - 1, one per party of the pinned
        directory (all of them, not only the peer-graph holders or this round's U1 as the server announced
        it: the count must be interpolable from any t survivors, whatever U1 the server tells whom)."""
        p, r = self.params, st.round
        roster = sorted(self._roster)
        xs = [shamir.holder_x(v) for v in roster]
        sh = shamir.split_int(int(contributed), xs, p.threshold, self._rng)
        out = []
        for v in roster:
            if v == self.cid:
                continue
            key = P.count_key(p.run_id, r, self.cid, v, self._c_sk, self._roster[v])
            nonce, ct = P.seal(key, shamir.encode_share(sh[shamir.holder_x(v)]), P.count_ad(p.run_id, r, self.cid, v),
                               self._rng)
            out.append(CountShare(self.cid, v, r, nonce, ct))
        st.own_count = sh[shamir.holder_x(self.cid)]
        return tuple(out)

    def _mask(self, st: _Round, start: RoundStart, x: np.ndarray, consume: bool = False,
              premask: PreMask | None = None) -> np.ndarray:
        r = st.round
        terms, held, u1, length, bits = self._terms(st, start)
        v_arr = self._check_input(x, r, length, bits, consume)
        # y = x + PRG(b) + sum_{v>u} PRG(s_uv) - sum_{v<u} PRG(s_uv)  mod 2^bits (this round's bits), all [length]
        # expanded chunk by chunk into y itself (a fresh copy of x, or x when consumed), no per-mask vector
        if premask is None:
            y = P.combine_masks(v_arr, terms, bits, threads=P.MASK_THREADS)
        else:
            if (premask.round, premask.bits, premask.digest) != (r, bits, _terms_digest(terms)):
                raise ValueError(f"round {r}: a premask computed for another round, width or participant list")
            if premask.words.shape != (length,) or premask.words.dtype != P.word_dtype(bits):
                raise ValueError(f"round {r}: premask of {premask.words.shape} {premask.words.dtype} words")
            y = np.add(v_arr, premask.words, out=v_arr)  # mod 2^word: the masks were expanded ahead of x
            if bits not in (32, 64):
                y &= y.dtype.type(P.ring_mask(bits))
        st.held.update(held)
        st.u1 = tuple(sorted(u1))
        st.phase = Phase.MASKED
        st.s_sk = st.b = b""  # only the shares are needed from here on
        return y

    def _terms(self, st: _Round, start: RoundStart):
        """Check a round start against this round's state; decrypt the shares it carries. Returns (mask terms
        ``[(key, sign)]``, self mask first; the decrypted shares by sender; U1; length; bits). Changes nothing."""
        p, r = self.params, st.round
        if start.recipient != self.cid:
            raise ProtocolViolation(f"round {r}: round start addressed to client {start.recipient}")
        ids = [v for v, _ in start.participants]
        self._check_ids(ids, r, "participant list")
        s_pks = dict(start.participants)
        if self.cid not in s_pks:
            raise ListedAsDead(f"round {r}: the participant list omits client {self.cid}")
        if s_pks[self.cid] != st.s_pk:
            raise KeySubstitution(f"round {r}: the participant list holds a wrong mask key for client {self.cid}")
        u1 = frozenset(ids)
        mine = u1 & set(self._holders)
        if len(mine) < p.threshold:
            raise TooFewSurvivors(f"round {r}, masked input: {len(mine)} of this client's holders shared keys, "
                                  f"below threshold t = {p.threshold}")
        expected = mine - {self.cid}
        got: dict[int, EncryptedShares] = {}
        for e in start.shares:
            if e.recipient != self.cid or e.round != r:
                raise ProtocolViolation(f"round {r}: a share envelope for client {e.recipient} round {e.round}")
            if e.sender in got:
                raise DuplicateClient(f"round {r}: two share envelopes from client {e.sender}")
            if e.sender not in expected:
                raise ProtocolViolation(f"round {r}: share envelope from client {e.sender}, not a participating peer")
            got[e.sender] = e
        if missing := sorted(expected - got.keys()):
            raise ProtocolViolation(f"round {r}: no share envelope from participating peer(s) {missing}")
        length = start.length or p.length
        if not 1 <= length <= p.length:
            raise ProtocolViolation(f"round {r}: round length {length} outside [1, {p.length}] (params.length)")
        bits = start.bits or p.bits
        if not 1 <= bits <= p.bits:
            raise ProtocolViolation(f"round {r}: ring width {bits} outside [1, {p.bits}] (params.bits)")
        held = {}
        for v in sorted(got):  # decrypt everything before any mask is computed
            e = got[v]
            key = P.share_key(p.run_id, r, v, self.cid, self._c_sk, self._roster[v])
            pt = P.open_sealed(key, e.nonce, e.ciphertext, P.share_ad(p.run_id, r, v, self.cid, s_pks[v]))
            if pt is None:
                raise TamperedShare(f"round {r}: the encrypted share from client {v} failed authentication "
                                    "(tampered, misaddressed, or its mask key was swapped)", sender=v, round=r)
            try:
                held[v] = (shamir.decode_share(pt[:shamir.SHARE_BYTES]), shamir.decode_share(pt[shamir.SHARE_BYTES:]))
            except ValueError as exc:
                raise ProtocolViolation(f"round {r}: malformed share from client {v}: {exc}") from None
        terms = [(P.self_mask_key(p.run_id, r, self.cid, st.b), 1)]
        terms += [(P.pair_mask_key(p.run_id, r, self.cid, v, st.s_sk, s_pks[v]), 1 if v > self.cid else -1)
                  for v in sorted(mine - {self.cid})]
        return terms, held, u1, length, bits

    def _check_input(self, x: np.ndarray, r: int, length: int, bits: int, consume: bool = False) -> np.ndarray:
        x = np.asarray(x)
        if x.shape != (length,) or not np.issubdtype(x.dtype, np.integer):
            raise ValueError(f"round {r}: input must be [{length}] integers, got {x.shape} {x.dtype}")
        full = bits in (32, 64) and x.dtype == P.word_dtype(bits)  # every word is in range: no pass needed
        if x.size and not full and (int(x.min()) < 0 or int(x.max()) > P.ring_mask(bits)):
            raise ValueError(f"round {r}: input outside [0, 2^{bits}); encode with ring.encode_fixed/to_ring")
        if consume and full and x.flags.c_contiguous and x.flags.writeable:
            return x  # [length] the caller's own array: masked in place
        return np.array(x, dtype=P.word_dtype(bits), order="C", copy=True)  # [length], becomes y in place

    # ---- stage 3: consistency check (Bonawitz et al. CCS 2017 §4) ------------------------------
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

    def _consistency(self, st: _Round, req: ConsistencyRequest) -> ConsistencyResponse:
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

    def _consistency_gate(self, st: _Round, req: UnmaskRequest, min_contributors: int) -> None:
        """The consistency check before any share leaves (the defence the split-view tests exercise)."""
        r, alive = st.round, tuple(sorted(req.alive))
        if alive != st.u2:
            raise ConsistencyFailure(f"round {r}, consistency: the unmask request's survivor set differs from the "
                                     f"one this client signed ({len(alive)} vs {len(st.u2)} parties): a split view")
        count = self.contributors(req, st.u2)
        if count < min_contributors:
            raise TooFewContributors(f"round {r}, unmask: {count} of the {len(st.u2)} survivors contributed data, "
                                     f"below privacy.min-parties = {min_contributors}: nothing is unmasked")

    def _unmask(self, st: _Round, req: UnmaskRequest, min_contributors: int) -> UnmaskResponse:
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
    def _state(self, r: int, expect: Phase, stage: str) -> _Round:
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

    def _abort(self, st: _Round) -> None:
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
