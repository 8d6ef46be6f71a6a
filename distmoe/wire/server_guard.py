"""The coordinator's side of the wire: the run's allow-list, the inbound guard, the coordinator's ledger
entries, and the transport logic shared by the Flower Grid transport and the in-process one.

Owns:
- ``build_policy``: the allow-list of the run, derived by encoding prototype payloads of the declared
  layouts with the real codec (so it is exactly what the codec can produce, not a hand-kept list):
  per payload type the allowed and required ``<record>.<key>`` names, the shapes of fixed-shape arrays,
  and a byte budget. It is hashed into the first entry of the coordinator's ledger.
- ``ServerGuard``: every outbound instruction is encoded, logged, and carries the coordinator's ledger
  head after that entry (``codec.LEDGER_RECORD``: the party records it, so a cut or rewritten
  coordinator ledger no longer holds the heads the parties saw); every inbound reply is checked
  before anything reads it (payload type on the allow-list, keys, required keys, fixed shapes, byte
  budget, no text or bytes outside the protocol's fields, every array header parsed so trailing bytes
  are rejected, finite values, the masked-vector length the round declared) and logged with the
  sender's ledger head as an anchor. A reply that fails is rejected: logged with the reason, and that
  party is left out of the round.
- ``GuardedTransport``: the coordinator's one transport type, ``exchange`` over any ``_send`` (Grid, in-process).

Must not: read party data, or hand a payload to the coordinator that did not pass the guard.
"""

from __future__ import annotations

import abc
import hashlib
import time
from collections.abc import Mapping

import numpy as np
from flwr.app import RecordDict

from distmoe.ledger import Ledger, canonical_json
from distmoe.privacy import secagg as sa
from distmoe.wire import codec, inspect, packing
from distmoe.wire.codec import WireError
from distmoe.wire.errors import FLOWER_LINK_CODES, REASON_TEXTS, Reason, code_of
from distmoe.wire.party_guard import REPLY_STRINGS
from distmoe.wire.schema import (
    ConsistencyRequestMsg,
    ConsistencyResponseMsg,
    DirectoryRequest,
    EvalInstruction,
    EvalReply,
    KeyAdvertReply,
    MaskedReply,
    ModelUpdate,
    ProbeInstruction,
    ProbeReply,
    RlInstruction,
    RouterStats,
    SecureInstruction,
    SettleInstruction,
    SettleReply,
    SetupRequest,
    SftInstruction,
    ShareKeysReply,
    StatsInstruction,
    UnmaskRequestMsg,
    UnmaskResponseMsg,
)

SLACK_BYTES = 4096  # names, scalar fields and per-message framing on top of the declared arrays
PER_PEER_BYTES = 256  # one share envelope (id, nonce, ciphertext) or one share per peer, with margin


# ------------------------------------------------------------------------------------------- policy
def _proto_keys(n: int, rnd: int = 1) -> sa.ShareKeys:
    env = tuple(sa.EncryptedShares(0, i + 1, rnd, bytes(12), bytes(sa.messages.SHARE_CIPHERTEXT_BYTES))
                for i in range(max(n - 1, 1)))
    return sa.ShareKeys(0, rnd, bytes(32), bytes(32), env)


def _entry(contents: list[RecordDict], fixed: set[str], n: int) -> dict:
    descs = [inspect.describe(c) for c in contents]
    keys = sorted(set().union(*[set(d["keys"]) for d in descs]))
    required = sorted(set.intersection(*[set(d["keys"]) for d in descs]))
    shapes = {k: v for d in descs for k, v in d["shapes"].items() if k in fixed}
    budget = max(d["bytes"] for d in descs) + SLACK_BYTES + PER_PEER_BYTES * n
    return {"keys": keys, "required": required, "shapes": dict(sorted(shapes.items())), "max_bytes": int(budget)}


