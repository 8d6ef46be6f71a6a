"""The one configuration parser: Flower run config + node config -> frozen, validated dataclasses.

Owns: the default values of every run-config key (``DEFAULTS``, mirrored verbatim in
``pyproject.toml`` ``[tool.flwr.app.config]``; a unit test keeps the two equal), the validation of
every key (an error names the key, the value and what is allowed), the schedule grammar, and the
node-local facts (data path, party name, work directory).

Must not: import ``flwr``, touch models or data, or be bypassed. Library code receives the narrowest
section (``cfg.train``, ``cfg.routing``), never the raw mapping.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Scalar = int | float | str | bool


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, out of range or inconsistent."""


# ---------------------------------------------------------------------------------------------
# Defaults. Flat, Flower-style keys (kebab-case, dotted sections). pyproject.toml mirrors these.
# ---------------------------------------------------------------------------------------------
DEFAULTS: dict[str, Scalar] = {
    # run
    "run.seed": 0,
    "run.dir": "",  # where the ServerApp writes the run; "" = ./runs/<flower-run-id>
    "run.name": "",
    "run.resume": "",  # a run directory to resume (docs/operations.md "Resume"); "" = a new run
    # model
    "model.path": "",  # local HF checkpoint directory; "" = the tiny default Qwen3-MoE
    "model.trainable": "all",  # all | router+experts | lora
    "model.hidden-size": 256,
    "model.layers": 4,
    "model.experts": 8,
    "model.top-k": 2,
    "model.moe-intermediate-size": 256,
    "model.heads": 4,
    "model.kv-heads": 2,
    "model.head-dim": 64,
    "model.max-seq-len": 96,
    "model.lora-r": 8,
    "model.lora-alpha": 16,
    "model.lora-router": True,
    # party data
    "data.eval-fraction": 0.2,
    "data.max-train-examples": 0,  # 0 = no cap
    "data.max-eval-examples": 48,
    "data.synth-examples": 240,  # per task family per party, for `distmoe data synth` defaults
    "data.canaries": "",  # file of canary strings planted in party data, for the audit ("" = none known)
    # local SFT
    "train.local-steps": 40,
    "train.batch-size": 16,
    "train.lr": 1e-3,
    "train.lr-experts": 1e-3,
    "train.lr-router": 1e-3,
    "train.weight-decay": 0.0,
    "train.warmup-steps": 5,
    "train.grad-clip": 1.0,
    "train.threads": 1,
    # routing: aux load-balance loss and the router anchor
    "routing.aux-loss-coef": 0.01,
    "routing.anchor-kl-coef": 0.5,
    "routing.anchor-granularity": "batch",  # batch | token
    # local RL (GRPO with IcePop correction of the train/inference mismatch)
    "rl.steps": 6,
    "rl.prompts-per-step": 8,
    "rl.group-size": 4,
    "rl.max-new-tokens": 8,
    "rl.temperature": 1.0,
    "rl.lr": 1e-4,
    "rl.ppo-epochs": 1,
    "rl.minibatches": 2,
    "rl.clip-eps": 0.2,
    "rl.kl-coef": 0.0,
    "rl.policy-loss": "grpo",  # grpo | reinforce
    "rl.correction": "icepop",  # icepop (mask) | tis (truncate) | none
    "rl.correction-level": "token",  # token | sequence
    "rl.icepop-low": 0.5,
    "rl.icepop-high": 5.0,
    "rl.engine": "bf16",  # exact | bf16 | int8-dynamic | int8-weight-only | prune-<k>, combined with '+'
    "rl.reward": "task",  # task | exact_match | numeric | format
    "rl.simulator": False,  # the ICEPOP seed's inference simulator instead of the recompute (approximation)
    "rl.simulator-recalibrate-every": 5,
    "rl.simulator-bound": 0.5,
    "rl.simulator-lb-coef": 0.01,  # load-balance loss on the simulated routing (trusted simulator steps only)
    "rl.routing-replay": False,  # the trainer replays the engine's recorded top-k experts (R3)
    # schedule
    "schedule.phases": "sft:lookup, eval, stats:lookup, sft:arith, eval",
    "schedule.sft-rounds": 5,
    # federation
    "federation.min-parties": 2,
    "federation.wait-timeout": 180.0,
    "federation.round-timeout": 900.0,  # the training stage of a round: instruction out, (masked) reply in
    "federation.setup-timeout": 300.0,  # secure-aggregation setup exchanges (a ClientApp's first start is slow)
    "federation.unmask-timeout": 120.0,  # the unmask exchange of a secure round (no training in it)
    "federation.on-round-failure": "skip",  # a round that releases nothing: "skip" it and go on, or "stop" the run
    "federation.max-norm-ratio": 10.0,  # plaintext mode: reject updates with norm > ratio x the round median (0 = off)
    "federation.anomaly-z": 4.0,  # flag aggregate losses beyond this rolling z-score (0 = off)
    # privacy plane (docs/privacy.md): secure aggregation of every reply, distributed DP on router statistics
    "privacy.mode": "secagg",  # secagg | plaintext (benchmark baseline only: warns, and the audit fails it)
    "privacy.epsilon": 8.0,  # per-party budget for the whole run (unit: one sequence, add/remove)
    "privacy.delta": 1e-6,
    "privacy.noise-multiplier": 0.0,  # router statistics z; 0 = derived from privacy.epsilon over the schedule
    "privacy.scale": 64.0,  # integer encoding scale s of router statistics (>= 32)
    "privacy.canaries": 2048,  # K known-zero noise-canary coordinates per router-statistics release
    "privacy.min-parties": 2,  # fewest parties any release may be aggregated over (also the SecAgg threshold floor)
    "privacy.secagg-graph": "complete",  # complete (Bonawitz et al.) | harary (SecAgg+ sparse graph, Bell et al. 2020)
    "privacy.num-sequences-max": 10000,  # public bound on a party's sequences (bit width, delta <= 1/N)
    "privacy.update-clip": 10.0,  # L2 bound on a model update (clipped; fixes the fixed-point range)
    "privacy.max-weight": 1024,  # an update's aggregation weight is min(examples, max-weight), summed masked
    "privacy.update-noise-multiplier": 0.0,  # > 0: client-level DP on model updates (distributed Skellam)
    "privacy.dp-sgd": False,  # example-level DP-SGD with opacus (refused with a reason where unsupported)
    "privacy.dp-sgd-noise-multiplier": 1.0,
    # checkpoints
    "checkpoint.keep": 2,
    # evaluation
    "eval.max-new-tokens": 10,
    "eval.batch-size": 32,
    # simulation-only: where `distmoe simulate` put each virtual SuperNode's node config
    "sim.nodes-dir": "",
}

