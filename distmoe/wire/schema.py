"""The closed set of payload types that cross the wire, each with exact keys.

Server -> client: ``SftInstruction``, ``StatsInstruction``, ``EvalInstruction`` (global trainable
weights, task, anchor, round plan; an ``SftInstruction`` with ``objective = "dpo"`` asks for local DPO and
may carry the reference weights, and is released and aggregated like any SFT update). Client -> server:
``ModelUpdate`` (trainable-weight deltas, the example count used as the FedAvg weight, a fixed list of
scalar metrics), ``RouterStats`` (the ``[L, E]`` sum), ``EvalReply`` (aggregate numbers per task and
routing metrics, never per-example values).

With ``privacy.mode = "secagg"`` (the default) none of the three reply payloads above leaves a party
as such: each is encoded into the declared integer layout of ``distmoe.privacy.vectors`` and sent as a
``MaskedReply`` inside the secure-aggregation protocol (``SetupRequest`` / ``KeyAdvertReply``,
``DirectoryRequest`` / ``ShareKeysReply``, a phase instruction with its ``RoundStart``, then
``UnmaskRequestMsg`` / ``UnmaskResponseMsg``). ``privacy.mode = "plaintext"`` sends them in the clear: a
benchmark baseline only, which the server warns about and the audit fails.

``ProbeInstruction`` / ``ProbeReply`` (``query.probe``, both modes) are the routing probe: the global weights and
public prompts down, the model's routing on those prompts up in the clear, a function of public inputs only
(``docs/privacy.md`` §3).

The probe carried on a phase instruction (``probe``: the public prompts, record key ``meta.probe_prompts``) is
answered beside its reply (``ModelUpdate``, ``RouterStats``, ``EvalReply`` or ``MaskedReply`` with ``probe``: a
``ProbePart``, the records ``probe`` and ``top1``), in the clear in both modes, outside any masked vector
(``docs/privacy.md`` §3); ``CARRIED_BY`` / ``CARRIES_PROBE`` name those types. The secure-aggregation stages' own
payloads are ``distmoe.wire.secagg_payloads``'.

``SettleInstruction`` / ``SettleReply`` (``query.settle``, both modes, with ``routing.balance-settle-steps``): the
aggregated global weights down, the routing bias settled on them over the public balance prompts up in the clear,
likewise a function of public inputs only (``docs/privacy.md`` §3).

``PAYLOADS`` is the one table of payload types: per type its class, tag, direction, the Flower message
type, reply, release and phase of an instruction, and every dataclass field with the record key it
travels under and its kind (the converter in ``codec.KINDS``). The codec, the guards and the policy read
it; nothing else lists payload types.

Must not: import ``flwr`` types (``codec.py`` maps these payloads onto records).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from distmoe.wire.secagg_payloads import (  # noqa: F401  (part of the schema's interface)
    ConsistencyRequestMsg,
    ConsistencyResponseMsg,
    DirectoryRequest,
    KeyAdvertReply,
    SetupRequest,
    ShareKeysReply,
    UnmaskRequestMsg,
    UnmaskResponseMsg,
)

TRAIN_METRIC_KEYS = ("loss", "task_loss", "aux_loss", "anchor_kl", "loss_first", "loss_last",
                     "steps", "skipped_steps", "time_s",
                     "dpo_margin", "dpo_acc")  # a dpo round's mean log-ratio margin and preference accuracy (else NaN)
# an rl update's metrics: these plus route_disagree_l<i> for each MoE layer i
RL_METRIC_KEYS = ("reward", "reward_first", "reward_last", "masked_frac_low", "masked_frac_high", "seq_masked_frac",
                  "logp_diff_mean", "logp_diff_max", "k3", "clip_frac", "masked_entropy", "steps", "skipped_steps",
                  "time_s", "replay_override_frac", "logp_diff_mean_native")  # the last two: rl.routing-replay
RL_SIM_METRIC_KEYS = ("sim_r2", "sim_auroc", "sim_fallback", "sim_masked_frac", "sim_trusted",
                      "sim_recal_triggered")  # only with rl.simulator; per-step means (shares of the round's steps)
EVAL_TASK_KEYS = ("acc", "loss", "n")
EVAL_ROUTING_KEYS = ("routing_kl", "load_cv", "top1_consistency")


def eval_metric_keys(tasks: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    return tuple(f"{k}/{t}" for t in tasks for k in EVAL_TASK_KEYS) + EVAL_ROUTING_KEYS


@dataclass(frozen=True)
class SftInstruction:
    round: int
    task: str
    weights: dict[str, np.ndarray]
    base_hash: str
    seed: int
    anchor: np.ndarray | None  # [L, E]
    anchor_version: int  # 0 = no anchor
    objective: str | None = None  # None = SFT; "dpo" = a dpo phase: local DPO on the task's preference pairs
    ref_weights: dict[str, np.ndarray] | None = None  # dpo: the reference model; None = ``weights`` themselves
    # retention (docs/algorithms.md, Retention): the earlier tasks' anchors [T, L, E] (T <= the schedule's tasks),
    # the round's index within its task's phase (1 = first) and the hash of the pre-task global weights ("" = off)
    task_anchors: np.ndarray | None = None
    task_round: int = 1
    ref_hash: str = ""
    probe: tuple[str, ...] | None = None  # the routing probe of ``weights`` carried on this round


OBJECTIVES = ("dpo",)  # an SftInstruction's objectives besides SFT (None); every one releases a model update


@dataclass(frozen=True)
class RlInstruction:
    round: int
    task: str
    weights: dict[str, np.ndarray]
    base_hash: str
    seed: int
    probe: tuple[str, ...] | None = None  # the routing probe of ``weights`` carried on this round


@dataclass(frozen=True)
class StatsInstruction:
    round: int
    task: str  # "" = every local task
    weights: dict[str, np.ndarray]
    base_hash: str
    probe: tuple[str, ...] | None = None  # the routing probe of ``weights`` carried on this round


@dataclass(frozen=True)
class EvalInstruction:
    round: int
    tasks: tuple[str, ...]
    new_task: str
    weights: dict[str, np.ndarray]
    base_hash: str
    ref_weights: dict[str, np.ndarray] | None  # the global model before the current task
    anchor: np.ndarray | None
    anchor_version: int
    probe: tuple[str, ...] | None = None  # the routing probe of ``weights`` carried on this round


@dataclass(frozen=True)
class ProbePart:
    """The routing probe carried on a phase reply, in the clear in both modes: a ``ProbeReply``'s arrays, computed on
    the instruction's global weights before any local work (``docs/privacy.md`` §3). The codec bounds it (finite,
    ``routing`` rows are distributions, ``top1`` in ``[0, E)``); both guards check its shapes."""

    routing: np.ndarray  # [L, E] float64
    top1: np.ndarray  # [L, N] int32, 1 <= N <= prompts x model.max-seq-len


@dataclass(frozen=True)
class ModelUpdate:
    party: str  # the party's declared name (an identifier, validated)
    delta: dict[str, np.ndarray]  # local - global, per trainable tensor
    num_examples: int
    metrics: dict[str, float]  # sft: exactly TRAIN_METRIC_KEYS; rl: RL_METRIC_KEYS + route_disagree_l<i>
    kind: str = "sft"  # sft | rl
    probe: ProbePart | None = None  # the carried routing probe (when the instruction asked for one)


@dataclass(frozen=True)
class RouterStats:
    sums: np.ndarray  # [L, E] float64: sum over sequences of per-sequence mean routing
    # no separate count: every row sums to the number of sequences
    probe: ProbePart | None = None  # the carried routing probe (when the instruction asked for one)


@dataclass(frozen=True)
class EvalReply:
    party: str
    metrics: dict[str, float]  # exactly eval_metric_keys(tasks); NaN where not available
    probe: ProbePart | None = None  # the carried routing probe (when the instruction asked for one)


@dataclass(frozen=True)
class ProbeInstruction:
    """Server -> party, every ``routing.probe-every`` rounds, in both privacy modes: the round's global weights and
    the public probe prompts (``distmoe.routing.probe``); no data of any party."""

    round: int
    base_hash: str
    prompts: tuple[str, ...]
    weights: dict[str, np.ndarray]


@dataclass(frozen=True)
class ProbeReply:
    """Party -> server, in the clear in both modes: the global model's routing on the public probe prompts, a
    deterministic function of public inputs (allow-listed with its reason in ``docs/privacy.md`` §3)."""

    party: str
    routing: np.ndarray  # [L, E] float64: mean over probe prompts of each prompt's mean routing distribution
    top1: np.ndarray  # [L, N] int32: top-1 expert of every valid probe token per MoE layer


@dataclass(frozen=True)
class SettleInstruction:
    """Server -> party after an aggregated update, with ``routing.balance-settle-steps``: the new global weights
    (routing bias included); the party settles the bias on the public balance prompts (``train/public_balance.py``)."""

    round: int
    base_hash: str
    weights: dict[str, np.ndarray]


@dataclass(frozen=True)
class SettleReply:
    """Party -> server, in the clear in both modes: the routing bias settled on the global weights, a deterministic
    function of public inputs (allow-listed with its reason in ``docs/privacy.md`` §3)."""

    party: str
    bias: np.ndarray  # [L, E] float64: each MoE layer's settled routing bias


RELEASES = ("model-update", "rl-update", "router-stats", "eval")  # what a masked input carries


def rl_metric_keys(num_moe_layers: int, simulator: bool) -> tuple[str, ...]:
    """The exact metric keys of an rl update for a model with ``num_moe_layers`` MoE layers."""
    keys = RL_METRIC_KEYS + tuple(f"route_disagree_l{i}" for i in range(num_moe_layers))
    return keys + (RL_SIM_METRIC_KEYS if simulator else ())


@dataclass(frozen=True)
class SecureInstruction:
    """A phase instruction plus this node's ``RoundStart`` (None: the node is not in this round's U1 and
    answers with share keys for the next round only)."""

    instruction: object  # SftInstruction | RlInstruction | StatsInstruction | EvalInstruction
    start: object | None  # secagg.RoundStart
    release: str  # one of RELEASES


@dataclass(frozen=True)
class MaskedReply:
    release: str
    masked: object | None  # secagg.MaskedInput (with next round's share keys)
    late_keys: object | None  # secagg.ShareKeys when the node was outside U1
    probe: ProbePart | None = None  # the carried routing probe (when the instruction asked for one)


# Flower message types of the instructions ("train.<action>" / "evaluate" / "query.<stage>")
MSG_SFT = "train.sft"
MSG_STATS = "train.stats"
MSG_RL = "train.rl"
MSG_EVAL = "evaluate"
MSG_SETUP = "query.setup"
MSG_DIRECTORY = "query.directory"
MSG_CONSISTENCY = "query.consistency"
MSG_UNMASK = "query.unmask"
MSG_PROBE = "query.probe"
MSG_SETTLE = "query.settle"


@dataclass(frozen=True)
class Field:
    """One dataclass field on the wire: ``attr`` travels at ``at`` as ``kind``.

    ``at`` is ``"<record>.<key>"`` for a scalar in a ConfigRecord, or ``"<record>"`` for a field that fills
    whole records (arrays, metrics, a protocol message; ``"*"``: the records of a nested payload). A kind
    ending in ``?`` is optional: ``None`` on the payload, the record absent on the wire."""

    attr: str
    at: str
    kind: str

    @property
    def record(self) -> str:
        return self.at.split(".", 1)[0]

    @property
    def optional(self) -> bool:
        return self.kind.endswith("?")


@dataclass(frozen=True)
class PayloadType:
    """One row of ``PAYLOADS``."""

    cls: type
    tag: str  # meta.payload; "" for SecureInstruction (it carries its instruction's tag)
    direction: str  # "instruction" (server -> party) or "reply" (party -> server)
    fields: tuple[Field, ...]  # every dataclass field, in wire order
    records: tuple[str, ...]  # the records this type may fill, in wire order
    message_type: str = ""  # instructions: the Flower message type
    reply: type | None = None  # instructions: what a party answers (phases: in plaintext mode)
    release: str = ""  # phase instructions: what the masked reply carries in secure mode (one of RELEASES)
    phase: str = ""  # instructions: the ledger phase of the exchange
    arrays: tuple[tuple[str, str], ...] = field(init=False)  # (record, kind) of every array field

    def __post_init__(self) -> None:
        object.__setattr__(self, "arrays", tuple((f.record, f.kind.rstrip("?")) for f in self.fields
                                                 if f.kind.rstrip("?") in ARRAY_KINDS))


# kinds whose record holds float arrays: "weights"/"deltas" one per trainable tensor (float32 for deltas),
# "probs" one [L, E] float32 array named "probs", "sums" one [L, E] float64 array named "sums"
ARRAY_KINDS = ("weights", "deltas", "probs", "sums", "probe-routing", "probe-top1", "settle-bias",
               "probe-part")  # "probe-part": the records "probe" (routing) and "top1"


def _meta(*specs: str) -> tuple[Field, ...]:
    """``"attr:kind"`` -> ``Field(attr, "meta.attr", kind)``."""
    return tuple(Field(a, f"meta.{a}", k) for a, k in (x.split(":") for x in specs))


# the carried routing probe: its request on a phase instruction (the public prompts), its answer on the reply
_ASK = Field("probe", "meta.probe_prompts", "prompts?")
_PART = Field("probe", "probe", "probe-part?")

PAYLOADS: tuple[PayloadType, ...] = (
    PayloadType(SftInstruction, "sft-instruction", "instruction",
                _meta("round:int", "task:str", "base_hash:str", "seed:int", "anchor_version:int",
                      "objective:objective?", "task_round:int", "ref_hash:str")
                + (Field("weights", "arrays", "weights"), Field("anchor", "anchor", "probs?"),
                   Field("ref_weights", "ref", "weights?"), Field("task_anchors", "task_anchors", "probs?"), _ASK),
                ("arrays", "ref", "anchor", "task_anchors", "meta"), MSG_SFT, ModelUpdate, "model-update", "sft"),
    PayloadType(RlInstruction, "rl-instruction", "instruction",
                _meta("round:int", "task:str", "base_hash:str", "seed:int")
                + (Field("weights", "arrays", "weights"), _ASK),
                ("arrays", "meta"), MSG_RL, ModelUpdate, "rl-update", "rl"),
    PayloadType(StatsInstruction, "stats-instruction", "instruction",
                _meta("round:int", "task:str", "base_hash:str") + (Field("weights", "arrays", "weights"), _ASK),
                ("arrays", "meta"), MSG_STATS, RouterStats, "router-stats", "stats"),
    PayloadType(EvalInstruction, "eval-instruction", "instruction",
                _meta("round:int", "tasks:tasks", "new_task:str", "base_hash:str", "anchor_version:int")
                + (Field("weights", "arrays", "weights"), Field("ref_weights", "ref", "weights?"),
                   Field("anchor", "anchor", "probs?"), _ASK),
                ("arrays", "ref", "anchor", "meta"), MSG_EVAL, EvalReply, "eval", "eval"),
    PayloadType(ModelUpdate, "model-update", "reply",
                _meta("num_examples:count", "party:party", "kind:str")
                + (Field("delta", "arrays", "deltas"), Field("metrics", "metrics", "update-metrics"), _PART),
                ("arrays", "metrics", "meta", "probe", "top1")),
    PayloadType(RouterStats, "router-stats", "reply", (Field("sums", "stats", "sums"), _PART),
                ("stats", "meta", "probe", "top1")),
    PayloadType(EvalReply, "eval-reply", "reply",
                _meta("party:party") + (Field("metrics", "metrics", "eval-metrics"), _PART),
                ("metrics", "meta", "probe", "top1")),
    PayloadType(SetupRequest, "setup-request", "instruction",
                _meta("secagg_run:bytes", "threshold:int", "max_length:int", "n_invited:int", "noise_multiplier:float",
                      "update_noise_multiplier:float", "logical_run:logical-run", "epoch:epoch"),
                ("meta",), MSG_SETUP, KeyAdvertReply, "", "setup"),
    PayloadType(KeyAdvertReply, "key-advert", "reply",
                _meta("party:party", "c_pk:key32", "ledger_public_key:hex64", "sig_pk:key32",
                      "epsilon_max:epsilon-cap"), ("meta",)),
    PayloadType(DirectoryRequest, "key-directory", "instruction",
                (Field("directory", "dir", "key-directory"),) + _meta("first_round:int", "names:roster"),
                ("meta", "dir"), MSG_DIRECTORY, ShareKeysReply, "", "setup"),
    PayloadType(ShareKeysReply, "share-keys", "reply", (Field("keys", "keys", "share-keys"),),
                ("meta", "keys", "keys_shares")),
    PayloadType(SecureInstruction, "", "instruction",
                (Field("instruction", "*", "instruction"), Field("release", "sa.release", "release"),
                 Field("start", "sa", "round-start")),
                ("sa_parts", "sa_shares", "sa")),
    PayloadType(MaskedReply, "masked-input", "reply",
                (Field("release", "meta.release", "release"), Field("masked", "masked", "masked-input"),
                 Field("late_keys", "next", "late-keys"), _PART),
                ("meta", "masked", "masked_y", "masked_count", "next", "next_shares", "probe", "top1")),
    PayloadType(ConsistencyRequestMsg, "consistency-request", "instruction",
                (Field("request", "check", "consistency-request"),), ("meta", "check", "check_shares"),
                MSG_CONSISTENCY, ConsistencyResponseMsg, "", "unmask"),
    PayloadType(ConsistencyResponseMsg, "consistency-response", "reply",
                (Field("response", "signed", "consistency-response"),), ("meta", "signed")),
    PayloadType(UnmaskRequestMsg, "unmask-request", "instruction", (Field("request", "lists", "unmask-request"),),
                ("meta", "lists"), MSG_UNMASK, UnmaskResponseMsg, "", "unmask"),
    PayloadType(UnmaskResponseMsg, "unmask-response", "reply", (Field("response", "shares", "unmask-response"),),
                ("meta", "shares")),
    PayloadType(ProbeInstruction, "probe-instruction", "instruction",
                _meta("round:int", "base_hash:str", "prompts:prompts") + (Field("weights", "arrays", "weights"),),
                ("arrays", "meta"), MSG_PROBE, ProbeReply, "", "probe"),
    PayloadType(ProbeReply, "probe-reply", "reply",
                _meta("party:party")
                + (Field("routing", "probe", "probe-routing"), Field("top1", "top1", "probe-top1")),
                ("probe", "top1", "meta")),
    PayloadType(SettleInstruction, "settle-instruction", "instruction",
                _meta("round:int", "base_hash:str") + (Field("weights", "arrays", "weights"),),
                ("arrays", "meta"), MSG_SETTLE, SettleReply, "", "settle"),
    PayloadType(SettleReply, "settle-reply", "reply",
                _meta("party:party") + (Field("bias", "bias", "settle-bias"),), ("bias", "meta")),
)
BY_CLASS = {pt.cls: pt for pt in PAYLOADS}
CARRIES_PROBE = tuple(pt.cls for pt in PAYLOADS if _PART in pt.fields)  # the replies a carried probe rides on
CARRIED_BY = tuple(pt.cls for pt in PAYLOADS if _ASK in pt.fields)  # the instructions that may carry its request
BY_TAG = {pt.tag: pt for pt in PAYLOADS if pt.tag}
BY_MESSAGE_TYPE = {pt.message_type: pt for pt in PAYLOADS if pt.message_type}
PAYLOAD_TAGS = {pt.cls: pt.tag for pt in PAYLOADS if pt.tag}
