"""Build the MoE model: the tiny default Qwen3-MoE from config, or any local checkpoint of a
supported MoE family via ``from_pretrained(path)``.

Owns: the tiny default architecture, loading on a device and dtype (``device.Runtime``), the checks of a
checkpoint's tokenizer (pad token, chat template), deterministic initialisation from ``model.seed`` (so the
server and every party build bit-identical base weights without shipping them), installing the routing bias
(``balance.py``) when ``routing.balance`` has one, and the tensor hash. The family tables, router discovery and
``ModelSpec`` live in ``families.py`` (re-exported here, where most callers import them).

Must not: read party data, download anything (``local_files_only``), or decide what is trained
(see ``trainable.py``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from torch import nn

from distmoe.config import ModelConfig
from distmoe.model.balance import install_bias
from distmoe.model.device import CPU, Runtime
from distmoe.model.families import (  # noqa: F401  (re-exported: callers import them from here)
    FAMILIES,
    REFUSED_FAMILIES,
    SUPPORTED_FAMILIES,
    ModelError,
    ModelSpec,
    RouterRule,
    check_family,
    describe,
    num_experts,
    refusal,
    router_modules,
    router_rule,
    topk_weighting,
)


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
    the CPU (bit-identical on every node, whatever its hardware) and then cast and moved. With
    ``model.quantize-experts = "nf4"`` a checkpoint's expert stacks are quantised while it loads
    (``expert_quant.quantize_while_loading``) and only ``apply_trainable`` with the same config can run them.
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
        model, tok = load_checkpoint(Path(path), rt, experts_4bit=cfg.quantize_experts == "nf4")
    if cfg.balance_bias:  # routing.balance with a bias: part of the model, zero at the start (model/balance.py)
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


def load_checkpoint(path: Path, rt: Runtime = CPU, experts_4bit: bool = False) -> tuple[nn.Module, object]:
    """``(model, tokenizer)`` of a local checkpoint; ``experts_4bit``: every fused expert stack quantised to NF4
    as it is read, so the full-precision stacks never coexist (``expert_quant.quantize_while_loading``)."""
    from contextlib import nullcontext

    from transformers import AutoModelForCausalLM

    read_hf_config(path)
    if experts_4bit:
        from distmoe.model.expert_quant import quantize_while_loading
    with quantize_while_loading() if experts_4bit else nullcontext():
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
    """SHA-256 over names, shapes and float32 bytes, in sorted name order (the bytes hashed in place: no copy of a
    C-contiguous float32 tensor)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to(torch.float32).contiguous()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.numpy().reshape(-1).view(np.uint8))  # [numel * 4] bytes
    return h.hexdigest()


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
