"""The one declaration and parser of the run configuration: Flower run config + node config -> frozen,
validated dataclasses.

Owns: the declaration of every run-config key, once: the frozen section dataclasses below ARE the
declaration. Each field is made by :func:`key` (default, one-line doc, range or choices); the key's name is
``<section>.<field name with _ -> ->`` and its type comes from the annotation. Everything else is derived from
it: ``DEFAULTS``, ``KEYS``, the type and range checks (a section validates itself when it is constructed, so
``RLConfig(group_size=1)`` fails like the run config would), the ``pyproject.toml`` ``[tool.flwr.app.config]``
block and the key table of ``docs/configuration.md`` (both written by ``distmoe config sync``, see
:mod:`distmoe.config_sync`; a unit test fails when they drift). Checks across keys are explicit ``check``
methods (within a section) and :func:`_check_across` (between sections). Also: the refusal of retired keys
(``RETIRED``), the schedule grammar, the schedule derived from a list of tasks (:func:`continual_schedule`)
and the node-local facts (data path, party name, work directory).

Must not: import ``flwr`` or anything of distmoe, touch models or data, or be bypassed. Library code
receives the narrowest section (``cfg.train``, ``cfg.routing``), never the raw mapping.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

Scalar = int | float | str | bool


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, out of range or inconsistent."""


# ---------------------------------------------------------------------------------------------
# The declaration helper
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KeySpec:
    """One run-config key: what :func:`key` declared plus what the section decorator filled in."""

    default: Scalar
    doc: str  # one line of Markdown: the "meaning" column of docs/configuration.md
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself is excluded
    choices: tuple[str, ...] | None = None
    off: float | None = None  # a value outside [lo, hi] that is allowed and switches the feature off
    allowed: str = ""  # how the docs state what is allowed, where lo/hi/choices alone do not say it
    kind: type | None = None  # the value type; None = from the field's annotation
    name: str = ""  # "<section>.<key>", set by @section
    attr: str = ""  # the dataclass field name, set by @section

    def check(self, value: Any) -> Scalar:
        """``value`` of this key, type-checked (ints accepted for floats, integral floats for ints), range- and
        choice-checked; a ConfigError names the key, the value and what is allowed."""
        key, kind = self.name, self.kind
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"config key '{key}': value {value!r} must be a number")
            value = float(value)
            if not math.isfinite(value):
                raise ConfigError(f"config key '{key}': value {value!r} must be finite")
        elif kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                if not (isinstance(value, float) and value.is_integer()):
                    raise ConfigError(f"config key '{key}': value {value!r} must be an integer")
                value = int(value)
        elif kind is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"config key '{key}': value {value!r} must be true or false")
        elif not isinstance(value, str):
            raise ConfigError(f"config key '{key}': value {value!r} must be a string")
        if self.choices is not None:
            _choice(key, value, self.choices)
        if kind in (int, float) and not (self.off is not None and value == self.off):
            _range(key, value, self.lo, self.hi, self.lo_open)
        return value


def key(default: Scalar, doc: str, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
        choices: tuple[str, ...] | None = None, off: float | None = None, allowed: str = "",
        kind: type | None = None) -> Any:
    """A section field that is a run-config key (see the module docstring)."""
    spec = KeySpec(default=default, doc=doc, lo=lo, hi=hi, lo_open=lo_open, choices=choices, off=off,
                   allowed=allowed, kind=kind)
    return dataclasses.field(default=default, metadata={"key": spec})


_S = TypeVar("_S", bound="_Section")
_KINDS = {"int": int, "float": float, "str": str, "bool": bool}
SECTIONS: dict[str, type] = {}  # section name -> its dataclass, in declaration (= documentation) order


def section(name: str):
    """Class decorator: a frozen dataclass whose :func:`key` fields are the keys ``<name>.<field>``."""

    def wrap(cls):
        cls = dataclass(frozen=True)(cls)
        specs = []
        for f in dataclasses.fields(cls):
            spec = f.metadata.get("key")
            if spec is None:
                continue
            kind = spec.kind or _KINDS.get(f.type if isinstance(f.type, str) else f.type.__name__)
            if kind is None:
                raise TypeError(f"{cls.__name__}.{f.name}: annotation {f.type!r} needs key(..., kind=...)")
            specs.append(dataclasses.replace(spec, kind=kind, attr=f.name, name=f"{name}.{f.name.replace('_', '-')}"))
        cls.SECTION, cls.KEYS = name, tuple(specs)
        SECTIONS[name] = cls
        return cls

    return wrap


class _Section:
    """Base of the section dataclasses: validation on construction (every key, then ``check``)."""

    SECTION: ClassVar[str]
    KEYS: ClassVar[tuple[KeySpec, ...]]

    def __post_init__(self) -> None:
        for spec in self.KEYS:
            value = getattr(self, spec.attr)
            if isinstance(value, tuple):  # already parsed (schedule.phases), checked when it was parsed
                continue
            object.__setattr__(self, spec.attr, spec.check(value))
        self.check()

    def check(self) -> None:
        """Checks across the keys of this section (none by default)."""


TRAINABLE_MODES = ("all", "router+experts", "lora")  # what the rest of the code sees (`auto` is resolved)
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZE_MODES = ("none", "4bit", "8bit")
_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:[0-9]+)?)$")
# node-config keys a data owner may set for its own hardware: node key -> train.<attr>
HARDWARE_KEYS = {"device": "device", "dtype": "dtype", "gradient-checkpointing": "gradient_checkpointing",
                 "micro-batch-size": "micro_batch_size", "quantize": "quantize"}
GRANULARITIES = ("batch", "token")
BALANCE_MODES = ("aux", "bias", "aux+bias")
AUX_SCOPES = ("layer", "pooled")  # routing.aux-loss-scope (distmoe.routing.losses)
BALANCE_COUNTS = ("topk", "first")  # routing.balance-count: what the bias update counts
BALANCE_SOURCES = ("party", "public")  # routing.balance-source: whose tokens the bias update counts
SETTLE_SCHEDULES = ("constant", "linear")  # routing.balance-settle-schedule: the settle's u per update
PHASE_KINDS = ("sft", "stats", "eval", "rl", "dpo")
UPDATE_KINDS = ("sft", "rl", "dpo")  # the phases that train and release a model update (a task, '*rounds')
DPO_REFERENCES = ("phase", "round")
EXPERT_SCHEDULES = ("constant", "cosine")
TASK_ANCHOR_MODES = ("off", "sum", "mean")
POLICY_LOSSES = ("grpo", "reinforce")  # distmoe/rl/losses.py registry (a test keeps them equal)
REWARDS = ("exact_match", "numeric", "format", "task")  # distmoe/rl/rewards.py registry
CORRECTIONS = {"icepop": "mask", "tis": "truncate", "none": "none"}
ENGINE_PARTS = ("exact", "bf16", "int8-dynamic", "int8-weight-only")
PRIVACY_MODES = ("secagg", "plaintext")
SECAGG_GRAPHS = ("complete", "harary")  # == distmoe.privacy.secagg.GRAPHS (a test keeps them equal)
ROUND_FAILURE_POLICIES = ("skip", "stop")
_TASK_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_DAY = 86400.0


