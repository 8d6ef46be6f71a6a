"""Calibration of an inference engine profile against the exact policy: how far its log-probs and routes are
from the fp32 trainer's on rollouts the engine itself samples (``docs/algorithms.md``, "Inference engine profiles").

Owns: ``calibrate_profile`` (one profile's mismatch on one model) and ``calibration_table`` (several profiles,
Markdown). The figures are those the GRPO loop logs per step (``grpo.py``), taken once, outside training:

    rollouts   G samples per prompt drawn from the engine of ``profile`` (temperature T), as in a GRPO step
    dlogp      |log pi_train(y_t | theta) - log pi_infer(y_t | theta)| on every valid response token      [N, T]
    k3         mean of k - 1 - log k, k = exp(log pi_train - log pi_infer)   (the train/inference KL estimate)
    route      per MoE layer, share of valid response tokens whose top-k expert set differs (policy vs engine)

Must not: train or change the model (the engine is a deep copy), read files, or import Flower.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from distmoe.config import RLConfig
from distmoe.data.formats import Example
from distmoe.data.template import encode_prompt
from distmoe.rl.grpo import build_engine
from distmoe.rl.rollout import generate_rollouts, routing_disagreement, train_logprobs


@dataclass(frozen=True)
class Calibration:
    """One profile's mismatch against the exact policy (``calibrate_profile``)."""

    profile: str
    dlogp_mean: float  # mean |Δlogp| over valid response tokens, nats
    dlogp_max: float
    k3: float  # mean k - 1 - log k
    route_disagree: float  # mean over MoE layers of the share of tokens whose top-k set differs
    route_disagree_max: float  # the worst layer's share
    tokens: int  # valid response tokens measured


@torch.no_grad()
def calibrate_profile(model: nn.Module, tokenizer, prompts: list[Example], profile: str, *, samples: int = 4,
                      max_new_tokens: int = 8, temperature: float = 1.0, seed: int = 0,
                      max_prompt_len: int = 256) -> Calibration:
    """The mismatch of engine ``profile`` built from ``model`` (not changed) on ``samples`` engine rollouts of
    every prompt in ``prompts``."""
    if not prompts:
        raise ValueError("calibrate_profile: no prompts")
    if samples < 1 or max_new_tokens < 1:
        raise ValueError(f"calibrate_profile: samples ({samples}) and max_new_tokens ({max_new_tokens}) must be >= 1")
    was_training = model.training
    model.eval()
    try:
        cfg = RLConfig(engine=profile, max_new_tokens=max_new_tokens, group_size=samples, temperature=temperature)
        engine = build_engine(model, tokenizer, prompts, cfg, max_prompt_len)
        ids = [encode_prompt(tokenizer, ex, max_prompt_len) for ex in prompts]
        ro = generate_rollouts(engine, tokenizer, ids, samples, max_new_tokens, temperature, seed=seed)
        logp_train = train_logprobs(model, ro)  # [N, T]
        mask = ro.response_mask  # [N, T]
        log_k = (logp_train - ro.logp_infer)[mask].clamp(-20, 20)  # [n]
        routes = routing_disagreement(model, engine, ro)  # [L]
    finally:
        model.train(was_training)
    if log_k.numel() == 0:
        raise ValueError(f"calibrate_profile({profile!r}): the engine produced no valid response token")
    return Calibration(profile=profile, dlogp_mean=float(log_k.abs().mean()), dlogp_max=float(log_k.abs().max()),
                       k3=float((log_k.exp() - 1 - log_k).mean()),
                       route_disagree=float(sum(routes) / len(routes)) if routes else 0.0,
                       route_disagree_max=float(max(routes)) if routes else 0.0, tokens=int(log_k.numel()))


def calibration_table(rows: list[Calibration]) -> str:
    """A Markdown table of ``rows``."""
    out = ["| engine | mean \\|Δlogp\\| | max \\|Δlogp\\| | K3 | route disagreement (mean over layers) | worst layer "
           "| tokens |", "|---|---|---|---|---|---|---|"]
    out += [f"| `{c.profile}` | {c.dlogp_mean:.3g} | {c.dlogp_max:.3g} | {c.k3:.2e} | {100 * c.route_disagree:.2f} % "
            f"| {100 * c.route_disagree_max:.2f} % | {c.tokens} |" for c in rows]
    return "\n".join(out)
