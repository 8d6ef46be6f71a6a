"""AdamW with separate parameter groups and learning rates for experts / router / the rest, and a
linear warm-up schedule.

Must not: decide which parameters are trainable (``model/trainable.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from distmoe.config import TrainConfig
from distmoe.model.trainable import grouped_parameters


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> tuple[torch.optim.Optimizer,
                                                                  torch.optim.lr_scheduler.LambdaLR]:
    lrs = {"experts": cfg.lr_experts, "router": cfg.lr_router, "rest": cfg.lr}
    groups = [{"params": ps, "lr": lrs[name], "name": name, "weight_decay": cfg.weight_decay}
              for name, ps in grouped_parameters(model).items() if ps]
    if not groups:
        raise ValueError("no trainable parameters (check model.trainable)")
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.98), eps=1e-8)
    warm = max(cfg.warmup_steps, 0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / (warm + 1)))
    return opt, sched
