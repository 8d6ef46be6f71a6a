"""The coordinator's side of the wire: the inbound guard, the coordinator's ledger entries, and the transport
logic shared by the Flower Grid transport and the in-process one. The run's allow-list it checks against is
``distmoe.wire.allow_list`` (``build_policy``, re-exported here).

Owns:
- ``ServerGuard``: every outbound instruction is encoded, logged, and carries the coordinator's ledger
  head after that entry (``codec.LEDGER_RECORD``: the party records it, so a cut or rewritten
  coordinator ledger no longer holds the heads the parties saw); every inbound reply is checked
  before anything reads it (payload type on the allow-list, keys, required keys, fixed shapes, byte
  budget, no text or bytes outside the protocol's fields, every array header parsed so trailing bytes
  are rejected, finite values, the masked-vector length the round declared, a carried routing probe exactly when the
  instruction asked for one and within its bounds: ``allow_list.check_probe_part``) and logged with the
  sender's ledger head as an anchor. A reply that fails is rejected: logged with the reason, and that
  party is left out of the round.
- ``GuardedTransport``: the coordinator's one transport type, ``exchange`` over any ``_send`` (Grid, in-process); a
  transport may hand each reply to ``_arrived`` as it comes, so that its content checks (``ServerGuard.check``: pure,
  no ledger entry) overlap the wait for the other replies; every reply is logged and acted on only after all are in.
- ``ExchangeMemo``: what the messages of one exchange share, made once (the encoded phase instruction, the digest of
  leading records, the packed weights); ``exchange`` makes one per exchange and passes it down explicitly.

Must not: read party data, or hand a payload to the coordinator that did not pass the guard.
"""

from __future__ import annotations

import abc
import hashlib
import time
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
from flwr.app import RecordDict

from distmoe.ledger import Ledger
from distmoe.wire import codec, inspect, packing
from distmoe.wire.allow_list import (  # noqa: F401  (build_policy, policy_digest: part of the guard's interface)
    ProbeBounds,
    build_policy,
    check_against_policy,
    check_probe_part,
    policy_digest,
)
from distmoe.wire.codec import WireError
from distmoe.wire.errors import FLOWER_LINK_CODES, REASON_TEXTS, Reason, code_of
from distmoe.wire.party_guard import REPLY_STRINGS
from distmoe.wire.schema import (
    CARRIES_PROBE,
    ConsistencyResponseMsg,
    KeyAdvertReply,
    MaskedReply,
    ShareKeysReply,
    UnmaskResponseMsg,
)


class Checked(NamedTuple):
    """One reply's content checks (``ServerGuard.check``): the reply object they were made on, its description,
    payload tag, sender's ledger head, decoded payload and the first problem found (None: none)."""

    reply: object
    d: dict
    ptype: str
    head: tuple | None
    payload: object
    problem: str | None


