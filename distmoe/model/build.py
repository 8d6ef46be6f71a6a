"""Build the MoE model: the tiny default Qwen3-MoE from config, or any local checkpoint of a
supported MoE family via ``from_pretrained(path)``; and describe it (``ModelSpec``).

Owns: the tiny default architecture, loading on a device and dtype (``device.Runtime``), the family
tables (``FAMILIES``: each supported family's ``RouterRule``, how its router weighs its top-k;
``REFUSED_FAMILIES``: why each other MoE family transformers ships is refused; ``docs/checkpoints.md``
keeps the same tables), the checks of a checkpoint's tokenizer (pad token, chat template), deterministic
initialisation from ``model.seed`` (so the server and every party build bit-identical base weights
without shipping them), the router/experts module discovery, and the spec that the wire schema and
the anchor are versioned against.

Must not: read party data, download anything (``local_files_only``), or decide what is trained
(see ``trainable.py``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from distmoe.config import ModelConfig
from distmoe.model.device import CPU, Runtime


@dataclass(frozen=True)
class RouterRule:
    """How a supported family's router turns its logits ``z`` ``[tokens, E]`` into its top-k: the experts
    are always ``topk(softmax(z))`` (= ``topk(z)``); the weights are ``softmax(z)[I]``, renormalised over
    the ``k`` chosen experts when ``normalise`` (``None``: the config's ``norm_topk_prob``), times
    ``config.<scale>`` when ``scale`` is set. Routing replay and ``prune-k`` re-derive weights this way."""

    normalise: bool | None
    scale: str | None = None
    config_checks: tuple[tuple[str, object], ...] = ()  # (config field, required value)


# family -> its router rule. Every router here is a softmax over the E experts of an MoE layer, so the
# router statistics, the anchor KL, the aux loss and routing replay hold as written (docs/checkpoints.md).
FAMILIES: dict[str, RouterRule] = {
    "qwen3_moe": RouterRule(normalise=None),
    "qwen2_moe": RouterRule(normalise=None),  # plus a sigmoid-gated shared expert (not routed)
    "mixtral": RouterRule(normalise=True),
    "olmoe": RouterRule(normalise=None),
    "flex_olmo": RouterRule(normalise=None),  # OLMoE's router; FlexOlmo's experts can be trained apart
    # softmax over the top-k logits == softmax(z)[I] renormalised; the router has a bias (part of z)
    "gpt_oss": RouterRule(normalise=True),
    # greedy top-k of the softmax, times routed_scaling_factor; dense first layers, shared experts
    "deepseek_v2": RouterRule(normalise=False, scale="routed_scaling_factor",
                              config_checks=(("topk_method", "greedy"),)),
}
SUPPORTED_FAMILIES = tuple(FAMILIES)

_SIGMOID_GROUPED = ("its router scores experts with a sigmoid plus a learned bias correction and "
                    "group-limited top-k, not a softmax over the experts; distmoe's router statistics, "
                    "anchor KL and aux loss assume softmax routing probabilities over E experts")
_SIGMOID = ("its router scores experts with independent sigmoids, not a softmax over the experts; "
            "distmoe's router statistics, anchor KL and aux loss assume softmax routing probabilities")
# MoE families transformers ships that distmoe refuses, and why (docs/checkpoints.md keeps the same table)
REFUSED_FAMILIES: dict[str, str] = {
    "deepseek_v3": _SIGMOID_GROUPED,
    "deepseek_v32": _SIGMOID_GROUPED,
    "glm4_moe": _SIGMOID_GROUPED,
    "glm4_moe_lite": _SIGMOID_GROUPED,
    "dots1": _SIGMOID_GROUPED,
    "longcat_flash": _SIGMOID_GROUPED + "; it also has zero-computation experts",
    "minimax_m2": _SIGMOID + " (with a bias-corrected choice)",
    "lfm2_moe": _SIGMOID + " (with an expert-bias-corrected choice)",
    "llama4": _SIGMOID + " over the top-k logits; it is also a multimodal checkpoint",
    "ernie4_5_moe": ("it chooses experts by softmax plus a learned correction bias (moe_statics), so the "
                     "chosen experts are not the top-k of the routing distribution distmoe's statistics, "
                     "anchor and routing replay use"),
    "phimoe": ("its router uses SparseMixer (a sampled, masked two-stage top-2), so the chosen experts "
               "and weights are not the top-k of one softmax over the experts"),
    "dbrx": ("its router module (DbrxRouter) returns only logits and the top-k is taken inside the FFN, so "
             "distmoe cannot capture or replay the routing decisions at the router"),
    "jetmoe": ("its mixture-of-attention-heads layers route attention too, and its gate (JetMoeTopKGating) "
               "does not return (logits, weights, indices), so distmoe cannot capture or replay routing"),
    "hunyuan_v1_moe": ("its gate (HunYuanMoEV1Gate) is not a top-k router module distmoe discovers, and its "
                       "config allows a different expert count and top-k per layer; distmoe's anchor and wire "
                       "schema assume one E and one k for every MoE layer"),
    "jamba": ("a hybrid Mamba/attention model (its router is a softmax top-k); without the CUDA kernels "
              "its Mamba layers run a slow torch path, and distmoe's RL rollouts over its hybrid cache are "
              "untested, so it is refused until they are"),
    "qwen3_next": ("a hybrid linear-attention (Gated DeltaNet) model (its router is a softmax top-k); "
                   "without its CUDA kernels the linear attention runs a slow torch path, and distmoe's RL "
                   "rollouts over its hybrid cache are untested, so it is refused until they are"),
    "minimax": ("a hybrid lightning-attention (linear attention) model (its router is a softmax top-k); "
                "distmoe's RL rollouts over its hybrid cache are untested, so it is refused until they are"),
    "granitemoe": ("its fused experts (block_sparse_moe.input_linear / output_linear) are not where distmoe's "
                   "LoRA expert targets and parameter groups look (mlp.experts.*); untested, so refused"),
    "nllb_moe": "an encoder-decoder translation model, not a causal LM",
    "switch_transformers": "an encoder-decoder (T5) model, not a causal LM",
}


class ModelError(ValueError):
    """A checkpoint cannot be used (missing, unsupported family, incompatible architecture)."""


@dataclass(frozen=True)
class ModelSpec:
    """What the rest of the system needs to know about the model's routing."""

    family: str
    moe_layers: tuple[int, ...]  # decoder layer indices that hold a router
    num_experts: int
    top_k: int
    hidden_size: int
    vocab_size: int

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def router_spec(self) -> dict:
        return {"family": self.family, "moe_layers": list(self.moe_layers),
                "num_experts": self.num_experts, "top_k": self.top_k}


def tiny_config(cfg: ModelConfig, vocab_size: int):
    """The default tiny Qwen3-MoE config (about 7M parameters at the defaults)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.moe_intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
        num_experts=cfg.experts, num_experts_per_tok=cfg.top_k, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=max(256, cfg.max_seq_len),
        router_aux_loss_coef=0.0,  # distmoe computes the aux loss itself, with its own coefficient
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=None, eos_token_id=None,
        attention_dropout=0.0, use_cache=True,
    )


def router_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The router module of every MoE layer, in layer order: [(qualified name, module)].

    A router is a module whose class name ends with ``TopKRouter`` (``TopkRouter`` in the DeepSeek-V2
    code) and that returns ``(logits, weights, indices)``."""
    found = [(n, m) for n, m in model.named_modules() if type(m).__name__.lower().endswith("topkrouter")]
    return found


def router_rule(model: nn.Module) -> RouterRule:
    """The supported family's ``RouterRule`` (``ModelError`` for any other family)."""
    family = model.config.model_type
    if family not in FAMILIES:
        raise ModelError(refusal(family))
    return FAMILIES[family]


def topk_weighting(model: nn.Module) -> tuple[bool, float]:
    """(renormalise over the k chosen experts, scale) of the model's router weights ``softmax(z)[I]``."""
    rule = router_rule(model)
    cfg = model.config
    norm = bool(getattr(cfg, "norm_topk_prob", False)) if rule.normalise is None else rule.normalise
    scale = float(getattr(cfg, rule.scale)) if rule.scale else 1.0
    return norm, scale


def refusal(family: str) -> str:
    """Why ``family`` cannot be used, naming it."""
    if family in REFUSED_FAMILIES:
        return f"the {family!r} family is not supported: {REFUSED_FAMILIES[family]}"
    return (f"architecture {family!r} is not a supported MoE family (supported: "
            f"{', '.join(SUPPORTED_FAMILIES)}; see docs/checkpoints.md)")


def check_family(cfg) -> None:
    """``ModelError`` unless the HF config ``cfg`` is a supported family in a supported configuration."""
    family = cfg.model_type
    if family not in FAMILIES:
        raise ModelError(refusal(family))
    for field, want in FAMILIES[family].config_checks:
        got = getattr(cfg, field, None)
        if got != want:
            raise ModelError(f"the {family!r} family is supported only with {field} = {want!r} (this "
                             f"checkpoint has {got!r}): other choices are not the top-k of the softmax "
                             "that distmoe's statistics, anchor and routing replay assume")


def _layer_index(name: str) -> int:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])