TRAINABLE_MODES = ("all", "router+experts", "lora")
GRANULARITIES = ("batch", "token")
PHASE_KINDS = ("sft", "stats", "eval", "rl")
POLICY_LOSSES = ("grpo", "reinforce")  # distmoe/rl/losses.py registry (a test keeps them equal)
REWARDS = ("exact_match", "numeric", "format", "task")  # distmoe/rl/rewards.py registry
CORRECTIONS = {"icepop": "mask", "tis": "truncate", "none": "none"}
ENGINE_PARTS = ("exact", "bf16", "int8-dynamic", "int8-weight-only")
_TASK_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunSection:
    seed: int
    dir: str
    name: str
    resume: str  # "" or the run directory to continue (checked by the coordinator, which holds it)


@dataclass(frozen=True)
class ModelConfig:
    path: str
    trainable: str
    hidden_size: int
    layers: int
    experts: int
    top_k: int
    moe_intermediate_size: int
    heads: int
    kv_heads: int
    head_dim: int
    max_seq_len: int
    lora_r: int
    lora_alpha: int
    lora_router: bool
    seed: int  # = run.seed: the tiny default model is initialised identically everywhere


@dataclass(frozen=True)
class DataConfig:
    eval_fraction: float
    max_train_examples: int
    max_eval_examples: int
    synth_examples: int
    seed: int