# -------------------------------------------------------------------------------------------- guard
class ServerGuard:
    """Outbound logging and the inbound check (module docstring), writing the coordinator's ledger."""

    def __init__(self, ledger: Ledger, run_id: str, policy: Mapping):
        self.ledger, self.run_id, self.policy = ledger, str(run_id), policy
        self.names: dict[int, str] = {}  # node id -> party name (from key adverts / replies)
        self.public_keys: dict[str, str] = {}  # party -> ledger public key (pinned at setup)
        self.epsilon_caps: dict[str, float] = {}  # party -> its declared epsilon-max (0 = none), from setup

    def peer(self, node: int) -> str:
        return self.names.get(node, f"node-{node}")

    def outbound(self, node: int, payload: object, rnd: int | None, phase: str, memo: ExchangeMemo | None = None
                 ) -> tuple[str, RecordDict]:
        """``memo``: the exchange's (``ExchangeMemo``): a payload object sent to several nodes is encoded and described
        once, a phase instruction several secure instructions wrap is encoded once, and leading records shared with
        another node's instruction (the weights in each party's secure instruction) are hashed once."""
        if memo is None:
            content = codec.encode(payload)
            d = inspect.describe(content)
        else:
            content, d = memo.once("describe", (payload,), lambda: _described(payload, memo))
            content = codec.shared(content)  # this node's own record dict (its ledger head goes in it)
        ptype = codec.payload_tag(content)
        problem = check_against_policy(self.policy, ptype, d)
        entry = self.ledger.append(run=self.run_id, round=rnd, phase=phase, direction="out", payload_type=ptype,
                                   keys=d["keys"], shapes=d["shapes"], bytes=d["bytes"], sha256=d["sha256"],
                                   verdict="accepted" if problem is None else f"rejected: {problem}",
                                   peer=self.peer(node))
        if problem:
            raise WireError(f"outbound broadcast refused by the guard: {problem}")
        # the coordinator's ledger head as of this instruction: the party records it (distmoe.audit.ledgers)
        return codec.message_type_of(payload), codec.with_ledger_head(content, entry["seq"], entry["hash"])

    def inbound(self, node: int, reply: RecordDict | codec.ErrorReply | str, expected: type, rnd: int | None,
                phase: str, length: int | None = None, probe: ProbeBounds | None = None,
                checked: Checked | None = None) -> object:
        """The checked payload, or raise ``WireError`` with the reason (logged either way). ``checked``: this reply's
        ``check`` made earlier (as it arrived, while other replies were awaited); logged here as if made now."""
        if isinstance(reply, codec.ErrorReply):
            name, text = self._error(node, reply, rnd, phase)
            raise WireError(text, reason=name)
        if isinstance(reply, str):  # no reply at all (the transport's note)
            raise WireError(reply, reason="no-reply")
        if checked is None or checked.reply is not reply:
            checked = self.check(node, reply, expected, rnd, length, probe)
        d, ptype, head, payload, problem = checked.d, checked.ptype, checked.head, checked.payload, checked.problem
        info = None
        if isinstance(payload, KeyAdvertReply) and problem is None:
            info = {"ledger_public_key": payload.ledger_public_key, "node": str(node),
                    "epsilon_max": payload.epsilon_max}
            if payload.party in self.names.values() and self.names.get(node) != payload.party:
                problem = f"party name {payload.party!r} is already taken by another node"
        if problem is None and head is None:
            problem = "the reply carries no ledger head (it did not pass the party's outbound guard)"
        peer = payload.party if isinstance(payload, KeyAdvertReply) and problem is None else self.peer(node)
        extra = {"info": info} if info else {}
        if head is not None:
            extra["anchor"] = {"node": peer, "seq": int(head[0]), "hash": head[1]}
        self.ledger.append(run=self.run_id, round=rnd, phase=phase, direction="in", payload_type=ptype,
                           keys=d["keys"], shapes=d["shapes"], bytes=d["bytes"], sha256=d["sha256"],
                           verdict="accepted" if problem is None else f"rejected: {problem}"[:500], peer=peer,
                           **extra)
        if problem:
            raise WireError(f"rejected by the server guard: {problem}")
        if isinstance(payload, KeyAdvertReply):
            self.names[node] = payload.party
            self.public_keys[payload.party] = payload.ledger_public_key
            self.epsilon_caps[payload.party] = payload.epsilon_max
        elif getattr(payload, "party", None) and node not in self.names:
            self.names[node] = payload.party
        return payload

    def check(self, node: int, reply: RecordDict, expected: type, rnd: int | None, length: int | None = None,
              probe: ProbeBounds | None = None) -> Checked:
        """The content checks of one reply (the module docstring's list up to the ledger entry): reads no state that
        the stage's other replies change and writes nothing, so it may run as each reply arrives; ``inbound`` then
        adds the checks that depend on the other replies (a party name taken) and logs it."""
        head, payload, problem = None, None, None
        try:  # what Flower carried packed (``packing``): checked, logged and hashed as its logical records
            unpacked = packing.unpack(reply)
        except WireError as exc:
            unpacked, problem = reply, str(exc)
        d = inspect.describe(unpacked, exclude=(codec.LEDGER_RECORD,))
        ptype = codec.payload_tag(unpacked)
        try:
            head = codec.ledger_head(unpacked)
            problem = problem or check_against_policy(self.policy, ptype, d)
            if problem is None:
                inspect.check_strings(codec.strip_ledger(unpacked), REPLY_STRINGS)
                payload = codec.decode(unpacked, expected)
                problem = self._semantic(payload, node, rnd, length)
                if problem is None and expected in CARRIES_PROBE:  # the carried probe: asked for, and bounded
                    problem = check_probe_part(payload.probe, probe)
        except (WireError, inspect.InspectError) as exc:
            problem = str(exc)
        return Checked(reply, d, ptype, head, payload, problem)

    def _error(self, node: int, reply: codec.ErrorReply, rnd: int | None, phase: str) -> tuple[str, str]:
        """Check and log an error reply; returns ``(reason name, text the coordinator may log and print)``.

        A party's guard sends exactly one text of the closed reason table (``errors.REASONS``), the one of
        the reply's code, with its ledger head appended. Anything else (oversized, another text, a code
        that does not match) is rejected and its text is not kept; an error without a head (Flower's own,
        e.g. a ClientApp process that died, or one raised outside the party guard) is logged but its text
        is withheld unless the SuperLink itself wrote it (``_flower_link_error``)."""
        raw = reply.reason.encode("utf-8", "surrogatepass")
        text, head = codec.split_error(reply.reason)
        problem = None
        if len(raw) > codec.ERROR_MAX_BYTES:
            problem = f"error reply of {len(raw)} bytes exceeds {codec.ERROR_MAX_BYTES}"
        elif head is not None and (text not in REASON_TEXTS or code_of(text) != reply.code):
            problem = f"error text is not the closed reason table's entry for code {reply.code}"
        blob = text.encode("utf-8", "surrogatepass")
        peer = self.peer(node)
        extra = {"anchor": {"node": peer, "seq": head[0], "hash": head[1]}} if head and problem is None else {}
        if head is None and problem is None:
            extra["info"] = {"anchored": False, "code": int(reply.code)}
        self.ledger.append(run=self.run_id, round=rnd, phase=phase, direction="in", payload_type="error",
                           keys=["error.reason"], shapes={}, bytes=len(raw), sha256=hashlib.sha256(blob).hexdigest(),
                           verdict="accepted" if problem is None else f"rejected: {problem}", peer=peer, **extra)
        if problem is not None:
            return "withheld", f"node {node}: error reply rejected by the server guard ({problem}); text not kept"
        if head is None:
            flower = _flower_link_error(reply)
            if flower is not None:  # written by the SuperLink itself (e.g. a dead node), not by the party
                return "unavailable", f"node {node}: {flower}"
            return "withheld", (f"node {node} replied with an error (code {reply.code}) that did not pass its party "
                                f"guard; {len(raw)} bytes of text withheld (see the party's own log)")
        name = text.split(":", 1)[0]
        return name, text

    @staticmethod
    def _semantic(payload: object, node: int, rnd: int | None, length: int | None) -> str | None:
        if isinstance(payload, MaskedReply):
            if payload.masked is not None:
                m = payload.masked
                if m.sender != node:
                    return f"masked input claims sender {m.sender}, it came from node {node}"
                if length is not None and m.y.shape != (length,):
                    return f"masked vector has {m.y.shape[0]} elements, the round declared {length}"
                if rnd is not None and m.round != rnd:
                    return f"masked input for round {m.round}, expected round {rnd}"
            keys = payload.late_keys or (payload.masked.next_keys if payload.masked else None)
            if keys is not None and keys.sender != node:
                return f"share keys claim sender {keys.sender}, they came from node {node}"
        if isinstance(payload, ShareKeysReply) and payload.keys.sender != node:
            return f"share keys claim sender {payload.keys.sender}, they came from node {node}"
        if isinstance(payload, ConsistencyResponseMsg) and payload.response.sender != node:
            return f"consistency response claims sender {payload.response.sender}, it came from node {node}"
        if isinstance(payload, UnmaskResponseMsg) and payload.response.sender != node:
            return f"unmask response claims sender {payload.response.sender}, it came from node {node}"
        return None

    def log_release(self, *, rnd: int, phase: str, release: str, total: np.ndarray, dp: dict | None,
                    info: dict, verdict: str = "accepted") -> dict:
        blob = np.ascontiguousarray(total).tobytes()
        return self.ledger.append(run=self.run_id, round=rnd, phase=phase, direction="in",
                                  payload_type=f"release:{release}", keys=[], shapes={"sum": [int(total.size)]},
                                  bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest(), verdict=verdict[:500],
                                  peer="all", dp=dp, info={**info, "time": time.time()})


