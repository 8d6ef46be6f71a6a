"""The masking stage of a SecAgg client: the round's masked input ``y = x + PRG(b) + sum_v ±PRG(s_uv) mod 2^bits``,
its contributor-bit shares, and the mask expanded ahead of the input (``premask``) (Bonawitz et al., CCS 2017 §4,
MaskedInputCollection).

Owns: the input checks (length, ring width, integers in the ring), the mask terms of the round (the self mask and
one pairwise mask per live peer of the round's graph, signed by id order), consuming the round's secrets once
the masked input is computed, and the contributor-bit shares sent with it.

Must not: import ``flwr``, do I/O, or answer a round twice (the difference of two masked inputs under the same masks
is the difference of the inputs). Used as a base of ``SecAggClient`` (``client.py``), whose state it reads.
"""

from __future__ import annotations

import numpy as np

from distmoe.privacy.secagg import primitives as P
from distmoe.privacy.secagg import shamir
from distmoe.privacy.secagg.errors import (
    DuplicateClient,
    KeySubstitution,
    ListedAsDead,
    ProtocolViolation,
    SecAggAbort,
    TamperedShare,
    TooFewSurvivors,
)
from distmoe.privacy.secagg.messages import (
    CountShare,
    EncryptedShares,
    MaskedInput,
    RoundStart,
)
from distmoe.privacy.secagg.rounds import ClientRound, Phase, PreMask, terms_digest


class Masking:
    """The masking-stage methods of ``SecAggClient``."""

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
        return PreMask(start.round, bits, terms_digest(terms), words)

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

    def _count_shares(self, st: ClientRound, contributed: bool) -> tuple[CountShare, ...]:
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

    def _mask(self, st: ClientRound, start: RoundStart, x: np.ndarray, consume: bool = False,
              premask: PreMask | None = None) -> np.ndarray:
        r = st.round
        terms, held, u1, length, bits = self._terms(st, start)
        v_arr = self._check_input(x, r, length, bits, consume)
        # y = x + PRG(b) + sum_{v>u} PRG(s_uv) - sum_{v<u} PRG(s_uv)  mod 2^bits (this round's bits), all [length]
        # expanded chunk by chunk into y itself (a fresh copy of x, or x when consumed), no per-mask vector
        if premask is None:
            y = P.combine_masks(v_arr, terms, bits, threads=P.MASK_THREADS)
        else:
            if (premask.round, premask.bits, premask.digest) != (r, bits, terms_digest(terms)):
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

    def _terms(self, st: ClientRound, start: RoundStart):
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