def build_policy(*, secure: bool, n_parties: int, trainable: Mapping[str, tuple[int, ...]], layers: int,
                 experts: int, update_length: int, stats_length: int, rl_update_length: int, tasks: tuple[str, ...],
                 eval_length: int, probe_prompts: tuple[str, ...] = (), probe_tokens: int = 0,
                 settle: bool = False) -> dict:
    """The allow-list for a run with these public facts (see the module docstring); with ``probe_prompts``, the
    routing probe's instruction and its plaintext reply (``top1`` of at most ``probe_tokens`` tokens); with
    ``settle`` (``routing.balance-settle-steps``), the bias settle's instruction and its ``[L, E]`` plaintext reply."""
    from distmoe.wire.schema import TRAIN_METRIC_KEYS, eval_metric_keys

    n = max(n_parties, 2)
    w = {k: np.zeros(s, np.float32) for k, s in trainable.items()}
    weight_keys = {f"arrays.{k}" for k in trainable}
    anchor = np.full((layers, experts), 1.0 / experts, np.float32)
    # the per-task anchors of retention: at most one per task of the schedule (its byte budget's bound)
    per_task = np.full((max(len(tasks), 1), layers, experts), 1.0 / experts, np.float32)
    instr = {
        "sft-instruction": ([SftInstruction(1, "t", w, "h", 0, None, 0), SftInstruction(1, "t", w, "h", 0, anchor, 1),
                             SftInstruction(1, "t", w, "h", 0, anchor, 1, "dpo", w),  # a dpo round: the reference
                             SftInstruction(1, "t", w, "h", 0, anchor, 1, task_anchors=per_task, task_round=1,
                                            ref_hash="0" * 64)],  # retention: the earlier tasks' anchors
                            weight_keys | {f"ref.{k}" for k in trainable} | {"anchor.probs"}),
        "rl-instruction": ([RlInstruction(1, "t", w, "h", 0)], weight_keys),
        "stats-instruction": ([StatsInstruction(1, "t", w, "h")], weight_keys),
        "eval-instruction": ([EvalInstruction(1, tasks, "t", w, "h", None, None, 0),
                              EvalInstruction(1, tasks, "t", w, "h", w, anchor, 1)],
                             weight_keys | {f"ref.{k}" for k in trainable} | {"anchor.probs"}),
    }
    policy: dict = {}
    starts = [None, sa.RoundStart(1, 0, tuple((i, bytes(32)) for i in range(n)),
                                  tuple(sa.EncryptedShares(i + 1, 0, 1, bytes(12),
                                                           bytes(sa.messages.SHARE_CIPHERTEXT_BYTES))
                                        for i in range(n - 1)), 1)]
    release_of = {"sft-instruction": "model-update", "rl-instruction": "rl-update",
                  "stats-instruction": "router-stats", "eval-instruction": "eval"}
    for tag, (protos, fixed) in instr.items():
        if secure:
            contents = [codec.encode(SecureInstruction(p, st, release_of[tag])) for p in protos for st in starts]
        else:
            contents = [codec.encode(p) for p in protos]
        policy[tag] = _entry(contents, fixed, n)
    if secure:
        keys = _proto_keys(n)
        policy["setup-request"] = _entry([codec.encode(SetupRequest(bytes(16), 2, 1, n, 1.0, 0.0))], set(), n)
        directory = sa.KeyDirectory(bytes(16), tuple((i, bytes([i + 1]) * 32) for i in range(n)),
                                    tuple((i, bytes([i + 1]) * 32) for i in range(n)))
        policy["key-directory"] = _entry([codec.encode(DirectoryRequest(directory, 1,
                                                                        tuple((i, f"p{i}") for i in range(n))))],
                                         set(), n)
        advert = KeyAdvertReply("p0", bytes(32), "0" * 64, bytes(32), 1.0)  # with a declared epsilon-max
        policy["key-advert"] = _entry([codec.encode(advert)], set(), n)
        counts = tuple(sa.CountShare(i + 1, 0, 1, bytes(12), bytes(sa.messages.COUNT_CIPHERTEXT_BYTES))
                       for i in range(n - 1))
        sig = (bytes(sa.shamir.SHARE_BYTES), bytes(sa.primitives.SIG_BYTES))
        policy["consistency-request"] = _entry([codec.encode(ConsistencyRequestMsg(
            sa.ConsistencyRequest(1, 0, tuple(range(n)), counts)))], set(), n)
        policy["consistency-response"] = _entry([codec.encode(ConsistencyResponseMsg(
            sa.ConsistencyResponse(0, 1, *sig)))], set(), n)
        policy["share-keys"] = _entry([codec.encode(ShareKeysReply(keys))], set(), n)
        policy["unmask-request"] = _entry([codec.encode(UnmaskRequestMsg(sa.UnmaskRequest(
            1, tuple(range(n)), (), tuple((i, *sig) for i in range(n)))))], set(), n)
        share = bytes(sa.shamir.SHARE_BYTES)
        policy["unmask-response"] = _entry([codec.encode(UnmaskResponseMsg(sa.UnmaskResponse(
            0, 1, tuple((i, share) for i in range(n)), ())))], set(), n)
        for release, length in (("model-update", update_length), ("rl-update", rl_update_length),
                                ("router-stats", stats_length), ("eval", eval_length)):
            masked = [codec.encode(MaskedReply(release, sa.MaskedInput(0, 1, np.zeros(length, np.uint64), keys,
                                                                       counts), None))]
            # eval vectors follow the tasks evaluated so far: bounded by bytes, not a fixed shape
            policy[f"masked-input:{release}"] = _entry(masked, {"masked_y.y"} if release != "eval" else set(), n)
            policy[f"late-keys:{release}"] = _entry([codec.encode(MaskedReply(release, None, keys))], set(), n)
    else:
        delta = {k: np.zeros(s, np.float32) for k, s in trainable.items()}
        metrics = {k: 0.0 for k in TRAIN_METRIC_KEYS}
        policy["model-update"] = _entry([codec.encode(ModelUpdate("p0", delta, 1, metrics))],
                                        {f"arrays.{k}" for k in trainable}, n)
        policy["model-update"]["keys_pattern"] = "metrics.*"  # sft and rl updates carry different metric keys
        policy["router-stats"] = _entry([codec.encode(RouterStats(np.zeros((layers, experts))))], {"stats.sums"}, n)
        policy["eval-reply"] = _entry([codec.encode(EvalReply("p0", {k: 0.0 for k in eval_metric_keys(tasks)}))],
                                      set(), n)
        policy["eval-reply"]["keys_pattern"] = "metrics.*"
    if probe_prompts:  # public inputs only, in both modes (docs/privacy.md §3, the probe)
        policy["probe-instruction"] = _entry([codec.encode(ProbeInstruction(1, "h", tuple(probe_prompts), w))],
                                             weight_keys, n)
        policy["probe-reply"] = _entry([codec.encode(ProbeReply("p0", np.zeros((layers, experts)),
                                                                np.zeros((layers, max(probe_tokens, 1)), np.int32)))],
                                       {"probe.routing"}, n)
    if settle:  # public inputs only, in both modes (docs/privacy.md §3, the bias settle)
        policy["settle-instruction"] = _entry([codec.encode(SettleInstruction(1, "h", w))], weight_keys, n)
        policy["settle-reply"] = _entry([codec.encode(SettleReply("p0", np.zeros((layers, experts))))],
                                        {"bias.bias"}, n)
    for tag in ("model-update", "eval-reply"):
        if tag in policy:  # the metric keys are checked exactly by the codec
            policy[tag]["required"] = [k for k in policy[tag]["required"] if not k.startswith("metrics.")]
    policy["error"] = {"keys": ["error.reason"], "required": ["error.reason"], "shapes": {}, "max_bytes": 2048}
    return dict(sorted(policy.items()))