@dataclass(frozen=True)
class TrainConfig:
    local_steps: int
    batch_size: int
    lr: float
    lr_experts: float
    lr_router: float
    weight_decay: float
    warmup_steps: int
    grad_clip: float
    threads: int


@dataclass(frozen=True)
class RoutingConfig:
    aux_loss_coef: float
    anchor_kl_coef: float
    anchor_granularity: str


@dataclass(frozen=True)
class RLConfig:
    steps: int
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    temperature: float
    lr: float
    ppo_epochs: int
    minibatches: int
    clip_eps: float
    kl_coef: float
    policy_loss: str
    correction: str  # icepop | tis | none
    correction_level: str
    icepop_low: float
    icepop_high: float
    engine: str
    reward: str
    simulator: bool
    simulator_recalibrate_every: int
    simulator_bound: float
    simulator_lb_coef: float
    routing_replay: bool

    @property
    def mode(self) -> str:
        """The mismatch-weight mode of ``distmoe.rl.losses.mismatch_weights``."""
        return CORRECTIONS[self.correction]


@dataclass(frozen=True)
class Phase:
    kind: str  # sft | stats | eval
    task: str | None
    rounds: int

    def label(self) -> str:
        return self.kind + (f":{self.task}" if self.task else "")


@dataclass(frozen=True)
class ScheduleConfig:
    phases: tuple[Phase, ...]

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


@dataclass(frozen=True)
class FederationConfig:
    min_parties: int
    wait_timeout: float
    round_timeout: float
    setup_timeout: float = 300.0
    unmask_timeout: float = 120.0
    on_round_failure: str = "skip"
    max_norm_ratio: float = 10.0
    anomaly_z: float = 4.0


PRIVACY_MODES = ("secagg", "plaintext")
SECAGG_GRAPHS = ("complete", "harary")  # == distmoe.privacy.secagg.GRAPHS (a test keeps them equal)
ROUND_FAILURE_POLICIES = ("skip", "stop")


@dataclass(frozen=True)
class PrivacyConfig:
    mode: str
    epsilon: float
    delta: float
    noise_multiplier: float  # as configured (0 = derive); see ``resolved_noise_multiplier``
    scale: float
    canaries: int
    min_parties: int
    num_sequences_max: int
    update_clip: float
    max_weight: int
    update_noise_multiplier: float
    dp_sgd: bool
    dp_sgd_noise_multiplier: float
    secagg_graph: str = "complete"  # the SecAgg peer graph (distmoe.privacy.secagg.graph.peer_graph)

    @property
    def secure(self) -> bool:
        return self.mode == "secagg"


@dataclass(frozen=True)
class CheckpointConfig:
    keep: int


@dataclass(frozen=True)
class EvalConfig:
    max_new_tokens: int
    batch_size: int


@dataclass(frozen=True)
class SimConfig:
    nodes_dir: str


@dataclass(frozen=True)
class RunConfig:
    run: RunSection
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    routing: RoutingConfig
    rl: RLConfig
    schedule: ScheduleConfig
    federation: FederationConfig
    privacy: PrivacyConfig
    checkpoint: CheckpointConfig
    eval: EvalConfig
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


