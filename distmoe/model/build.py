"""Build the MoE model: the tiny default Qwen3-MoE from config, or any local checkpoint of a
supported MoE family via ``from_pretrained(path)``; and describe it (``ModelSpec``).

Owns: the tiny default architecture, the list of supported families, deterministic
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

SUPPORTED_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


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
    """The router module of every MoE layer, in layer order: [(qualified name, module)]."""
    found = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")]
    return found


def _layer_index(name: str) -> int:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])


def describe(model: nn.Module) -> ModelSpec:
    cfg = model.config
    routers = router_modules(model)
    if not routers:
        raise ModelError(f"model of type {cfg.model_type!r} has no top-k router modules; "
                         f"supported MoE families: {', '.join(SUPPORTED_FAMILIES)}")
    return ModelSpec(
        family=cfg.model_type,
        moe_layers=tuple(_layer_index(n) for n, _ in routers),
        num_experts=int(getattr(cfg, "num_experts", None) or cfg.num_local_experts),
        top_k=int(cfg.num_experts_per_tok), hidden_size=int(cfg.hidden_size),
        vocab_size=int(cfg.vocab_size))


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


def build_model(cfg: ModelConfig, model_path: str = "") -> tuple[nn.Module, object]:
    """Return ``(model, tokenizer)`` in eval mode, float32, on CPU.

    ``model_path`` (from the node config) overrides ``cfg.path``; both empty means the tiny
    default with the character tokenizer.
    """
    path = model_path or cfg.path
    if not path:
        from transformers import Qwen3MoeForCausalLM

        from distmoe.model.tokenizer import DEFAULT_VOCAB_SIZE, build_default_tokenizer

        tok = build_default_tokenizer()
        model = Qwen3MoeForCausalLM(tiny_config(cfg, DEFAULT_VOCAB_SIZE))
        _seeded_init(model, cfg.seed)
    else:
        model, tok = load_checkpoint(Path(path))
    model.eval()
    return model, tok


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
    if hf_cfg.model_type not in SUPPORTED_FAMILIES:
        raise ModelError(f"model.path {str(path)!r}: architecture {hf_cfg.model_type!r} is not a "
                         f"supported MoE family ({', '.join(SUPPORTED_FAMILIES)})")
    return hf_cfg


def load_checkpoint(path: Path) -> tuple[nn.Module, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    read_hf_config(path)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if getattr(model.config, "router_aux_loss_coef", None):
        model.router_aux_loss_coef = 0.0  # the aux loss is computed by distmoe with its own coefficient
    return model, tok


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