def _flower_link_error(reply: codec.ErrorReply) -> str | None:
    """The text of an error the SuperLink itself writes for a message it cannot deliver (a node that
    stopped sending heartbeats, an expired message), recognised by Flower's code *and* its exact text;
    None for anything else (which may come from the party and is not kept)."""
    if reply.code not in FLOWER_LINK_CODES:
        return None
    try:
        from flwr.server.superlink.linkstate import utils as link
    except ImportError:
        return None
    known = {link.MESSAGE_UNAVAILABLE_ERROR_REASON, link.REPLY_MESSAGE_UNAVAILABLE_ERROR_REASON,
             link.NODE_UNAVAILABLE_ERROR_REASON}
    return f"Flower: {reply.reason}" if reply.reason in known else None


def _described(payload: object, memo: ExchangeMemo) -> tuple[RecordDict, dict]:
    content = codec.encode(payload, memo)
    return content, inspect.describe(content, memo=memo)


# ---------------------------------------------------------------------------------------- transport
class ExchangeMemo:
    """What the messages of one exchange share, made once: the encoding of a phase instruction that several secure
    instructions wrap (``codec.encode``), the hash state after a leading run of records several messages carry
    (``inspect.digest``), an ArrayRecord's packed form (``packing.pack``), a payload object sent to several nodes
    with its description (``ServerGuard.outbound``). Keyed by the identity of the objects it was made from, which it
    holds, so no identity is reused while it lives; it lives for one exchange (``GuardedTransport.exchange`` makes
    it and passes it down explicitly), so two exchanges never share anything. ``made`` counts what was made, per
    kind (what a test of the sharing reads)."""

    def __init__(self) -> None:
        self._got: dict[tuple, tuple] = {}  # (kind, tag, ids) -> (the objects, what was made from them)
        self.made: dict[str, int] = {}

    def get(self, kind: str, objs: tuple, tag: tuple = ()):
        """What was made of exactly these objects (and ``tag``), or None."""
        hit = self._got.get((kind, tag, tuple(map(id, objs))))
        return None if hit is None else hit[1]

    def put(self, kind: str, objs: tuple, value, tag: tuple = ()):
        self._got[(kind, tag, tuple(map(id, objs)))] = (objs, value)
        self.made[kind] = self.made.get(kind, 0) + 1
        return value

    def once(self, kind: str, objs: tuple, make, tag: tuple = ()):
        """``make()`` the first time for these objects (and ``tag``), what it made every later time."""
        got = self.get(kind, objs, tag)
        return got if got is not None else self.put(kind, objs, make(), tag)