# ---------------------------------------------------------------------------------------------
# The declaration: one section dataclass per run-config section, in documentation order
# ---------------------------------------------------------------------------------------------
@section("run")
class RunSection(_Section):
    seed: int = key(0, "seeds the tiny model's initialisation, data splits, synthetic data and local training",
                    lo=0)
    dir: str = key("", "where the ServerApp writes the run; `\"\"` = `./runs/<flower run id>` (simulate sets it)",
                   allowed="path")
    name: str = key("", "free label stored in the run record")
    resume: str = key("", "continue the run in this directory from its last good checkpoint (`docs/operations.md`, "
                      "Resume); `\"\"` = a new run; checked by the coordinator, which holds the directory",
                      allowed="path")
    init_from: str = key("", "start a new run from this checkpoint directory (`RUN/checkpoints/round-<n>`, e.g. one "
                         "that `distmoe rollback` names, or a warm-up base): its weights and its anchor; `\"\"` = "
                         "from `model.*` (`docs/operations.md`, Rollback)", allowed="path")

    def check(self) -> None:
        if self.resume != self.resume.strip() or "\n" in self.resume:
            raise ConfigError(f"config key 'run.resume': value {self.resume!r} must be a run directory path "
                              "(no surrounding whitespace) or \"\" for a new run")


@section("model")
class ModelConfig(_Section):
    path: str = key("", "local Hugging Face checkpoint of a supported MoE family (`docs/checkpoints.md`); `\"\"` = "
                    "the tiny default Qwen3-MoE. A checkpoint of another architecture is refused with a message "
                    "naming it and why",
                    allowed="directory")
    trainable: str = key("auto", "what is trained and sent; only these tensors travel; `auto` = `lora` when "
                         "`model.path` is set (the server then holds the adapters only), else `all`",
                         choices=("auto", *TRAINABLE_MODES))
    hidden_size: int = key(256, "tiny default: hidden size", lo=1)
    layers: int = key(4, "tiny default: decoder layers, all MoE", lo=1)
    experts: int = key(8, "tiny default: experts per layer", lo=2, hi=256)
    top_k: int = key(2, "tiny default: experts per token", lo=1, allowed="1..`model.experts`")
    moe_intermediate_size: int = key(256, "tiny default: expert MLP width", lo=1)
    heads: int = key(4, "tiny default: attention heads", lo=1)
    kv_heads: int = key(2, "tiny default: key/value heads", lo=1, allowed=">= 1, divides `model.heads`")
    head_dim: int = key(64, "tiny default: attention head width", lo=1)
    max_seq_len: int = key(96, "tokens per example (prompt truncated from the left; the answer always kept)",
                           lo=16, hi=8192)
    lora_r: int = key(8, "`lora` mode: adapter rank", lo=1)
    lora_alpha: int = key(16, "`lora` mode: adapter scale", lo=1)
    lora_router: bool = key(True, "`lora` mode: adapt the router weight too")
    lora_experts: bool = key(True, "`lora` mode: adapt the fused expert weights (peft `target_parameters`); peft "
                             "materialises each adapted expert tensor in full on every forward, so at tens of billions "
                             "of parameters turn this off (attention and router adapters only; `docs/checkpoints.md`)")
    warmup_steps: int = key(0, "tiny default: > 0 starts the run from a base warmed up centrally for this many steps "
                            "on public synthetic data of every task family (fixed seed, never a party's data), built "
                            "once and cached (`docs/algorithms.md`, Warm-up base); 0 = random initialisation",
                            lo=0, hi=1_000_000)
    warmup_cache: str = key("", "where warm-up bases are cached, one directory per (config, seed); `\"\"` = "
                            "`base-cache/` beside the run directory", allowed="path")
    seed: int = 0  # not a key: = run.seed, so the tiny default model is initialised identically everywhere
    balance_bias: bool = False  # not a key: routing.balance has a routing bias (it is part of the model)

    def check(self) -> None:
        if self.trainable == "auto":  # resolved once, here: the rest of the code sees a concrete mode
            object.__setattr__(self, "trainable", "lora" if self.path else "all")
        _range("model.top-k", self.top_k, 1, self.experts)
        if self.warmup_steps and (self.path or self.trainable == "lora"):
            raise ConfigError(f"config key 'model.warmup-steps': value {self.warmup_steps} warms up the tiny default "
                              "model (model.path = \"\", model.trainable all or router+experts); a checkpoint is "
                              "already a base")
        if self.heads % self.kv_heads:
            raise ConfigError(f"config key 'model.kv-heads': value {self.kv_heads} must divide "
                              f"model.heads = {self.heads}")


@section("data")
class DataConfig(_Section):
    eval_fraction: float = key(0.2, "held-out share of each task, split by a stable hash of each example",
                               lo=0.0, hi=0.9, lo_open=True)
    max_train_examples: int = key(0, "cap per task (0 = none)", lo=0)
    max_eval_examples: int = key(48, "held-out examples evaluated per task", lo=1)
    synth_examples: int = key(240, "examples per task per party written by `distmoe simulate` without `--data`",
                              lo=10)
    canary_file: str = key("", "optional canary list (one string per line) the audit searches for in every "
                           "server-side file; `\"\"` = each party's `<data-path>/canaries.txt`", allowed="path")
    seed: int = 0  # not a key: = run.seed


@section("train")
class TrainConfig(_Section):
    local_steps: int = key(40, "optimizer steps per SFT round at each party", lo=1)
    batch_size: int = key(16, "sequences per step", lo=1, hi=4096)
    lr: float = key(1e-3, "AdamW learning rate of the rest group (neither experts nor router)", lo=0.0, hi=1.0)
    lr_experts: float = key(1e-3, "AdamW learning rate of the expert weights", lo=0.0, hi=1.0)
    lr_router: float = key(1e-3, "AdamW learning rate of the router weights", lo=0.0, hi=1.0)
    weight_decay: float = key(0.0, "AdamW weight decay", lo=0.0, hi=1.0)
    warmup_steps: int = key(5, "linear warm-up at the start of each local round", lo=0)
    grad_clip: float = key(1.0, "gradient-norm clipping (also of the local RL updates)", lo=0.0, lo_open=True)
    winsorize: float = key(0.0, "gradient winsorisation (SFT and local RL): each gradient element is clamped to this "
                           "many RMS of its own tensor before the norm clip (`docs/algorithms.md`, Stability "
                           "guards); 0 = off", lo=1.0, hi=1e6, off=0.0)
    threads: int = key(1, "torch threads per party process", lo=1, hi=256)
    device: str = key("auto", "where a party computes: `auto` (the first CUDA device, else Apple `mps`, else `cpu`), "
                      "`cpu`, `cuda`, `cuda:N`, `mps`; each data owner may set its own in its node config (`device`)",
                      allowed="auto, cpu, cuda, cuda:N, mps")
    dtype: str = key("float32", "the frozen base's dtype at a party; below float32, what trains stays float32 "
                     "(master weights, optimizer state) and forwards run under autocast (`docs/checkpoints.md`); "
                     "node config `dtype` overrides", choices=DTYPES)
    gradient_checkpointing: bool = key(False, "recompute activations in the backward pass (less memory, about a "
                                       "third more compute); node config `gradient-checkpointing` overrides")
    micro_batch_size: int = key(0, "sequences per forward/backward; a step accumulates `train.batch-size` / this many "
                                "micro-batches, so the effective batch does not depend on memory; 0 = the whole batch; "
                                "node config `micro-batch-size` overrides", lo=0, hi=4096)
    quantize: str = key("none", "load the frozen base quantised with bitsandbytes (QLoRA; CUDA only, needs "
                        "`model.trainable = \"lora\"` and the `quant` extra); node config `quantize` overrides",
                        choices=QUANTIZE_MODES)
    router_warmup_steps: int = key(0, "router-only warm-up: the first N local steps of each task (its sft phase) "
                                   "update only the router (the other gradients are dropped); 0 = off "
                                   "(`docs/algorithms.md`)", lo=0)
    router_lr_scale: float = key(1.0, "multiplies `train.lr-router` (a low, constant router rate: e.g. 0.1 with "
                                 "`train.expert-schedule = \"cosine\"`)", lo=0.0, hi=100.0)
    expert_schedule: str = key("constant", "per-group schedule after the linear warm-up: `constant` (every group), "
                               "`cosine` (experts and rest decay by a cosine to 0 over the round's local steps, the "
                               "router stays constant)", choices=EXPERT_SCHEDULES)

    def check(self) -> None:
        if not _DEVICE_RE.match(self.device):
            raise ConfigError(f"config key 'train.device': value {self.device!r} is not one of auto, cpu, cuda, "
                              "cuda:N (N a device index), mps")