def policy_digest(policy: Mapping) -> str:
    return hashlib.sha256(canonical_json(policy).encode("ascii")).hexdigest()


def check_against_policy(policy: Mapping, ptype: str, desc: Mapping) -> str | None:
    """None if a described payload conforms to the allow-list, else the reason."""
    ent = policy.get(ptype)
    if ent is None:
        return f"payload type {ptype!r} is not on the run's allow-list"
    keys = set(desc["keys"])
    pattern = ent.get("keys_pattern")
    extra = sorted(k for k in keys - set(ent["keys"]) if not (pattern and k.startswith(pattern[:-1])))
    if extra:
        return f"{ptype}: fields outside the allow-list: {extra[:5]}"
    missing = sorted(set(ent["required"]) - keys)
    if missing:
        return f"{ptype}: required fields missing: {missing[:5]}"
    for k, shape in ent["shapes"].items():
        if k in desc["shapes"] and list(desc["shapes"][k]) != list(shape):
            return f"{ptype}: {k} has shape {desc['shapes'][k]}, the declared spec is {shape}"
    for k, choices in ent.get("shape_choices", {}).items():
        if k in desc["shapes"] and list(desc["shapes"][k]) not in [list(c) for c in choices]:
            return f"{ptype}: {k} has shape {desc['shapes'][k]}, the declared specs are {choices}"
    if desc["bytes"] > ent["max_bytes"]:
        return f"{ptype}: {desc['bytes']} bytes exceed the byte budget of {ent['max_bytes']}"
    return None


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

    def outbound(self, node: int, payload: object, rnd: int | None, phase: str,
                 encoded: tuple[RecordDict, dict] | None = None) -> tuple[str, RecordDict]:
        content = codec.encode(payload) if encoded is None else codec.shared(encoded[0])
        d = inspect.describe(content) if encoded is None else encoded[1]  # ``encoded``: once per exchange
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
                phase: str, length: int | None = None) -> object:
        """The checked payload, or raise ``WireError`` with the reason (logged either way)."""
        if isinstance(reply, codec.ErrorReply):
            name, text = self._error(node, reply, rnd, phase)
            raise WireError(text, reason=name)
        if isinstance(reply, str):  # no reply at all (the transport's note)
            raise WireError(reply, reason="no-reply")
        head, payload, problem = None, None, None
        try:  # what Flower carried packed (``packing``): checked, logged and hashed as its logical records
            reply = packing.unpack(reply)
        except WireError as exc:
            problem = str(exc)
        d = inspect.describe(reply, exclude=(codec.LEDGER_RECORD,))
        ptype = codec.payload_tag(reply)
        try:
            head = codec.ledger_head(reply)
            problem = problem or check_against_policy(self.policy, ptype, d)
            if problem is None:
                inspect.check_strings(codec.strip_ledger(reply), REPLY_STRINGS)
                payload = codec.decode(reply, expected)
                problem = self._semantic(payload, node, rnd, length)
        except (WireError, inspect.InspectError) as exc:
            problem = str(exc)
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


