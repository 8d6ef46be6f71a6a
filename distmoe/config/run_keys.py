"""The keys of the run, its model, its data and local training: sections ``run``, ``model``, ``data``, ``train``.

Owns: these sections' declarations (default, range, doc, the resume and privacy fence of each key), their checks
within a section, and the node-config hardware keys that override ``train.*`` at one party.

Must not: import anything of distmoe outside this package, or check across sections (:mod:`distmoe.config.parse`).
"""

from __future__ import annotations

import re

from distmoe.config.keys import ConfigError, Section, check_range, key, section

TRAINABLE_MODES = ("all", "router+experts", "lora")  # what the rest of the code sees (`auto` is resolved)
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZE_MODES = ("none", "4bit", "8bit")
EXPERT_SCHEDULES = ("constant", "cosine")
_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:[0-9]+)?)$")
# node-config keys a data owner may set for its own hardware: node key -> train.<attr>
HARDWARE_KEYS = {"device": "device", "dtype": "dtype", "gradient-checkpointing": "gradient_checkpointing",
                 "micro-batch-size": "micro_batch_size", "quantize": "quantize"}


@section("run")
class RunSection(Section):
    seed: int = key(0, "seeds the tiny model's initialisation, data splits, synthetic data and local training",
                    lo=0)
    dir: str = key("", "where the ServerApp writes the run; `\"\"` = `./runs/<flower run id>` (simulate sets it)",
                   allowed="path", resume=True)
    name: str = key("", "free label stored in the run record", resume=True)
    resume: str = key("", "continue the run in this directory from its last good checkpoint (`docs/operations.md`, "
                      "Resume); `\"\"` = a new run; checked by the coordinator, which holds the directory",
                      allowed="path", resume=True)
    init_from: str = key("", "start a new run from this checkpoint directory (`RUN/checkpoints/round-<n>`, e.g. one "
                         "that `distmoe rollback` names, or a warm-up base): its weights and its anchor; `\"\"` = "
                         "from `model.*` (`docs/operations.md`, Rollback)", allowed="path")

    def check(self) -> None:
        if self.resume != self.resume.strip() or "\n" in self.resume:
            raise ConfigError(f"config key 'run.resume': value {self.resume!r} must be a run directory path "
                              "(no surrounding whitespace) or \"\" for a new run")


@section("model")
class ModelConfig(Section):
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
    max_seq_len: int = key(96, "tokens per example (prompt cut from the left; an example whose answer does not "
                           "fit is left out)", lo=16, hi=8192)
    lora_r: int = key(8, "`lora` mode: adapter rank", lo=1)
    lora_alpha: int = key(16, "`lora` mode: adapter scale", lo=1)
    lora_router: bool = key(True, "`lora` mode: adapt the router weight too")
    lora_experts: bool = key(True, "`lora` mode: adapt the fused expert weights (peft `target_parameters`); peft "
                             "materialises each adapted expert tensor in full on every forward, so at tens of billions "
                             "of parameters turn this off (attention and router adapters only; `docs/checkpoints.md`)")
    quantize_experts: str = key("none", "`lora` mode: store the frozen fused expert weights in 4 bits (`nf4`: "
                                "bitsandbytes' NF4 blocks, dequantised for the routed experts only inside the routed "
                                "expert LoRA; CPU and CUDA; needs `model.lora-experts` and the `quant-experts` extra; "
                                "`docs/checkpoints.md`, 4-bit experts)", choices=("none", "nf4"))
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
        check_range("model.top-k", self.top_k, 1, self.experts)
        if self.warmup_steps and (self.path or self.trainable == "lora"):
            raise ConfigError(f"config key 'model.warmup-steps': value {self.warmup_steps} warms up the tiny default "
                              "model (model.path = \"\", model.trainable all or router+experts); a checkpoint is "
                              "already a base")
        if self.quantize_experts != "none" and (self.trainable != "lora" or not self.lora_experts):
            raise ConfigError(f"config key 'model.quantize-experts': value {self.quantize_experts!r} needs "
                              "model.trainable = \"lora\" and model.lora-experts = true (the routed expert LoRA "
                              "dequantises the routed experts; nothing else reads 4-bit experts)")
        if self.heads % self.kv_heads:
            raise ConfigError(f"config key 'model.kv-heads': value {self.kv_heads} must divide "
                              f"model.heads = {self.heads}")


@section("data")
class DataConfig(Section):
    eval_fraction: float = key(0.2, "held-out share of each task, split by a stable hash of each example",
                               lo=0.0, hi=0.9, lo_open=True)
    max_train_examples: int = key(0, "cap per task (0 = none)", lo=0)
    max_eval_examples: int = key(48, "held-out examples evaluated per task", lo=1)
    synth_examples: int = key(240, "examples per task per party written by `distmoe simulate` without `--data`",
                              lo=10)
    canary_file: str = key("", "optional canary list (one string per line) the audit searches for in every "
                           "server-side file; `\"\"` = each party's `<data-path>/canaries.txt`", allowed="path",
                           privacy=True)
    seed: int = 0  # not a key: = run.seed


@section("train")
class TrainConfig(Section):
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
    threads: int = key(1, "torch threads per party process", lo=1, hi=256, resume=True)
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