@section("routing")
class RoutingConfig(_Section):
    aux_loss_coef: float = key(0.01, "aux load-balance loss weight (`routing.balance` `aux` or `aux+bias`)",
                               lo=0.0, hi=100.0)
    aux_loss_scope: str = key("layer", "where the aux loss is taken: `layer` one Switch loss per MoE layer, "
                              "averaged (the paper's), `pooled` transformers' `load_balancing_loss_func`, whose "
                              "expert counts are summed over layers first (`docs/algorithms.md`, Load balancing)",
                              choices=AUX_SCOPES)
    balance: str = key("aux", "expert load balancing: `aux` the aux loss (Switch Transformer), `bias` a per-expert "
                       "routing bias for the top-k choice only, updated after each local step, no aux loss "
                       "(auxiliary-loss-free balancing, Wang et al. 2024), `aux+bias` both; the bias travels and "
                       "aggregates like the weights (`docs/algorithms.md`); not with `model.trainable = \"lora\"`",
                       choices=BALANCE_MODES)
    balance_rate: float = key(0.05, "u: the routing bias moves by u * sign(mean load - expert load) per local step",
                              lo=0.0, hi=1.0)
    balance_count: str = key("topk", "what the routing bias balances: `topk` every chosen expert of each token (the "
                             "paper's load), `first` each token's first choice only (the expert it weighs most: the "
                             "top-1 load the probe's load CV measures)", choices=BALANCE_COUNTS)
    balance_source: str = key("party", "whose tokens the routing bias counts: `party` the party's training batch, "
                              "`public` the public balance batch of each step (`routing.public-balance-*`; the bias "
                              "then balances the public mixture, `docs/algorithms.md`, Public balance)",
                              choices=BALANCE_SOURCES)
    balance_settle_steps: int = key(0, "after each aggregated update, every party makes this many bias-only "
                                    "updates of the new global model's routing bias on public balance batches, "
                                    "weights held still, and the coordinator keeps the median (`docs/algorithms.md`, "
                                    "Settling the bias); needs `routing.balance-source = \"public\"`; 0 = off",
                                    lo=0, hi=10000)
    balance_settle_rate: float = key(0.02, "u of the first settle update (smaller than `routing.balance-rate`: the "
                                     "sign update's jitter is u per update); a settle moves each bias entry by at "
                                     "most the sum of its K rates, and the coordinator refuses a reply beyond that",
                                     lo=0.0, hi=1.0)
    balance_settle_schedule: str = key("linear", "u of the i-th of K settle updates: `linear` rate x (1 - i/K), "
                                       "decaying to rate/K at the last (the sign update's jitter shrinks as the bias "
                                       "nears its fixed point; measured lower load CV than `constant`, "
                                       "`docs/results.md`), `constant` the rate at each", choices=SETTLE_SCHEDULES)
    public_balance_coef: float = key(0.0, "public balance: each local step adds this times the gradient of the "
                                     "first-choice Switch load-balance loss on a batch of public prompts, to the "
                                     "router weights only (`docs/algorithms.md`, Public balance); 0 = off",
                                     lo=0.0, hi=100.0)
    public_balance_batch: int = key(16, "public prompts per local step of the public balance", lo=1, hi=256)
    public_balance_path: str = key("", "a JSONL file of public prompts (`{\"prompt\": \"...\"}` per line), at "
                                   "this path at every party, for the public balance; `\"\"` = 96 public "
                                   "synthetic prompts per style (`routing.public-balance-styles`) drawn apart "
                                   "from the probe's")
    public_balance_styles: int = key(12, "the default public balance set spans this many generator indices (styles) "
                                     "of the public synthetic families, 96 prompts each: the generators vary "
                                     "operations, number ranges and key windows with the index, with period 12, so "
                                     "12 covers every variant; 1 = the one style used before 2026-12-04 "
                                     "(`docs/algorithms.md`, Public balance)", lo=1, hi=64)
    anchor_kl_coef: float = key(0.5, "anchor-KL weight; 0 turns the anchor off", lo=0.0, hi=1000.0)
    anchor_granularity: str = key("batch", "where the anchor KL is taken; see `docs/algorithms.md`",
                                  choices=GRANULARITIES)
    probe_every: int = key(1, "routing metrics on the public probe set every this many rounds (the round's global "
                           "model, at every party, no privacy cost: `docs/operations.md`, Routing probe); 0 = off",
                           lo=0, hi=100000)
    probe_prompts: int = key(16, "size of the default probe set (public prompts of the synthetic task families, "
                             "drawn from `run.seed`)", lo=1, hi=256)
    probe_path: str = key("", "a JSONL file of public probe prompts, one `{\"prompt\": \"...\"}` per line, read by "
                          "the coordinator and sent to the parties; `\"\"` = the default probe set")
    load_cv_warn: float = key(1.0, "warn when the probe's top-1 load CV exceeds this (1.0: about half the experts "
                              "idle; healthy < 0.2); 0 = off", lo=0.0, hi=100.0)
    kl_rise_rounds: int = key(3, "warn when the probe's routing KL to the anchor rises this many rounds in a row; "
                              "0 = off", lo=0, hi=100000)


@section("retention")
class RetentionConfig(_Section):
    task_anchors: str = key("off", "per-task anchors: the anchor KL is taken against each earlier task's own anchor "
                            "(from its `stats:<task>` phase) and the per-task KLs are summed (`sum`) or averaged "
                            "(`mean`), times `routing.anchor-kl-coef`; `off` = the latest anchor only",
                            choices=TASK_ANCHOR_MODES)
    protect_mass: float = key(0.0, "expert protection: an expert whose routing mass in some earlier task's anchor "
                              "exceeds this is protected while a new task trains (its update scaled by "
                              "`retention.protect-lr-scale`); 0 = off", lo=0.0, hi=1.0, lo_open=True, off=0.0)
    protect_lr_scale: float = key(0.0, "learning-rate scale of a protected expert's tensors (0 = frozen)",
                                  lo=0.0, hi=1.0)
    distill_weight: float = key(0.0, "output distillation (Learning without Forgetting) weight: KL from the pre-task "
                                "model's to the current model's token distribution on the new task's data; 0 = off",
                                lo=0.0, hi=1000.0)
    distill_temperature: float = key(2.0, "temperature of the output distillation", lo=0.0, hi=100.0, lo_open=True)
    expand_experts: int = key(0, "dynamic expert expansion (Lifelong-MoE): experts (and router rows) added to every "
                              "MoE layer at each new `sft` task after the first, copies of the experts with the most "
                              "routing mass in the latest anchor; every earlier expert and its router row is frozen "
                              "while the new task trains. Needs `model.trainable` = `all` or `router+experts` and "
                              "a family with fused experts and a bias-free router (qwen3_moe, qwen2_moe, olmoe, "
                              "flex_olmo, mixtral); 0 = off", lo=0, hi=256)

    @property
    def protect(self) -> bool:
        return self.protect_mass > 0


