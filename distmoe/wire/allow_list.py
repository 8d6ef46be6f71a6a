"""The run's allow-list: what every message of the run may hold, derived from the codec itself.

Owns: ``build_policy`` (the allow-list of a run, derived by encoding prototype payloads of the declared layouts
with the real codec, so it is exactly what the codec can produce, not a hand-kept list: per payload type the allowed
and required ``<record>.<key>`` names, the shapes of fixed-shape arrays, and a byte budget; it is hashed into the
first entry of the coordinator's ledger and the audit checks every ledger entry against it), ``policy_digest`` and
``check_against_policy`` (one described payload against it: ``distmoe.wire.server_guard`` on every message, the
audit on every ledger entry). With the routing probe on, every phase instruction may carry the probe request
(``meta.probe_prompts``) and every phase reply the carried probe (``probe.routing`` ``[L, E]``, ``top1.top1`` of at
most ``probe_tokens`` tokens, within the byte budget): optional keys, declared here, so nothing else may ride along.

Must not: read party data, or loosen a rule beyond what the codec can produce for the run's declared layouts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
from flwr.app import RecordDict

from distmoe.ledger import canonical_json
from distmoe.privacy import secagg as sa
from distmoe.wire import codec, inspect
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
    ProbePart,
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
    routing probe's instruction and its plaintext reply (``top1`` of at most ``probe_tokens`` tokens), and the probe
    carried on every phase instruction and reply (optional keys); with ``settle`` (``routing.balance-settle-steps``),
    the bias settle's instruction and its ``[L, E]`` plaintext reply."""
    from distmoe.wire.schema import TRAIN_METRIC_KEYS, eval_metric_keys

    n = max(n_parties, 2)
    w = {k: np.zeros(s, np.float32) for k, s in trainable.items()}
    weight_keys = {f"arrays.{k}" for k in trainable}
    anchor = np.full((layers, experts), 1.0 / experts, np.float32)
    # the per-task anchors of retention: at most one per task of the schedule (its byte budget's bound)
    per_task = np.full((max(len(tasks), 1), layers, experts), 1.0 / experts, np.float32)
    # the carried probe (docs/privacy.md §3): the request on an instruction, the answer beside a reply
    ask = tuple(probe_prompts) or None
    part = ProbePart(np.full((layers, experts), 1.0 / experts), np.zeros((layers, max(probe_tokens, 1)), np.int32))
    carried = (None, part) if ask else (None,)
    part_shape = {"probe.routing"} if ask else set()
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
        asked = [replace(p, probe=ask) for p in protos] if ask else []  # the largest round start suffices
        if secure:
            contents = [codec.encode(SecureInstruction(p, st, release_of[tag])) for p in protos for st in starts]
            contents += [codec.encode(SecureInstruction(p, starts[-1], release_of[tag])) for p in asked]
        else:
            contents = [codec.encode(p) for p in protos + asked]
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
                                                                       counts), None, c)) for c in carried]
            # eval vectors follow the tasks evaluated so far: bounded by bytes, not a fixed shape
            policy[f"masked-input:{release}"] = _entry(masked, ({"masked_y.y"} if release != "eval" else set())
                                                       | part_shape, n)
            policy[f"late-keys:{release}"] = _entry([codec.encode(MaskedReply(release, None, keys, c))
                                                     for c in carried], part_shape, n)
    else:
        delta = {k: np.zeros(s, np.float32) for k, s in trainable.items()}
        metrics = {k: 0.0 for k in TRAIN_METRIC_KEYS}
        policy["model-update"] = _entry([codec.encode(ModelUpdate("p0", delta, 1, metrics, probe=c)) for c in carried],
                                        {f"arrays.{k}" for k in trainable} | part_shape, n)
        policy["model-update"]["keys_pattern"] = "metrics.*"  # sft and rl updates carry different metric keys
        policy["router-stats"] = _entry([codec.encode(RouterStats(np.zeros((layers, experts)), c)) for c in carried],
                                        {"stats.sums"} | part_shape, n)
        policy["eval-reply"] = _entry([codec.encode(EvalReply("p0", {k: 0.0 for k in eval_metric_keys(tasks)}, c))
                                       for c in carried], part_shape, n)
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


@dataclass(frozen=True)
class ProbeBounds:
    """The shapes a carried routing probe (``schema.ProbePart``) must have: ``routing`` ``[layers, experts]``, ``top1``
    ``[layers, N]`` with ``1 <= N <= max_tokens`` (the prompts times ``model.max-seq-len``)."""

    layers: int
    experts: int
    max_tokens: int


def check_probe_part(part: object, bounds: ProbeBounds | None) -> str | None:
    """None if a reply's carried probe is what its instruction asked for, else the reason: none when none was asked
    (``bounds`` None), else present with its shapes within ``bounds`` (the codec has checked its values)."""
    if bounds is None:
        return None if part is None else "a carried routing probe the instruction did not ask for"
    if part is None:
        return "no carried routing probe, but the instruction asked for one"
    r, t, b = np.shape(part.routing), np.shape(part.top1), bounds
    if r != (b.layers, b.experts) or len(t) != 2 or t[0] != b.layers or not 1 <= t[1] <= b.max_tokens:
        return (f"carried routing probe of shapes {list(r)} / {list(t)}, the bounds are [{b.layers}, {b.experts}] / "
                f"[{b.layers}, <= {b.max_tokens}]")
    return None