# ---------------------------------------------------------------------------------------- transport
class GuardedTransport(abc.ABC):
    """``exchange`` = encode + log every instruction, send, check + log every reply. Subclasses give
    ``_send({node: (message_type, content)}, timeout) -> {node: RecordDict | error reason}``."""

    guard: ServerGuard | None = None

    def attach(self, guard: ServerGuard) -> None:
        self.guard = guard

    @abc.abstractmethod
    def node_ids(self) -> list[int]:
        """The nodes connected now."""

    @abc.abstractmethod
    def _send(self, out: dict[int, tuple[str, RecordDict]], timeout: float) -> dict[int, RecordDict | str]:
        """Deliver every message; return each node's reply content or error reason."""

    def exchange(self, instructions: dict[int, object], expected: type, timeout: float, *, rnd: int | None = None,
                 phase: str = "", lengths: Mapping[int, int] | None = None
                 ) -> tuple[dict[int, object], dict[int, str]]:
        if self.guard is None:
            raise RuntimeError("transport has no server guard attached")
        once = {id(p): p for p in instructions.values() if sum(q is p for q in instructions.values()) > 1}
        enc = {i: (c, inspect.describe(c)) for i, p in once.items() for c in [codec.encode(p)]}  # hashed once, shared
        out = {node: self.guard.outbound(node, p, rnd, phase, enc.get(id(p))) for node, p in instructions.items()}
        t0, got = time.monotonic(), self._send(out, timeout)  # it may return before the timeout (nodes gone)
        replies, errors = {}, {}  # node -> the checked payload / the reason it was refused
        for node in instructions:
            reply = got.get(node, f"no reply after {time.monotonic() - t0:.0f} s (round-timeout {timeout:.0f} s)")
            try:
                replies[node] = self.guard.inbound(node, reply, expected, rnd, phase,
                                                   (lengths or {}).get(node))
            except WireError as exc:
                errors[node] = Reason(exc.reason, str(exc))
        return replies, errors