@section("rl")
class RLConfig(_Section):
    """Local GRPO (``distmoe.rl.grpo.run_grpo`` takes this section as it is)."""

    steps: int = key(6, "GRPO steps per `rl` round at each party", lo=1, hi=100000)
    prompts_per_step: int = key(8, "prompts per GRPO step", lo=1, hi=100000)
    group_size: int = key(4, "samples per prompt (G, group-relative advantages)", lo=2, hi=1024)
    max_new_tokens: int = key(8, "rollout length", lo=1, hi=100000)
    temperature: float = key(1.0, "sampling temperature (applied identically in the trainer)", lo=0.0, hi=100.0,
                             lo_open=True)
    lr: float = key(1e-4, "AdamW learning rate of the RL updates (every parameter group)", lo=0.0, hi=1.0,
                    lo_open=True)
    ppo_epochs: int = key(1, "passes over each rollout batch", lo=1, hi=100000)
    minibatches: int = key(2, "updates per pass", lo=1, hi=100000,
                           allowed="1..`rl.prompts-per-step` x `rl.group-size`")
    clip_eps: float = key(0.2, "PPO clip of the train/train ratio (symmetric)", lo=0.0, hi=0.99, lo_open=True)
    kl_coef: float = key(0.0, "k3 KL to the policy at the start of the round", lo=0.0, hi=100.0)
    policy_loss: str = key("grpo", "the policy-loss registry entry", choices=POLICY_LOSSES)
    correction: str = key("icepop", "train/inference mismatch correction: `icepop` masks, `tis` truncates",
                          choices=tuple(CORRECTIONS))
    correction_level: str = key("token", "where the ratio k is computed (`sequence`: geometric mean)",
                                choices=("token", "sequence"))
    icepop_low: float = key(0.5, "IcePop keeps tokens with low <= k <= high", lo=0.0, hi=1.0)
    icepop_high: float = key(5.0, "IcePop upper bound of k (also the TIS truncation)", lo=1.0, hi=1e6)
    engine: str = key("bf16", "the rollout engine's numerics",
                      allowed="`exact`, `bf16`, `int8-dynamic`, `int8-weight-only`, `prune-<k>`, joined with `+`")
    reward: str = key("task", "verifiable reward", choices=REWARDS)
    simulator: bool = key(False, "use the ICEPOP seed's inference simulator's δ̂ for the mismatch weights (falls "
                          "back to the recompute when it degrades)")
    simulator_recalibrate_every: int = key(5, "GRPO steps between calibrations", lo=1)
    simulator_bound: float = key(0.5, "tokens with abs δ̂ above this are masked", lo=0.0, lo_open=True)
    simulator_buffer_tokens: int = key(16384, "calibration tokens the simulator keeps across steps (bounded FIFO of "
                                       "calibration batches and trained-on batches; 0: only the latest calibration)",
                                       lo=0, hi=10_000_000)
    simulator_heldout_frac: float = key(0.05, "share of the party's prompts held out of training (stratified over "
                                        "short/medium/long prompts) on which the simulator's error is measured",
                                        lo=0.0, hi=0.5)
    simulator_incremental: bool = key(True, "between full fits, refit the error MLP's last layer (ridge) on the "
                                      "buffer after every step")
    simulator_error_shift: float = key(0.5, "full recalibration when the held-out mean abs(δ̂ - δ) exceeds its value "
                                       "after the last full fit by this relative amount (on the held-out "
                                       "rollouts drawn at that fit, re-scored each step)", lo=0.0, lo_open=True)
    simulator_route_shift: float = key(0.1, "full recalibration when the policy's expert usage (mean over MoE layers "
                                       "of the total-variation distance, on the last full fit's calibration "
                                       "tokens) moved this far from the last full fit",
                                       lo=0.0, hi=1.0, lo_open=True)
    simulator_clip: bool = key(False, "clip δ̂ to ±`rl.simulator-bound` (the seed's form) instead of masking the "
                               "tokens beyond it (the default)")
    simulator_lb_coef: float = key(0.01, "coefficient of the load-balance loss on the simulated routing "
                                   "`z_train + o`, added on the steps where the simulator is used (not on fallback "
                                   "steps); `0.01` = `routing.aux-loss-coef`'s default", lo=0.0, hi=100.0)
    reuse_logprobs: bool = key(True, "on-policy reuse: the first PPO minibatch's own forward (at theta_old) gives its "
                               "rows' `logp_old` (detached) instead of a separate no-grad pass; only the other rows "
                               "are recomputed (none with one epoch and `rl.minibatches = 1`); off automatically with "
                               "`rl.simulator`, `rl.routing-replay` or an active dropout")
    routing_replay: bool = key(False, "routing replay: the trainer's forwards use the experts the engine's routers "
                               "chose during generation, weighted by the trainer's own router; combines with every "
                               "`rl.correction`, not with `rl.simulator`")

    @property
    def mode(self) -> str:
        """The mismatch-weight mode of ``distmoe.rl.losses.mismatch_weights``."""
        return CORRECTIONS[self.correction]

    def check(self) -> None:
        rollouts = self.prompts_per_step * self.group_size
        if self.minibatches > rollouts:
            raise ConfigError(f"config key 'rl.minibatches': value {self.minibatches} exceeds "
                              f"rl.prompts-per-step x rl.group-size = {rollouts}")
        for part in self.engine.split("+"):
            if part not in ENGINE_PARTS and not re.fullmatch(r"prune-[1-9]\d*", part):
                raise ConfigError(f"config key 'rl.engine': value {self.engine!r}: {part!r} is not one of "
                                  f"{', '.join(ENGINE_PARTS)}, prune-<k> (parts combine with '+', e.g. "
                                  "'bf16+prune-1')")
        if self.routing_replay and self.simulator:
            raise ConfigError("config key 'rl.routing-replay': value true cannot be combined with rl.simulator = "
                              "true (two alternative mitigations of the routing gap: replay removes the gap the "
                              "simulator models; choose one)")


@section("dpo")
class DPOConfig(_Section):
    """Local DPO in `dpo` phases (``distmoe.train.dpo``; the optimiser, clipping and micro-batches are `train.*`'s)."""

    beta: float = key(0.1, "DPO β: the strength of the implicit KL to the reference", lo=0.0, hi=100.0, lo_open=True)
    steps: int = key(20, "optimizer steps per `dpo` round at each party", lo=1, hi=100000)
    pairs_per_step: int = key(8, "preference pairs per step", lo=1, hi=4096)
    reference: str = key("phase", "the reference model: `phase` = the global model at the start of the `dpo` phase "
                         "(sent with later rounds' instructions), `round` = the global model each round as received",
                         choices=DPO_REFERENCES)
    reference_engine: str = key("", "who computes the reference log-probs: `\"\"` = the trainer (exact); an "
                                "inference engine profile (as `rl.engine`) = that engine, with pairs IcePop-masked "
                                "where a token's "
                                "trainer/engine reference ratio leaves [`rl.icepop-low`, `rl.icepop-high`] "
                                "(`docs/algorithms.md`, DPO)",
                                allowed="`\"\"`, or `exact`, `bf16`, `int8-dynamic`, `int8-weight-only`, `prune-<k>` "
                                        "joined with `+`")

    def check(self) -> None:
        for part in (self.reference_engine.split("+") if self.reference_engine else ()):
            if part not in ENGINE_PARTS and not re.fullmatch(r"prune-[1-9]\d*", part):
                raise ConfigError(f"config key 'dpo.reference-engine': value {self.reference_engine!r}: {part!r} is "
                                  f"not one of {', '.join(ENGINE_PARTS)}, prune-<k> (parts combine with '+', e.g. "
                                  "'bf16+prune-1'), or \"\" for the trainer")


@dataclass(frozen=True)
class Phase:
    kind: str  # sft | stats | eval | rl | dpo
    task: str | None
    rounds: int

    def label(self) -> str:
        return self.kind + (f":{self.task}" if self.task else "")


@section("schedule")
class ScheduleConfig(_Section):
    phases: tuple[Phase, ...] = key("sft:lookup, eval, stats:lookup, sft:arith, eval", "the round schedule",
                                    kind=str, allowed="grammar below")  # parsed by check()
    sft_rounds: int = key(5, "rounds of an `sft`, `rl` or `dpo` phase without `*n`", lo=1, hi=100000)

    def check(self) -> None:
        if isinstance(self.phases, str):
            object.__setattr__(self, "phases", parse_schedule(self.phases, self.sft_rounds))

    @property
    def total_rounds(self) -> int:
        return sum(p.rounds for p in self.phases)

    @property
    def tasks(self) -> tuple[str, ...]:
        seen: list[str] = []
        for p in self.phases:
            if p.task and p.task not in seen:
                seen.append(p.task)
        return tuple(seen)


