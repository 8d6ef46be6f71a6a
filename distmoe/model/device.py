"""Where and in which precision a party computes: the device, the dtype of the frozen base, the
autocast context and the optional quantisation, resolved once from ``train.*`` (and the owner's
node config).

Mixed precision, as PyTorch's AMP recipe and ``peft`` do it: the frozen base is stored in
``train.dtype`` (bf16 halves its memory); every trainable tensor is kept in float32 (master
weights, and therefore float32 AdamW state; ``peft``'s ``autocast_adapter_dtype`` does the same for
adapters), and forwards run under ``torch.autocast(device, dtype)`` so that the matmuls run in the
low precision while reductions, softmax and the losses stay float32. float16 adds a gradient
scaler (``torch.amp.GradScaler``); bfloat16 needs none (it has float32's exponent range). Why not
pure bf16 weights with a bf16 optimizer: updates of size lr·g are below bf16's resolution of
weights near 1 and vanish (the Kahan-summation/fp32-master-weights argument of Micikevicius et al.
2018, "Mixed Precision Training").

Owns: ``Runtime`` and ``resolve_runtime``, ``autocast_for`` (the forward's autocast, from the model's own
dtypes), moving a batch to the device, and the
refusals for what cannot run here (CUDA asked for but absent, quantisation off CUDA or without
``bitsandbytes``).

Must not: build or load models (``build.py``, ``base.py``) or train.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from distmoe.config import TrainConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DeviceError(RuntimeError):
    """The configured device, dtype or quantisation cannot be used on this machine."""


@dataclass(frozen=True)
class Runtime:
    """A party's resolved compute placement."""

    device: torch.device
    dtype: torch.dtype  # the frozen base's dtype (and the autocast dtype when not float32)
    quantize: str = "none"  # none | 4bit | 8bit (bitsandbytes, CUDA only)

    @property
    def mixed(self) -> bool:
        return self.dtype != torch.float32

    @property
    def key(self) -> tuple:
        """What identifies a loaded base under this runtime (the per-process cache key)."""
        return (str(self.device), str(self.dtype), self.quantize)

    def describe(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        q = f", {self.quantize} base" if self.quantize != "none" else ""
        return f"{self.device} {dt}{q}"


CPU = Runtime(torch.device("cpu"), torch.float32)


def _auto_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def resolve_runtime(train: TrainConfig, trainable: str = "lora") -> Runtime:
    """``train.device``/``dtype``/``quantize`` -> a ``Runtime`` that can run here, or a clear refusal."""
    if train.device == "auto":
        device = _auto_device()
    else:
        device = torch.device(train.device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise DeviceError(f"train.device = {train.device!r}: this machine has no CUDA device visible to "
                                  f"PyTorch {torch.__version__} (CUDA build: {torch.version.cuda or 'no'}); set "
                                  "train.device = \"cpu\" (or \"auto\") in this party's node config")
            index = device.index if device.index is not None else torch.cuda.current_device()
            if index >= torch.cuda.device_count():
                raise DeviceError(f"train.device = {train.device!r}: only {torch.cuda.device_count()} CUDA "
                                  "device(s) are visible")
            device = torch.device("cuda", index)
        elif device.type == "mps":
            mps = getattr(torch.backends, "mps", None)
            if mps is None or not mps.is_available():
                raise DeviceError("train.device = \"mps\": Apple's Metal backend is not available here")
    dtype = TORCH_DTYPES[train.dtype]
    if train.quantize != "none":
        if device.type != "cuda":
            raise DeviceError(f"train.quantize = {train.quantize!r}: bitsandbytes quantisation runs on CUDA only "
                              f"(this party computes on {device}); set train.quantize = \"none\"")
        if trainable != "lora":
            raise DeviceError(f"train.quantize = {train.quantize!r} needs model.trainable = \"lora\" (a quantised "
                              f"base cannot be trained or sent; it is {trainable!r})")
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise DeviceError(f"train.quantize = {train.quantize!r}: bitsandbytes is not installed; install "
                              "distmoe with the `quant` extra (pip install 'distmoe[quant]')") from None
    if dtype == torch.float16 and device.type == "cpu":
        raise DeviceError("train.dtype = \"float16\" on the CPU: CPU float16 matmuls are slow and imprecise; use "
                          "\"bfloat16\" (or \"float32\") on the CPU")
    return Runtime(device=device, dtype=dtype, quantize=train.quantize)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of a collated batch on ``device`` (non-blocking from pinned memory on CUDA)."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def device_of(model: torch.nn.Module) -> torch.device:
    """The device of a model's first parameter (all of a party's model is on one device)."""
    return next(model.parameters()).device


def base_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the frozen base computes in: the first floating parameter below float32, else float32; a model
    whose tensors are cast as its forward runs (an RL engine's view, ``distmoe.rl.engine_view``) names it in
    ``distmoe_compute_dtype``."""
    declared = getattr(model, "distmoe_compute_dtype", None)
    if isinstance(declared, torch.dtype):
        return declared
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            return p.dtype
    return torch.float32


def autocast_for(model: torch.nn.Module):
    """``autocast`` for a model whose base is stored below float32 (its float32 trainable tensors then
    meet low-precision weights in the matmuls); nothing for a float32 model."""
    dtype = base_dtype(model)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_of(model).type, dtype=dtype)