# ---------------------------------------------------------------------------------------------
# Validation helpers
# ---------------------------------------------------------------------------------------------
def _typed(flat: Mapping[str, Any], key: str, kind: type) -> Any:
    value = flat[key]
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{key}': value {value!r} must be a number")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"config key '{key}': value {value!r} must be finite")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"config key '{key}': value {value!r} must be an integer")
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{key}': value {value!r} must be true or false")
        return value
    if not isinstance(value, str):
        raise ConfigError(f"config key '{key}': value {value!r} must be a string")
    return value


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

    Grammar: phases separated by ``,`` or ``->``; each is ``kind[:task][*rounds]``. ``sft`` needs
    a task; ``stats`` takes an optional task (default: every local task); ``eval`` takes none.
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
        if kind in ("sft", "rl") and task is None:
            raise ConfigError(f"config key '{key}': phase {item!r} needs a task (e.g. '{kind}:arith')")
        if kind == "eval" and task is not None:
            raise ConfigError(f"config key '{key}': phase {item!r}: eval takes no task "
                              "(it evaluates every task seen so far)")
        n = int(rounds) if rounds is not None else (default_rounds if kind in ("sft", "rl") else 1)
        if n < 1:
            raise ConfigError(f"config key '{key}': phase {item!r} must have at least 1 round")
        if kind not in ("sft", "rl") and n != 1:
            raise ConfigError(f"config key '{key}': phase {item!r}: only sft and rl phases take '*rounds'")
        phases.append(Phase(kind=kind, task=task, rounds=n))
    return tuple(phases)


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------
def resolve(overrides: Mapping[str, Any] | None = None) -> dict[str, Scalar]:
    """DEFAULTS updated with ``overrides``; an unknown key is an error naming the closest keys."""
    flat: dict[str, Scalar] = dict(DEFAULTS)
    for key, value in (overrides or {}).items():
        if key not in DEFAULTS:
            section = key.split(".")[0]
            near = [k for k in DEFAULTS if k.startswith(section + ".")]
            hint = f"; keys in '{section}': {', '.join(near)}" if near else \
                f"; sections: {', '.join(sorted({k.split('.')[0] for k in DEFAULTS}))}"
            raise ConfigError(f"unknown config key '{key}' (value {value!r}){hint}")
        flat[key] = value
    return flat