@section("federation")
class FederationConfig(_Section):
    min_available: int = key(2, "parties that must be connected before the run starts and at every round; "
                             "simulate sets it to the number of parties", lo=1)
    wait_timeout: float = key(180.0, "seconds the server waits for `federation.min-available` parties at start",
                              lo=1.0)
    round_timeout: float = key(900.0, "seconds for the training stage of a round (instruction out, update, "
                               "statistics, eval or masked input back); late parties are left out of that round and "
                               "rejoin at the next", lo=1.0, hi=_DAY)
    setup_timeout: float = key(300.0, "seconds for each of the two secure-aggregation setup exchanges (a deployed "
                               "ClientApp's first start, imports included, can take tens of seconds)", lo=1.0, hi=_DAY)
    unmask_timeout: float = key(120.0, "seconds for each of the consistency-check and unmask exchanges of a secure "
                                "round (no training in them)", lo=1.0, hi=_DAY)
    on_round_failure: str = key("skip", "a round that releases nothing (fewer than the threshold survived, or the "
                                "server rejected the sum): `skip` leaves the model/anchor unchanged and goes on; "
                                "`stop` ends the run with a message naming the round", choices=ROUND_FAILURE_POLICIES)
    max_norm_ratio: float = key(10.0, "plaintext mode: an update whose L2 norm is above this many times the round's "
                                "median (3+ updates) is rejected and logged. Under secure aggregation the server "
                                "checks the decoded sum instead (total weight ≤ n, one per contributing party, "
                                "average norm ≤ `privacy.update-clip`, plus noise)", lo=1.0, hi=1e6, lo_open=True,
                                off=0.0)
    anomaly_z: float = key(4.0, "an aggregate training loss (or RL K3 / mean abs Δlogp) beyond this many rolling "
                           "standard deviations above its last 8 rounds, or non-finite, is flagged in `run.json` "
                           "(`anomalies`), `metrics.jsonl` and the report (plaintext mode: under secure "
                           "aggregation no training metric reaches the server); 0 turns the spike test off",
                           lo=0.0, hi=1000.0)
    divergence_max: float = key(0.0, "per-tensor divergence check of every applied aggregate update: a tensor whose "
                                "largest absolute change exceeds this is flagged as a warning in `run.json`, the "
                                "progress stream, `metrics.jsonl` (`anomaly`) and the report, naming the tensors "
                                "(`docs/operations.md`); 0 = off",
                                lo=0.0, hi=1e6, lo_open=True, off=0.0)


@section("privacy")
class PrivacyConfig(_Section):
    mode: str = key("secagg", "`secagg`: every reply is a masked vector in secure aggregation, the server sees sums "
                    "only. `plaintext`: a benchmark baseline that sends plain arrays; it warns at start, is recorded "
                    "in the ledger and `distmoe audit` fails the run", choices=PRIVACY_MODES)
    epsilon: float = key(8.0, "per-party budget (at `privacy.delta`) over the run, unit one sequence (add/remove); "
                         "each party's budget is `min(privacy.epsilon, node epsilon-max)`", lo=0.0, hi=1000.0,
                         lo_open=True)
    delta: float = key(1e-6, "δ of the (ε, δ) guarantee", lo=0.0, hi=0.1, lo_open=True,
                       allowed="(0, 0.1], <= 1/`privacy.num-sequences-max`")
    noise_multiplier: float = key(0.0, "z of the router-statistics noise; `0` = derived from `privacy.epsilon` over "
                                  "the schedule's `stats` releases (`distmoe config show` prints z and the planned "
                                  "ε). A given z whose plan exceeds the budget is refused at config time",
                                  lo=0.0, hi=1e6)  # see distmoe.privacy.plan for the resolved value
    scale: float = key(64.0, "integer encoding scale s of router statistics: each sequence's per-layer routing row "
                       "is rounded onto the integer simplex of size s (mass-preserving, so every row sums to s)",
                       lo=32.0, hi=2.0**20, allowed="integer in [32, 2^20]")
    noise_canaries: int = key(2048, "K known-zero noise-canary coordinates per router-statistics release; the "
                              "audit's χ² test on them detects missing noise (at the audit's level 1e-4, K = 2048 "
                              "caught one of 6 parties skipping its share in 40 of 40 rounds, K = 256 in 1 of 40)",
                              lo=0, hi=1 << 20)
    min_parties: int = key(2, "fewest parties any release is aggregated over; floor of the SecAgg threshold "
                           "`t = max(min-parties, n//2 + 1)`; parties refuse an unmask that names fewer",
                           lo=2, hi=10000, allowed="2..10000, <= `federation.min-available` in `secagg` mode")
    secagg_graph: str = key("complete", "the SecAgg peer graph: `complete` (Bonawitz et al. 2017: every party masks "
                            "with and shares to all others) or `harary` (SecAgg+, Bell et al. 2020: a k-regular "
                            "Harary graph over a public permutation keyed by the run id, k from the bound in "
                            "`distmoe/privacy/secagg/graph.py`, threshold `t = max(min-parties, ⌊(k+1)/2⌋ + 1)` per "
                            "neighbourhood). With the default bound `harary` equals `complete` up to 25 parties; "
                            "above that it cuts each party's masks and shares from n to k + 1 (k = 22 at 50 "
                            "parties), at the price of a guarantee that holds with probability 1 − 2^-40 for up to "
                            "10 % colluding and 10 % dropped parties, and more DP noise per party (shares are "
                            "over-provisioned for n − t dropouts); see `docs/results.md` \"Scale\"",
                            choices=SECAGG_GRAPHS)
    num_sequences_max: int = key(10000, "public bound on a party's sequences per release (a party above it "
                                 "refuses its router statistics, never cuts; fixes the bit width, checked so the "
                                 "64-bit sum cannot wrap)",
                                 lo=1, hi=10**9)
    update_clip: float = key(10.0, "L2 bound a model update is clipped to before masking (fixes the fixed-point "
                             "range)", lo=0.0, hi=1e6, lo_open=True)
    ring_bits: str = key("auto", "ring width of model-update sums: `auto` = 32-bit words when the public bound "
                         "(parties x `update-clip`, plus the update-noise tail) leaves at least 20 fractional bits "
                         "(quantisation step <= 2^-20, stochastic rounding, unbiased), else 64; `32` refuses a "
                         "release that does not fit; `64` always 64-bit words (router statistics and evaluation "
                         "sums are always 64-bit); see `docs/privacy.md` §3", choices=("auto", "32", "64"))
    secagg_premask: bool = key(True, "expand a model-update round's masks in a second thread while the party "
                               "trains (they do not depend on the update; one update-sized buffer more), then add "
                               "them in one pass; only where the process has more than one core")
    update_noise_multiplier: float = key(0.0, "> 0: client-level DP on model updates (distributed Skellam): noise "
                                         "`z_u * update-clip` in the sum, uniform weights and training metrics "
                                         "withheld (they stay in each party's log), accounted per party",
                                         lo=0.0, hi=1e6)
    metric_noise_multiplier: float = key(3.0, "z_m of the distributed Skellam noise on every evaluation release "
                                         "under secure aggregation (per-example correct answers, clipped losses "
                                         "and counts per task, one held-out sequence = sensitivity sqrt(3) examples)"
                                         "; each eval round is one release in the per-sequence ledger. At 3 the "
                                         "default run's two eval rounds spend epsilon 2.28 on their own",
                                         lo=0.0, hi=1e6, lo_open=True)
    metric_loss_bound: float = key(16.0, "B: each held-out example's mean answer-token loss is clipped to [0, B] "
                                   "nats before it enters the noised evaluation sum (the released loss is a mean of "
                                   "clipped losses; its noise scales with B)", lo=0.0, hi=1e4, lo_open=True)

    @property
    def secure(self) -> bool:
        return self.mode == "secagg"

    def check(self) -> None:
        if self.scale != int(self.scale):
            raise ConfigError(f"config key 'privacy.scale': value {self.scale:g} must be an integer (router "
                              "statistics are rounded onto the integer simplex of that size)")
        if self.delta > 1.0 / self.num_sequences_max:
            raise ConfigError(f"config key 'privacy.delta': value {self.delta:g} must be <= 1/privacy.num-sequences-"
                              f"max = {1.0 / self.num_sequences_max:g} (delta must stay below 1/N for a meaningful "
                              "guarantee)")


