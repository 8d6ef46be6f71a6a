"""What the server holds of the model: exactly the tensors that train, and in ``lora`` mode never the base.

``server_model(cfg)`` returns a ``ServerModel``: the initial trainable weights (float32, CPU, keyed by the
canonical names that the parties' ``trainable_state`` gives), their ``TrainableSpec``, the ``ModelSpec`` of
the routers, the parameter count, and a way to write the global weights into a checkpoint directory.

- ``lora``: the architecture is built on the ``meta`` device from the config alone (``config.json`` of a
  checkpoint, or ``tiny_config``), wrapped with the same ``peft`` ``LoraConfig`` the parties use
  (``distmoe.model.trainable.lora_config``); names and shapes of the adapters are read from that skeleton,
  and their initial values are drawn here, deterministically from ``model.seed`` (``lora_A`` as peft's
  kaiming-uniform init, ``lora_B`` zeros: the adapter starts as a no-op). No tensor of the base is ever
  loaded (its weight files are only hashed, streamed, once for the fingerprint), so the server's memory
  does not grow with the base. A checkpoint is written in peft's own
  format (``adapter/adapter_model.safetensors`` + ``adapter/adapter_config.json``, loadable with
  ``PeftModel.from_pretrained(base, dir)``), identified against its base by the base fingerprint.
- ``all`` / ``router+experts``: all or most of the model trains, so the server builds it (as the parties
  do) and checkpoints it as a Hugging Face directory ``model/`` (weights + tokenizer).

``merge_adapters`` is the other direction, used by ``distmoe export``: a base plus an adapter directory,
merged into a plain ``transformers`` model.

Must not: read party data, download anything, or decide which tensors train (``trainable.py``).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from distmoe.config import ModelConfig
from distmoe.model.base import base_fingerprint
from distmoe.model.build import (
    ModelSpec,
    build_model,
    describe,
    param_count,
    read_hf_config,
    tiny_config,
)
from distmoe.model.trainable import (
    TrainableError,
    TrainableSpec,
    apply_trainable,
    check_trainable,
    load_trainable,
    lora_config,
    spec_of,
    trainable_state,
)

ADAPTER_DIR = "adapter"  # lora checkpoints: peft's adapter_model.safetensors + adapter_config.json
SAFETENSORS_META = {"format": "pt"}  # what transformers writes and expects in a weight file
MODEL_DIR = "model"  # all / router+experts checkpoints: a Hugging Face model directory


@dataclass(frozen=True, eq=False)
class ServerModel:
    """The server's model: what trains, and nothing else in ``lora`` mode.

    ``module`` is the peft-wrapped meta-device skeleton in ``lora`` mode (names, shapes, config; no storage)
    and the materialised model otherwise; ``tokenizer`` is None in ``lora`` mode (the base's tokenizer stays
    with the base)."""

    mode: str
    weights: dict[str, torch.Tensor]  # initial trainable weights: float32, CPU, canonical names
    tspec: TrainableSpec
    mspec: ModelSpec
    n_params: int
    base_fingerprint: str
    model_path: str  # the base checkpoint ("" = the tiny default)
    module: nn.Module
    tokenizer: object | None = None

    @property
    def holds_base(self) -> bool:
        return self.mode != "lora"

    @property
    def layout(self) -> str:
        """The checkpoint subdirectory this model writes: ``adapter`` or ``model``."""
        return MODEL_DIR if self.holds_base else ADAPTER_DIR

    def manifest_meta(self) -> dict:
        """What a checkpoint's manifest records about the model."""
        meta = {"trainable": self.mode, "layout": self.layout}
        if not self.holds_base:
            meta["base_fingerprint"] = self.base_fingerprint
        return meta

    def save(self, out: Path, weights: dict[str, torch.Tensor]) -> Path:
        """Write ``weights`` (exactly ``tspec``'s tensors) into ``out/<layout>``; returns that directory."""
        check_trainable(weights, self.tspec)
        target = Path(out) / self.layout
        if self.holds_base:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # no per-shard progress bars in the run log
            load_trainable(self.module, weights, self.tspec)
            write_hf_dir(self.module, target)
            self.tokenizer.save_pretrained(target)
            return target
        from peft import get_peft_model_state_dict

        # peft's key names (adapter name stripped), from our state: the skeleton's own tensors are meta
        state = get_peft_model_state_dict(self.module, state_dict={k: v.detach().to(torch.float32).contiguous()
                                                                   for k, v in weights.items()})
        if len(state) != len(weights):
            raise TrainableError(f"peft kept {len(state)} of {len(weights)} adapter tensors")
        target.mkdir(parents=True, exist_ok=True)
        save_file(state, str(target / "adapter_model.safetensors"), metadata={"format": "pt"})
        pcfg = copy.deepcopy(self.module.peft_config["default"])
        pcfg.base_model_name_or_path = self.model_path or None
        pcfg.save_pretrained(str(target))
        return target