def parse_run_config(run_config: Mapping[str, Any] | None = None) -> RunConfig:
    """Validate a (possibly partial) flat run config and return the frozen tree."""
    flat = resolve(run_config)
    g = lambda k, t: _typed(flat, k, t)  # noqa: E731

    seed = g("run.seed", int)
    _range("run.seed", seed, 0)
    resume = g("run.resume", str)
    if resume != resume.strip() or "\n" in resume:
        raise ConfigError(f"config key 'run.resume': value {resume!r} must be a run directory path "
                          "(no surrounding whitespace) or \"\" for a new run")
    # only the type here: parties parse this config too, and the directory exists at the coordinator only
    run = RunSection(seed=seed, dir=g("run.dir", str), name=g("run.name", str), resume=resume)

    trainable = g("model.trainable", str)
    _choice("model.trainable", trainable, TRAINABLE_MODES)
    ints = {k: g(k, int) for k in (
        "model.hidden-size", "model.layers", "model.experts", "model.top-k",
        "model.moe-intermediate-size", "model.heads", "model.kv-heads", "model.head-dim",
        "model.max-seq-len", "model.lora-r", "model.lora-alpha")}
    for k, v in ints.items():
        _range(k, v, 1)
    _range("model.experts", ints["model.experts"], 2, 256)
    _range("model.top-k", ints["model.top-k"], 1, ints["model.experts"])
    _range("model.max-seq-len", ints["model.max-seq-len"], 16, 8192)
    if ints["model.heads"] % ints["model.kv-heads"]:
        raise ConfigError(f"config key 'model.kv-heads': value {ints['model.kv-heads']} must divide "
                          f"model.heads = {ints['model.heads']}")
    model = ModelConfig(
        path=g("model.path", str), trainable=trainable,
        hidden_size=ints["model.hidden-size"], layers=ints["model.layers"],
        experts=ints["model.experts"], top_k=ints["model.top-k"],
        moe_intermediate_size=ints["model.moe-intermediate-size"], heads=ints["model.heads"],
        kv_heads=ints["model.kv-heads"], head_dim=ints["model.head-dim"],
        max_seq_len=ints["model.max-seq-len"], lora_r=ints["model.lora-r"],
        lora_alpha=ints["model.lora-alpha"], lora_router=g("model.lora-router", bool), seed=seed)

    ef = g("data.eval-fraction", float)
    _range("data.eval-fraction", ef, 0.0, 0.9, lo_open=True)
    data = DataConfig(eval_fraction=ef, max_train_examples=g("data.max-train-examples", int),
                      max_eval_examples=g("data.max-eval-examples", int),
                      synth_examples=g("data.synth-examples", int), seed=seed)
    _range("data.max-train-examples", data.max_train_examples, 0)
    _range("data.max-eval-examples", data.max_eval_examples, 1)
    _range("data.synth-examples", data.synth_examples, 10)

    train = TrainConfig(
        local_steps=g("train.local-steps", int), batch_size=g("train.batch-size", int),
        lr=g("train.lr", float), lr_experts=g("train.lr-experts", float),
        lr_router=g("train.lr-router", float), weight_decay=g("train.weight-decay", float),
        warmup_steps=g("train.warmup-steps", int), grad_clip=g("train.grad-clip", float),
        threads=g("train.threads", int))
    _range("train.local-steps", train.local_steps, 1)
    _range("train.batch-size", train.batch_size, 1, 4096)
    for k in ("train.lr", "train.lr-experts", "train.lr-router"):
        _range(k, g(k, float), 0.0, 1.0)
    _range("train.weight-decay", train.weight_decay, 0.0, 1.0)
    _range("train.warmup-steps", train.warmup_steps, 0)
    _range("train.grad-clip", train.grad_clip, 0.0, lo_open=True)
    _range("train.threads", train.threads, 1, 256)

    gran = g("routing.anchor-granularity", str)
    _choice("routing.anchor-granularity", gran, GRANULARITIES)
    routing = RoutingConfig(aux_loss_coef=g("routing.aux-loss-coef", float),
                            anchor_kl_coef=g("routing.anchor-kl-coef", float),
                            anchor_granularity=gran)
    _range("routing.aux-loss-coef", routing.aux_loss_coef, 0.0, 100.0)
    _range("routing.anchor-kl-coef", routing.anchor_kl_coef, 0.0, 1000.0)

    rl = _parse_rl(g)

    sft_rounds = g("schedule.sft-rounds", int)
    _range("schedule.sft-rounds", sft_rounds, 1, 100000)
    schedule = ScheduleConfig(phases=parse_schedule(g("schedule.phases", str), sft_rounds))

    fed = FederationConfig(min_parties=g("federation.min-parties", int),
                           wait_timeout=g("federation.wait-timeout", float),
                           round_timeout=g("federation.round-timeout", float),
                           setup_timeout=g("federation.setup-timeout", float),
                           unmask_timeout=g("federation.unmask-timeout", float),
                           on_round_failure=g("federation.on-round-failure", str),
                           max_norm_ratio=g("federation.max-norm-ratio", float),
                           anomaly_z=g("federation.anomaly-z", float))
    _range("federation.min-parties", fed.min_parties, 1)
    _range("federation.wait-timeout", fed.wait_timeout, 1.0)
    for key, v in (("federation.round-timeout", fed.round_timeout), ("federation.setup-timeout", fed.setup_timeout),
                   ("federation.unmask-timeout", fed.unmask_timeout)):
        _range(key, v, 1.0, 86400.0)
    _choice("federation.on-round-failure", fed.on_round_failure, ROUND_FAILURE_POLICIES)
    if fed.max_norm_ratio != 0.0:
        _range("federation.max-norm-ratio", fed.max_norm_ratio, 1.0, 1e6, lo_open=True)
    _range("federation.anomaly-z", fed.anomaly_z, 0.0, 1000.0)

    privacy = _parse_privacy(g, fed)

    ck = CheckpointConfig(keep=g("checkpoint.keep", int))
    _range("checkpoint.keep", ck.keep, 1)
    ev = EvalConfig(max_new_tokens=g("eval.max-new-tokens", int), batch_size=g("eval.batch-size", int))
    _range("eval.max-new-tokens", ev.max_new_tokens, 1, 1024)
    _range("eval.batch-size", ev.batch_size, 1, 4096)

    return RunConfig(run=run, model=model, data=data, train=train, routing=routing, rl=rl,
                     schedule=schedule, federation=fed, privacy=privacy, checkpoint=ck, eval=ev,
                     sim=SimConfig(nodes_dir=g("sim.nodes-dir", str)),
                     raw=tuple(sorted(flat.items())))