def describe(model: nn.Module) -> ModelSpec:
    cfg = model.config
    if cfg.model_type not in FAMILIES:
        raise ModelError(refusal(cfg.model_type))
    routers = router_modules(model)
    if not routers:
        raise ModelError(f"model of type {cfg.model_type!r} has no top-k router modules; "
                         f"supported MoE families: {', '.join(SUPPORTED_FAMILIES)}")
    return ModelSpec(
        family=cfg.model_type,
        moe_layers=tuple(_layer_index(n) for n, _ in routers),
        num_experts=num_experts(model),
        top_k=int(cfg.num_experts_per_tok), hidden_size=int(cfg.hidden_size),
        vocab_size=int(cfg.vocab_size))


def num_experts(model: nn.Module) -> int:
    """Routed experts per MoE layer (the width of every router's logits)."""
    routers = router_modules(model)
    if routers and isinstance(getattr(routers[0][1], "num_experts", None), int):
        return int(routers[0][1].num_experts)
    cfg = model.config
    return int(getattr(cfg, "num_experts", None) or cfg.num_local_experts)


def _seeded_init(model: nn.Module, seed: int) -> None:
    """Re-initialise every parameter from ``seed`` in name order: identical on every node."""
    gen = torch.Generator().manual_seed(seed)
    std = float(getattr(model.config, "initializer_range", 0.02))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms
                p.fill_(1.0) if "norm" in name else p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def build_model(cfg: ModelConfig, model_path: str = "", rt: Runtime = CPU) -> tuple[nn.Module, object]:
    """Return ``(model, tokenizer)`` in eval mode, on ``rt.device`` with its base in ``rt.dtype``.

    ``model_path`` (from the node config) overrides ``cfg.path``; both empty means the tiny
    default with the character tokenizer. The tiny default is always initialised in float32 on
    the CPU (bit-identical on every node, whatever its hardware) and then cast and moved.
    """
    path = model_path or cfg.path
    if not path:
        from transformers import Qwen3MoeForCausalLM

        from distmoe.model.tokenizer import DEFAULT_VOCAB_SIZE, build_default_tokenizer

        tok = build_default_tokenizer()
        model = Qwen3MoeForCausalLM(tiny_config(cfg, DEFAULT_VOCAB_SIZE))
        _seeded_init(model, cfg.seed)
        if rt.dtype != torch.float32 or rt.device.type != "cpu":
            model = model.to(device=rt.device, dtype=rt.dtype)
    else:
        model, tok = load_checkpoint(Path(path), rt)
    if cfg.balance_bias:  # routing.balance with a bias: part of the model, zero at the start (model/balance.py)
        from distmoe.model.balance import install_bias

        install_bias(model)
    model.eval()
    return model, tok