@section("checkpoint")
class CheckpointConfig(_Section):
    keep: int = key(2, "checkpoints kept (oldest pruned) besides the initial model and the model before each task, "
                    "which are always kept (`distmoe rollback`)", lo=1)


@section("eval")
class EvalConfig(_Section):
    max_new_tokens: int = key(10, "greedy generation length for accuracy", lo=1, hi=1024)
    batch_size: int = key(32, "evaluation and statistics batch size", lo=1, hi=4096)
    every: int = key(0, "also evaluate after every this many rounds of each `sft`/`rl` phase (an `eval` round "
                     "inserted in the schedule, charged by the privacy plan like any other); 0 = only where "
                     "the schedule says", lo=0, hi=100000)


@section("report")
class ReportConfig(_Section):
    tensorboard: bool = key(False, "also write every aggregate metric of `metrics.jsonl` as TensorBoard scalars under "
                            "`RUN/tensorboard/` when the report is written (`distmoe simulate`; `distmoe report "
                            "--tensorboard` does it for any run); needs the extra `distmoe[tensorboard]`")


@section("sim")
class SimConfig(_Section):
    nodes_dir: str = key("", "internal: where `distmoe simulate` wrote each virtual SuperNode's node file "
                         "(`node-<partition-id>.toml`)", allowed="path")


KEYS: tuple[KeySpec, ...] = tuple(spec for cls in SECTIONS.values() for spec in cls.KEYS)
DEFAULTS: dict[str, Scalar] = {spec.name: spec.default for spec in KEYS}

_UPDATE_DP = ("use privacy.update-noise-multiplier (client-level DP on model updates) instead")
RENAMED: dict[str, str] = {  # old key -> its new name (run records written before the rename use the old one)
    "federation.min-parties": "federation.min-available",
    "privacy.canaries": "privacy.noise-canaries",
    "data.canaries": "data.canary-file",
}
RETIRED: dict[str, str] = {  # old key -> why it is refused (what to use instead)
    "privacy.max-weight": "FedAvg weights are uniform under secure aggregation (weight 1 per contributing party, "
                          "docs/privacy.md §3): an example-count weight would let a straggle difference one party's "
                          "count out of two sums",
    "federation.min-parties": "it was renamed 'federation.min-available' (privacy.min-parties is the other one)",
    "privacy.canaries": "it was renamed 'privacy.noise-canaries' (a count of noise canaries)",
    "data.canaries": "it was renamed 'data.canary-file' (a file of canary strings)",
    "privacy.dp-sgd": "example-level DP-SGD was removed: opacus cannot compute per-sample gradients for the fused "
                      "expert and router parameters of the MoE models; " + _UPDATE_DP,
    "privacy.dp-sgd-noise-multiplier": "example-level DP-SGD was removed: opacus cannot compute per-sample "
                                       "gradients for the fused expert and router parameters of the MoE models; "
                                       + _UPDATE_DP,
}


@dataclass(frozen=True)
class RunConfig:
    run: RunSection
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    routing: RoutingConfig
    retention: RetentionConfig
    rl: RLConfig
    dpo: DPOConfig
    schedule: ScheduleConfig
    federation: FederationConfig
    privacy: PrivacyConfig
    checkpoint: CheckpointConfig
    eval: EvalConfig
    report: ReportConfig
    sim: SimConfig
    raw: tuple[tuple[str, Scalar], ...]  # the resolved flat mapping, for the run record

    def as_flat(self) -> dict[str, Scalar]:
        return dict(self.raw)


@dataclass(frozen=True)
class NodeConfig:
    """Node-local facts: this party's own data directory and work directory, nothing else."""

    party: str
    data_path: Path
    work_dir: Path
    model_path: str  # "" = use the run config's model.path
    epsilon_max: float | None = None  # this party's own budget cap: can only tighten privacy.epsilon
    ledger_key: Path | None = None  # Ed25519 ledger-signing key file; None = <work-dir>/keys/<party>-ledger.key
    hardware: tuple[tuple[str, Scalar], ...] = ()  # this owner's own train.<attr> settings (HARDWARE_KEYS)
    base_cache: Path | None = None  # where the loaded base is kept memory-mappable; None = off
    # print this party's own training progress (loss per round) to its stdout: on in a deployment, where
    # stdout is the SuperNode's log on the owner's machine; off in simulation (clients/app.py decides)
    progress_stdout: bool = False

    def train(self, train: TrainConfig) -> TrainConfig:
        """The run's ``train`` section with this node's hardware settings applied (validated like the keys)."""
        if not self.hardware:
            return train
        node_key = {attr: k for k, attr in HARDWARE_KEYS.items()}
        for attr, value in self.hardware:
            try:
                train = dataclasses.replace(train, **{attr: value})
            except ConfigError as exc:
                raise ConfigError(f"node config key '{node_key[attr]}' (party {self.party!r}): {exc}") from None
        return train


# ---------------------------------------------------------------------------------------------
# Validation helpers
# ---------------------------------------------------------------------------------------------
def _range(key: str, value: float, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False) -> None:
    if lo is not None and (value < lo or (lo_open and value == lo)):
        op = ">" if lo_open else ">="
        raise ConfigError(f"config key '{key}': value {value!r} is out of range (must be {op} {lo})")
    if hi is not None and value > hi:
        raise ConfigError(f"config key '{key}': value {value!r} is out of range (must be <= {hi})")


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"config key '{key}': value {value!r} is not one of {', '.join(allowed)}")


def parse_schedule(text: str, default_rounds: int, key: str = "schedule.phases") -> tuple[Phase, ...]:
    """Parse ``"sft:arith*3, eval, stats:arith, sft:strings, eval"`` into phases.

    Grammar: phases separated by ``,`` or ``->``; each is ``kind[:task][*rounds]``. ``sft``, ``rl`` and
    ``dpo`` need a task (``dpo``: a task of preference pairs); ``stats`` takes an optional task (default:
    every local task); ``eval`` takes none.
    """
    items = [s.strip() for s in re.split(r",|->", text) if s.strip()]
    if not items:
        raise ConfigError(f"config key '{key}': value {text!r} has no phases "
                          f"(expected e.g. 'sft:arith, stats:arith, sft:strings, eval')")
    phases: list[Phase] = []
    for item in items:
        m = re.fullmatch(r"([a-z]+)(?::([^*\s]+))?(?:\*(\d+))?", item)
        if not m:
            raise ConfigError(f"config key '{key}': phase {item!r} is malformed "
                              f"(expected kind[:task][*rounds], kind one of {', '.join(PHASE_KINDS)})")
        kind, task, rounds = m.group(1), m.group(2), m.group(3)
        if kind not in PHASE_KINDS:
            raise ConfigError(f"config key '{key}': phase {item!r} has unknown kind {kind!r} "
                              f"(allowed: {', '.join(PHASE_KINDS)})")
        if task is not None and not _TASK_RE.match(task):
            raise ConfigError(f"config key '{key}': phase {item!r} has an invalid task name {task!r} "
                              "(letters, digits, '-' and '_')")
        if kind in UPDATE_KINDS and task is None:
            raise ConfigError(f"config key '{key}': phase {item!r} needs a task (e.g. '{kind}:arith')")
        if kind == "eval" and task is not None:
            raise ConfigError(f"config key '{key}': phase {item!r}: eval takes no task "
                              "(it evaluates every task seen so far)")
        n = int(rounds) if rounds is not None else (default_rounds if kind in UPDATE_KINDS else 1)
        if n < 1:
            raise ConfigError(f"config key '{key}': phase {item!r} must have at least 1 round")
        if kind not in UPDATE_KINDS and n != 1:
            raise ConfigError(f"config key '{key}': phase {item!r}: only sft, rl and dpo phases take '*rounds'")
        phases.append(Phase(kind=kind, task=task, rounds=n))
    return tuple(phases)