def _parse_privacy(g, fed: FederationConfig) -> PrivacyConfig:
    mode = g("privacy.mode", str)
    _choice("privacy.mode", mode, PRIVACY_MODES)
    p = PrivacyConfig(
        mode=mode, epsilon=g("privacy.epsilon", float), delta=g("privacy.delta", float),
        noise_multiplier=g("privacy.noise-multiplier", float), scale=g("privacy.scale", float),
        canaries=g("privacy.canaries", int), min_parties=g("privacy.min-parties", int),
        num_sequences_max=g("privacy.num-sequences-max", int), update_clip=g("privacy.update-clip", float),
        max_weight=g("privacy.max-weight", int), update_noise_multiplier=g("privacy.update-noise-multiplier", float),
        dp_sgd=g("privacy.dp-sgd", bool), dp_sgd_noise_multiplier=g("privacy.dp-sgd-noise-multiplier", float),
        secagg_graph=g("privacy.secagg-graph", str))
    _choice("privacy.secagg-graph", p.secagg_graph, SECAGG_GRAPHS)
    _range("privacy.epsilon", p.epsilon, 0.0, 1000.0, lo_open=True)
    _range("privacy.delta", p.delta, 0.0, 0.1, lo_open=True)
    _range("privacy.noise-multiplier", p.noise_multiplier, 0.0, 1e6)
    _range("privacy.scale", p.scale, 32.0, 2.0**20)
    if p.scale != int(p.scale):
        raise ConfigError(f"config key 'privacy.scale': value {p.scale:g} must be an integer (router statistics "
                          "are rounded onto the integer simplex of that size)")
    _range("privacy.canaries", p.canaries, 0, 1 << 20)
    _range("privacy.min-parties", p.min_parties, 2, 10000)
    _range("privacy.num-sequences-max", p.num_sequences_max, 1, 10**9)
    _range("privacy.update-clip", p.update_clip, 0.0, 1e6, lo_open=True)
    _range("privacy.max-weight", p.max_weight, 1, 1 << 20)
    _range("privacy.update-noise-multiplier", p.update_noise_multiplier, 0.0, 1e6)
    _range("privacy.dp-sgd-noise-multiplier", p.dp_sgd_noise_multiplier, 0.0, 1e6, lo_open=True)
    if p.delta > 1.0 / p.num_sequences_max:
        raise ConfigError(f"config key 'privacy.delta': value {p.delta:g} must be <= 1/privacy.num-sequences-max "
                          f"= {1.0 / p.num_sequences_max:g} (delta must stay below 1/N for a meaningful guarantee)")
    if p.secure and p.min_parties > fed.min_parties:
        raise ConfigError(f"config key 'privacy.min-parties': value {p.min_parties} is above federation.min-parties "
                          f"= {fed.min_parties}: a run could start with fewer parties than any release may use")
    return p


def _checked_int(g, key: str, lo: int) -> int:
    v = g(key, int)
    _range(key, v, lo)
    return v


def _checked_float(g, key: str, lo: float) -> float:
    v = g(key, float)
    _range(key, v, lo, lo_open=True)
    return v