def _load_kwargs(rt: Runtime) -> dict:
    """``from_pretrained`` arguments that load the weights once, memory-mapped, in the target dtype and
    directly on the device (no float32 copy on the CPU first)."""
    kw: dict = {"local_files_only": True, "dtype": rt.dtype, "low_cpu_mem_usage": True}
    if rt.device.type == "cuda":
        kw["device_map"] = {"": rt.device.index or 0}
    if rt.quantize != "none":
        from transformers import BitsAndBytesConfig

        kw["quantization_config"] = (
            BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=rt.dtype if rt.mixed else torch.bfloat16)
            if rt.quantize == "4bit" else BitsAndBytesConfig(load_in_8bit=True))
    return kw


def read_hf_config(path: Path):
    """The checkpoint's ``config.json`` (no weights read), checked: a directory, a supported MoE family."""
    from transformers import AutoConfig

    if not path.is_dir():
        raise ModelError(f"model.path {str(path)!r}: not a directory (expected a local Hugging Face "
                         "checkpoint with config.json, weights and a tokenizer)")
    if not (path / "config.json").exists():
        raise ModelError(f"model.path {str(path)!r}: no config.json found")
    try:
        hf_cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises several types here
        raise ModelError(f"model.path {str(path)!r}: cannot read config.json: {exc}") from None
    try:
        check_family(hf_cfg)
    except ModelError as exc:
        raise ModelError(f"model.path {str(path)!r}: {exc}") from None
    return hf_cfg