def expansion_tasks(phases: tuple[Phase, ...]) -> list[str]:
    """The tasks whose first ``sft`` phase grows the model under ``retention.expand-experts`` (in schedule order): an
    ``sft`` phase of a task not trained before (by an ``sft``, ``dpo`` or ``rl`` phase), once some task was."""
    out: list[str] = []
    trained: list[str] = []
    for ph in phases:
        if ph.kind == "sft" and ph.task and ph.task not in trained and trained:
            out.append(ph.task)
        if ph.kind in ("sft", "dpo", "rl") and ph.task and ph.task not in trained:
            trained.append(ph.task)
    return out


def with_eval_cadence(phases: tuple[Phase, ...], every: int) -> tuple[Phase, ...]:
    """``eval.every = n``: each ``sft``/``rl`` phase split into runs of ``n`` rounds with an ``eval`` round after
    each full run, except where the schedule already evaluates next (the phase's last run followed by an
    ``eval`` phase). ``sft:a*5, eval`` with ``n = 2`` -> ``sft:a*2, eval, sft:a*2, eval, sft:a,
    eval``. The inserted rounds are ordinary ``eval`` rounds: the privacy plan charges them like any other."""
    if every <= 0:
        return phases
    out: list[Phase] = []
    for i, ph in enumerate(phases):
        if ph.kind not in ("sft", "rl"):
            out.append(ph)
            continue
        nxt = phases[i + 1].kind if i + 1 < len(phases) else None
        left = ph.rounds
        while left > 0:
            n = min(every, left)
            left -= n
            out.append(Phase(ph.kind, ph.task, n))
            if n == every and not (left == 0 and nxt == "eval"):
                out.append(Phase("eval", None, 1))
    return tuple(out)


def schedule_text(schedule: ScheduleConfig) -> str:
    """A parsed schedule for people: ``sft:a*5 -> eval -> stats:a -> sft:b*5 -> eval (13 rounds)``."""
    return (" -> ".join(p.label() + (f"*{p.rounds}" if p.rounds > 1 else "") for p in schedule.phases)
            + f" ({schedule.total_rounds} rounds)")


def continual_schedule(tasks: Sequence[str]) -> str:
    """The schedule derived from a list of tasks, in the shape of the default one (``schedule.phases``).

    One task: ``sft:<t>, eval`` (tune, then evaluate). Several, in the given order: tune on each in
    turn, with an evaluation after each task and the router statistics of the task just tuned
    (``stats:<t>``, the anchor's next version) before the next one, e.g. ``sft:a, eval, stats:a,
    sft:b, eval``. Rounds per ``sft`` phase come from ``schedule.sft-rounds``.
    """
    tasks = list(tasks)
    if not tasks:
        raise ConfigError("config key 'schedule.phases': no tasks to derive a schedule from")
    for t in tasks:
        if not _TASK_RE.match(t):
            raise ConfigError(f"config key 'schedule.phases': invalid task name {t!r} (letters, digits, '-' and '_')")
    dup = sorted({t for t in tasks if tasks.count(t) > 1})
    if dup:
        raise ConfigError(f"config key 'schedule.phases': task(s) {', '.join(dup)} listed more than once")
    phases: list[str] = []
    for i, t in enumerate(tasks):
        if i:
            phases.append(f"stats:{tasks[i - 1]}")
        phases += [f"sft:{t}", "eval"]
    return ", ".join(phases)


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------
def resolve(overrides: Mapping[str, Any] | None = None) -> dict[str, Scalar]:
    """DEFAULTS updated with ``overrides``; an unknown key is an error naming the closest keys, a retired key
    one naming its replacement (or why it was removed)."""
    flat: dict[str, Scalar] = dict(DEFAULTS)
    for key, value in (overrides or {}).items():
        if key in RETIRED:
            raise ConfigError(f"config key '{key}' (value {value!r}) is no longer accepted: {RETIRED[key]}")
        if key not in DEFAULTS:
            section = key.split(".")[0]
            near = [k for k in DEFAULTS if k.startswith(section + ".")]
            hint = f"; keys in '{section}': {', '.join(near)}" if near else \
                f"; sections: {', '.join(SECTIONS)}"
            raise ConfigError(f"unknown config key '{key}' (value {value!r}){hint}")
        flat[key] = value
    return flat


def parse_run_config(run_config: Mapping[str, Any] | None = None) -> RunConfig:
    """Validate a (possibly partial) flat run config and return the frozen tree."""
    flat = resolve(run_config)
    parts: dict[str, Any] = {}
    for name, cls in SECTIONS.items():  # "run" first: model and data carry run.seed (their non-key field)
        derived = {"seed": parts["run"].seed} if name in ("model", "data") else {}
        if name == "model":
            derived["balance_bias"] = "bias" in str(flat["routing.balance"])
        parts[name] = cls(**{s.attr: flat[s.name] for s in cls.KEYS}, **derived)
    _check_across(parts["federation"], parts["privacy"])
    object.__setattr__(parts["schedule"], "phases", with_eval_cadence(parts["schedule"].phases, parts["eval"].every))
    _check_retention(parts["retention"], parts["schedule"])
    if parts["model"].warmup_steps and parts["run"].init_from:
        raise ConfigError("config key 'run.init-from': a run starts from one checkpoint: set it or "
                          "model.warmup-steps, not both")
    if parts["retention"].expand_experts and parts["model"].trainable == "lora":
        raise ConfigError("config key 'retention.expand-experts': expert expansion needs model.trainable = all or "
                          "router+experts (lora adapters of the fused experts are laid out per expert count)")
    if parts["retention"].expand_experts and parts["model"].balance_bias:
        raise ConfigError("config key 'retention.expand-experts': cannot be combined with a routing bias "
                          f"(routing.balance = {parts['routing'].balance!r} keeps one bias slot per expert)")
    if parts["routing"].balance_source == "public" and not parts["model"].balance_bias:
        raise ConfigError("config key 'routing.balance-source': value 'public' moves a routing bias: set "
                          "routing.balance = \"bias\" or \"aux+bias\"")
    if parts["routing"].balance_settle_steps and parts["routing"].balance_source != "public":
        raise ConfigError("config key 'routing.balance-settle-steps': settles the routing bias on the public balance "
                          "batches: set routing.balance-source = \"public\" (and routing.balance = \"aux+bias\" or "
                          "\"bias\")")
    if parts["model"].balance_bias and parts["model"].trainable == "lora":
        raise ConfigError(f"config key 'routing.balance': value {parts['routing'].balance!r} needs the routers "
                          "trained and sent (model.trainable = all or router+experts): in lora mode the routing bias "
                          "would not travel or aggregate")
    flat["model.trainable"] = parts["model"].trainable  # `auto` resolved: the run record names the mode used
    return RunConfig(**parts, raw=tuple(sorted(flat.items())))