def model_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's persistent state in its own (fused) parameter names, each storage once: a tied copy (the
    output embedding of a tied model) is left out, as ``save_pretrained`` does, and tied again on loading."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...], torch.dtype]] = set()
    for name, t in module.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().contiguous()
    return out


def write_hf_dir(module: nn.Module, target: Path) -> None:
    """A Hugging Face model directory (config, generation config, ``model.safetensors``) loadable with
    ``from_pretrained``, its weights written in the module's own names (``model_tensors``) with the same
    metadata as a checkpoint's ``trainable.safetensors``: when every weight trains (``all``), the two files are
    byte-identical and a checkpoint stores them once (``distmoe.checkpoint``, content-addressed links)."""
    target.mkdir(parents=True, exist_ok=True)
    module.config.save_pretrained(target)
    gen = getattr(module, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(target)
    save_file(model_tensors(module), str(target / "model.safetensors"), metadata=SAFETENSORS_META)


def _meta_skeleton(cfg: ModelConfig) -> nn.Module:
    """The architecture on the ``meta`` device, from the config only (no weight is read or allocated)."""
    from transformers import AutoModelForCausalLM

    if cfg.path:
        hf_cfg = read_hf_config(Path(cfg.path))
    else:
        from distmoe.model.tokenizer import DEFAULT_VOCAB_SIZE

        hf_cfg = tiny_config(cfg, DEFAULT_VOCAB_SIZE)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    return model.eval()


def initial_adapters(shapes: tuple[tuple[str, tuple[int, ...]], ...], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic initial adapters in canonical name order: ``lora_A`` [r(*experts), in] kaiming-uniform
    with a = sqrt(5) (peft's ``init_lora_weights=True``: U(-1/sqrt(in), 1/sqrt(in))), ``lora_B`` zeros."""
    gen = torch.Generator().manual_seed(seed + 1)
    out = {}
    for name, shape in shapes:
        t = torch.zeros(shape, dtype=torch.float32)
        if ".lora_A." in name:
            nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=gen)
        elif ".lora_B." not in name:
            raise TrainableError(f"lora mode: unexpected trainable tensor {name!r} (neither lora_A nor lora_B)")
        out[name] = t
    return out


def server_model(cfg: ModelConfig) -> ServerModel:
    """The server's model for ``cfg`` (``cfg.trainable`` already resolved from ``auto``)."""
    if cfg.trainable != "lora":
        model, tok = build_model(cfg)
        model = apply_trainable(model, cfg)
        tspec = spec_of(model, cfg.trainable, base_fingerprint(cfg, cfg.path))
        return ServerModel(mode=cfg.trainable, weights=trainable_state(model), tspec=tspec, mspec=describe(model),
                           n_params=param_count(model), base_fingerprint=tspec.base_hash, model_path=cfg.path,
                           module=model, tokenizer=tok)
    from peft import get_peft_model

    meta = _meta_skeleton(cfg)
    skeleton = get_peft_model(meta, lora_config(cfg, meta))
    params = dict(skeleton.named_parameters())
    shapes = tuple((n, tuple(params[n].shape)) for n in sorted(n for n, p in params.items() if p.requires_grad))
    fingerprint = base_fingerprint(cfg, cfg.path)
    return ServerModel(mode="lora", weights=initial_adapters(shapes, cfg.seed),
                       tspec=TrainableSpec(mode="lora", shapes=shapes, base_hash=fingerprint),
                       mspec=describe(skeleton), n_params=param_count(skeleton), base_fingerprint=fingerprint,
                       model_path=cfg.path, module=skeleton)


def merge_adapters(cfg: ModelConfig, adapter_dir: Path, model_path: str = "") -> tuple[nn.Module, object]:
    """The base (``model_path`` or ``cfg.path``; the tiny default when both are empty) with the peft adapters of
    ``adapter_dir`` merged in: ``(plain transformers model, tokenizer)``, float32, eval mode.

    peft 0.21 merges the ``target_parameters`` adapters of the fused experts and the router
    (``ParamWrapper.merge``: the delta ``B @ A`` per expert added to the 3-D parameter), so
    ``merge_and_unload`` is used as is; the export test checks the merged logits against the adapted model's."""
    from peft import PeftModel

    # merged into the full-precision experts, whatever the run stored them in (model.quantize-experts)
    base, tok = build_model(replace(cfg, quantize_experts="none"), model_path)
    adapted = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=False)
    merged = adapted.merge_and_unload()
    merged.eval()
    return merged, tok