class GuardedTransport(abc.ABC):
    """``exchange`` = encode + log every instruction, send, check + log every reply. Subclasses give
    ``_send({node: (message_type, content)}, timeout) -> {node: RecordDict | error reason}``."""

    guard: ServerGuard | None = None
    # while ``exchange`` waits in ``_send``: ``_arrived(node, reply content)`` checks a reply's content at once (a
    # transport that learns of replies one by one calls it, so the checks overlap the wait for the slowest party);
    # the ledger entries and what depends on the other replies still follow in ``exchange``, in the nodes' order
    _arrived = None

    def attach(self, guard: ServerGuard) -> None:
        self.guard = guard

    @abc.abstractmethod
    def node_ids(self) -> list[int]:
        """The nodes connected now."""

    @abc.abstractmethod
    def _send(self, out: dict[int, tuple[str, RecordDict]], timeout: float, memo: ExchangeMemo
              ) -> dict[int, RecordDict | str]:
        """Deliver every message (packed with the exchange's ``memo``: ``codec.instruction_content``); return each
        node's reply content or error reason."""

    def exchange(self, instructions: dict[int, object], expected: type, timeout: float, *, rnd: int | None = None,
                 phase: str = "", lengths: Mapping[int, int] | None = None, probe: ProbeBounds | None = None
                 ) -> tuple[dict[int, object], dict[int, str]]:
        """Every instruction logged and sent, every reply checked and logged: ``(payloads, reasons)`` per node.
        ``lengths``: the masked-vector length each node's round start declared; ``probe``: the instructions carry
        the routing probe request, and each reply must carry the probe within these bounds."""
        if self.guard is None:
            raise RuntimeError("transport has no server guard attached")
        memo = ExchangeMemo()  # this exchange's: what its instructions share is encoded, hashed and packed once
        with self.guard.ledger.batch():  # the stage's "out" entries in one group commit, durable before any is sent
            out = {node: self.guard.outbound(node, p, rnd, phase, memo) for node, p in instructions.items()}
        early: dict[int, Checked] = {}  # a reply's content checks, made as it arrived (``_arrived``)

        def arrived(node: int, reply: object) -> None:
            if node in instructions and node not in early and isinstance(reply, RecordDict):
                early[node] = self.guard.check(node, reply, expected, rnd, (lengths or {}).get(node), probe)

        self._arrived = arrived
        try:
            t0, got = time.monotonic(), self._send(out, timeout, memo)  # it may return before the timeout (nodes gone)
        finally:
            self._arrived = None
        replies, errors = {}, {}  # node -> the checked payload / the reason it was refused
        with self.guard.ledger.batch():  # the stage's "in" entries: durable before anything acts on the replies
            for node in instructions:  # logged in the instructions' order, whatever order the replies came in
                reply = got.get(node, f"no reply after {time.monotonic() - t0:.0f} s (round-timeout {timeout:.0f} s)")
                try:
                    replies[node] = self.guard.inbound(node, reply, expected, rnd, phase,
                                                       (lengths or {}).get(node), probe, early.get(node))
                except WireError as exc:
                    errors[node] = Reason(exc.reason, str(exc))
        return replies, errors