def _parse_rl(g) -> RLConfig:
    ints = {k: g(k, int) for k in ("rl.steps", "rl.prompts-per-step", "rl.group-size", "rl.max-new-tokens",
                                   "rl.ppo-epochs", "rl.minibatches")}
    for k, v in ints.items():
        _range(k, v, 1, 100000)
    _range("rl.group-size", ints["rl.group-size"], 2, 1024)
    rollouts = ints["rl.prompts-per-step"] * ints["rl.group-size"]
    if ints["rl.minibatches"] > rollouts:
        raise ConfigError(f"config key 'rl.minibatches': value {ints['rl.minibatches']} exceeds "
                          f"rl.prompts-per-step x rl.group-size = {rollouts}")
    fl = {k: g(k, float) for k in ("rl.temperature", "rl.lr", "rl.clip-eps", "rl.kl-coef", "rl.icepop-low",
                                   "rl.icepop-high")}
    _range("rl.temperature", fl["rl.temperature"], 0.0, 100.0, lo_open=True)
    _range("rl.lr", fl["rl.lr"], 0.0, 1.0, lo_open=True)
    _range("rl.clip-eps", fl["rl.clip-eps"], 0.0, 0.99, lo_open=True)
    _range("rl.kl-coef", fl["rl.kl-coef"], 0.0, 100.0)
    _range("rl.icepop-low", fl["rl.icepop-low"], 0.0, 1.0)
    _range("rl.icepop-high", fl["rl.icepop-high"], 1.0, 1e6)
    loss, corr, level = g("rl.policy-loss", str), g("rl.correction", str), g("rl.correction-level", str)
    _choice("rl.policy-loss", loss, POLICY_LOSSES)
    _choice("rl.correction", corr, tuple(CORRECTIONS))
    _choice("rl.correction-level", level, ("token", "sequence"))
    reward = g("rl.reward", str)
    _choice("rl.reward", reward, REWARDS)
    engine = g("rl.engine", str)
    for part in engine.split("+"):
        if part not in ENGINE_PARTS and not re.fullmatch(r"prune-[1-9]\d*", part):
            raise ConfigError(f"config key 'rl.engine': value {engine!r}: {part!r} is not one of "
                              f"{', '.join(ENGINE_PARTS)}, prune-<k> (parts combine with '+', e.g. 'bf16+prune-1')")
    return RLConfig(steps=ints["rl.steps"], prompts_per_step=ints["rl.prompts-per-step"],
                    group_size=ints["rl.group-size"], max_new_tokens=ints["rl.max-new-tokens"],
                    temperature=fl["rl.temperature"], lr=fl["rl.lr"], ppo_epochs=ints["rl.ppo-epochs"],
                    minibatches=ints["rl.minibatches"], clip_eps=fl["rl.clip-eps"], kl_coef=fl["rl.kl-coef"],
                    policy_loss=loss, correction=corr, correction_level=level, icepop_low=fl["rl.icepop-low"],
                    icepop_high=fl["rl.icepop-high"], engine=engine, reward=reward,
                    simulator=g("rl.simulator", bool),
                    simulator_recalibrate_every=_checked_int(g, "rl.simulator-recalibrate-every", 1),
                    simulator_bound=_checked_float(g, "rl.simulator-bound", 0.0),
                    simulator_lb_coef=_rl_lb_coef(g), routing_replay=_rl_replay(g))


def _rl_lb_coef(g) -> float:
    v = g("rl.simulator-lb-coef", float)
    _range("rl.simulator-lb-coef", v, 0.0, 100.0)
    return v


def _rl_replay(g) -> bool:
    replay = g("rl.routing-replay", bool)
    if replay and g("rl.simulator", bool):
        raise ConfigError("config key 'rl.routing-replay': value true cannot be combined with rl.simulator = true "
                          "(two alternative mitigations of the routing gap: replay removes the gap the simulator "
                          "models; choose one)")
    return replay


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

    Deployment: the SuperNode's ``--node-config`` gives ``data-path`` (required), ``party-name``,
    ``work-dir``, ``model-path``, ``epsilon-max``, ``ledger-key`` (the party's Ed25519 ledger-signing key;
    default ``<work-dir>/keys/<party>-ledger.key``). Simulation: Flower only injects ``partition-id``; ``distmoe
    simulate`` wrote one node file per virtual SuperNode (``<sim.nodes-dir>/node-<id>.toml``) with
    the same keys, so each virtual node sees exactly one party directory.
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
    for key in ("data-path", "party-name", "work-dir", "model-path", "ledger-key"):
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
    return NodeConfig(party=party, data_path=data_path, work_dir=work,
                      model_path=nc.get("model-path", ""), epsilon_max=eps_max, ledger_key=ledger_key)


def replace(cfg: Any, **changes: Any) -> Any:
    """dataclasses.replace, re-exported for tests and callers that derive configs."""
    return dataclasses.replace(cfg, **changes)