def parse_section(run_config: Mapping[str, Any], cls: type[_S]) -> _S:
    """Section ``cls`` alone from a flat run config (its keys only, defaults for the absent ones, validated): for
    a reader that needs it before, or apart from, the whole run config (the ClientApp's ``sim`` section, which
    locates its node config and so its ledger, even when the rest of the run config is refused)."""
    return cls(**{s.attr: run_config.get(s.name, s.default) for s in cls.KEYS})


def _check_across(fed: FederationConfig, p: PrivacyConfig) -> None:
    """The checks between sections."""
    if p.secure and p.min_parties > fed.min_available:
        raise ConfigError(f"config key 'privacy.min-parties': value {p.min_parties} is above "
                          f"federation.min-available = {fed.min_available}: a run could start with fewer parties "
                          "than any release may use")


def _check_retention(r: RetentionConfig, schedule: ScheduleConfig) -> None:
    """Per-task anchors and expert protection read the anchors of ``stats:<task>`` phases, expert expansion needs a
    second ``sft`` task: refuse a schedule without them rather than run with the mechanism silently off."""
    if r.expand_experts and not expansion_tasks(schedule.phases):
        raise ConfigError("config key 'retention.expand-experts' is on, but schedule.phases never starts an `sft` "
                          "phase of a new task after a first one: the model would never grow")
    if any(p.kind == "stats" and p.task for p in schedule.phases):
        return
    for key, on in (("retention.task-anchors", r.task_anchors != "off"), ("retention.protect-mass", r.protect)):
        if on:
            raise ConfigError(f"config key '{key}' is on, but schedule.phases has no `stats:<task>` phase: the "
                              "per-task anchors it reads are built only there")


def load_override_file(path: str | Path) -> dict[str, Scalar]:
    """Read a TOML override file (nested tables or dotted keys) into flat Flower-style keys."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {p}: not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {p}: invalid TOML: {exc}") from None
    # a file may hold a whole pyproject-like tree; take the app config table if present
    if "tool" in raw:
        raw = raw.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {})
    return flatten(raw)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Scalar]:
    out: dict[str, Scalar] = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten(v, key))
        elif isinstance(v, (int, float, str, bool)):
            out[key] = v
        else:
            raise ConfigError(f"config key '{key}': value {v!r} must be a number, string or boolean")
    return out


def parse_kv_pairs(text: str) -> dict[str, Scalar]:
    """Parse Flower's ``"k=v k2='s'"`` override syntax (values are TOML)."""
    out: dict[str, Scalar] = {}
    for m in re.finditer(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)", text):
        key, val = m.group(1), m.group(2)
        try:
            out[key] = tomllib.loads(f"v = {val}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = val  # bare word: treat as a string, as a user would mean it
    leftover = re.sub(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)", "", text).strip()
    if leftover:
        raise ConfigError(f"--run-config: cannot parse {leftover!r} (expected key=value pairs)")
    return out


def to_toml(flat: Mapping[str, Scalar]) -> str:
    """Serialise a flat mapping as TOML with quoted dotted keys (round-trips through flatten)."""
    lines = []
    for k in sorted(flat):
        v = flat[k]
        if isinstance(v, bool):
            s = "true" if v else "false"
        elif isinstance(v, (int, float)):
            s = repr(v)
        else:
            s = '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
        head, _, last = k.rpartition(".")
        lines.append((head, last, s))
    out: list[str] = []
    current = None
    for head, last, s in sorted(lines, key=lambda t: (t[0], t[1])):
        if head != current:
            out.append(f"\n[{head}]" if head else "")
            current = head
        out.append(f'"{last}" = {s}' if "." in last else f"{last} = {s}")
    return "\n".join(out).strip() + "\n"


# ---------------------------------------------------------------------------------------------
# Node config
# ---------------------------------------------------------------------------------------------
def parse_node_config(node_config: Mapping[str, Any], sim: SimConfig) -> NodeConfig:
    """Resolve this node's own facts.

    Deployment: the SuperNode's ``--node-config`` gives ``data-path`` (required), ``party-name``, ``work-dir``,
    ``model-path``, ``epsilon-max``, ``ledger-key`` (the party's Ed25519 ledger-signing key; default ``<work-
    dir>/keys/<party>-ledger.key``), and the owner's own hardware settings ``device``, ``dtype``, ``gradient-
    checkpointing``, ``micro-batch-size``, ``quantize`` (they override ``train.<key>`` at this party only), and
    ``base-cache`` (where a checkpoint's loaded base is kept memory-mappable for the next messages; default
    ``<work-dir>/base-cache``, ``"off"`` to disable). Simulation: Flower only injects ``partition-id``;
    ``distmoe simulate`` wrote one node file per virtual SuperNode (``<sim.nodes-dir>/node-<id>.toml``) with the
    same keys, so each virtual node sees exactly one party directory.
    """
    nc = dict(node_config)
    if "data-path" not in nc:
        if "partition-id" in nc and sim.nodes_dir:
            node_file = Path(sim.nodes_dir) / f"node-{int(nc['partition-id'])}.toml"
            try:
                with node_file.open("rb") as fh:
                    nc = {**tomllib.load(fh), **{k: v for k, v in nc.items() if k != "data-path"}}
            except FileNotFoundError:
                raise ConfigError(f"node config: simulation node file {node_file} not found") from None
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"node config: {node_file} is not valid TOML: {exc}") from None
        else:
            raise ConfigError("node config: 'data-path' is missing: start the SuperNode with "
                              "--node-config 'data-path=\"/path/to/party-dir\"' (or use distmoe simulate)")
    for key in ("data-path", "party-name", "work-dir", "model-path", "ledger-key", "base-cache"):
        if key in nc and not isinstance(nc[key], str):
            raise ConfigError(f"node config key '{key}': value {nc[key]!r} must be a string")
    eps_max = nc.get("epsilon-max")
    if eps_max is not None:
        if isinstance(eps_max, bool) or not isinstance(eps_max, (int, float)) or not 0 < float(eps_max) < math.inf:
            raise ConfigError(f"node config key 'epsilon-max': value {eps_max!r} must be a number > 0")
        eps_max = float(eps_max)
    data_path = Path(nc["data-path"]).expanduser()
    if not data_path.is_dir():
        raise ConfigError(f"node config key 'data-path': {str(data_path)!r} is not a directory "
                          "(expected one directory of <task>.jsonl files for this party)")
    party = nc.get("party-name") or data_path.name
    if not _TASK_RE.match(party):
        raise ConfigError(f"node config key 'party-name': value {party!r} must use letters, digits, '-', '_'")
    work = Path(nc.get("work-dir") or (data_path.parent / f".{party}-work")).expanduser()
    ledger_key = Path(nc["ledger-key"]).expanduser() if nc.get("ledger-key") else None
    if ledger_key is not None and not ledger_key.is_file():
        raise ConfigError(f"node config key 'ledger-key': {str(ledger_key)!r} is not a file (expected this "
                          "party's Ed25519 ledger-signing key, e.g. ledger.key made by 'distmoe credentials')")
    hardware = tuple((attr, nc[k]) for k, attr in HARDWARE_KEYS.items() if k in nc)
    cache = nc.get("base-cache", "")
    base_cache = None if cache == "off" else Path(cache).expanduser() if cache else work / "base-cache"
    node = NodeConfig(party=party, data_path=data_path, work_dir=work, model_path=nc.get("model-path", ""),
                      epsilon_max=eps_max, ledger_key=ledger_key, hardware=hardware, base_cache=base_cache)
    node.train(TrainConfig())  # the owner's hardware keys are validated here, before anything runs
    return node


def replace(cfg: Any, **changes: Any) -> Any:
    """dataclasses.replace, re-exported for tests and callers that derive configs."""
    return dataclasses.replace(cfg, **changes)