def load_checkpoint(path: Path, rt: Runtime = CPU) -> tuple[nn.Module, object]:
    from transformers import AutoModelForCausalLM

    read_hf_config(path)
    model = AutoModelForCausalLM.from_pretrained(path, **_load_kwargs(rt))
    if rt.device.type != "cuda" and str(next(model.parameters()).device) != str(rt.device):
        model = model.to(rt.device)
    return model, finish_loaded(model, path)


def finish_loaded(model: nn.Module, path: Path):
    """What every checkpoint load ends with: the checked tokenizer, and the model's own aux loss off."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    prepare_tokenizer(tok, str(path))
    if getattr(model.config, "router_aux_loss_coef", None):
        model.router_aux_loss_coef = 0.0  # the aux loss is computed by distmoe with its own coefficient
    return tok


def prepare_tokenizer(tok, where: str) -> None:
    """Check and complete a checkpoint's tokenizer (docs/checkpoints.md, "Tokenizer requirements").

    No pad token: the eos token pads (padding is masked out of attention and labels, so it is never
    learned); neither: ``ModelError``. No chat template: ``ModelError`` naming the checkpoint and the
    file to add (distmoe encodes every example with the checkpoint's own template, and inventing a
    format for a model would train it on turns it never sees in use). A template that rejects the
    system role is handled when encoding (``distmoe.data.template``: the system text is folded into
    the first user turn)."""
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ModelError(f"model.path {where!r}: the tokenizer has neither a pad token nor an eos token; "
                             "add \"pad_token\" (or \"eos_token\") to its tokenizer_config.json")
        tok.pad_token = tok.eos_token
    if not getattr(tok, "chat_template", None):
        raise ModelError(f"model.path {where!r}: the tokenizer has no chat template; distmoe encodes "
                         "instruction data with the checkpoint's own chat template. Add one as "
                         f"{where}/chat_template.jinja (a Jinja template over messages with roles system, "
                         "user and assistant and add_generation_prompt; docs/checkpoints.md has a ChatML "
                         "example)")


def hash_tensors(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over names, shapes and float32 bytes, in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to(torch.float32).contiguous()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
