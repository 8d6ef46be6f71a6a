"""Local evaluation at a party: per-task accuracy (greedy generation checked by the task's
verifier) and answer loss on held-out data, plus routing metrics on a fixed set (the party's
held-out examples of every evaluated task): routing KL to the anchor, expert-load CV and top-1
consistency against a reference model.

Returns aggregate numbers (means and counts) for the plaintext baseline, and per-example scores
(:func:`example_scores`: answered correctly, mean answer loss) for the party's own noised sum under secure
aggregation (``distmoe.privacy.metric_noise``); neither leaves the party as such.

The party passes only examples whose answer fits ``max_len`` (``template.encode_fitting``, in
``distmoe.party.work``: the rest are left out, never refused, so whether a party answers does not tell the
length of its longest answer); a direct caller that passes a longer one gets ``encode_example``'s error.

Must not: read data files (the caller passes examples) or touch the wire.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from distmoe.config import EvalConfig
from distmoe.data.formats import Example
from distmoe.data.synth import check_answer
from distmoe.data.template import collate, collate_prompts, encode_example, encode_prompt
from distmoe.model.balance import selection_scores
from distmoe.model.device import autocast_for, device_of, to_device
from distmoe.model.router import forward_with_router
from distmoe.routing import metrics as rm
from distmoe.routing.stats import per_sequence_mean_routing
from distmoe.train.sft import causal_lm_loss


def _chunks(xs: list, n: int):
    for i in range(0, len(xs), n):
        yield xs[i:i + n]


@torch.no_grad()
def answer_loss(model: nn.Module, tok, examples: list[Example], max_len: int, batch_size: int) -> float:
    """Token-weighted mean CE on answer tokens."""
    encoded = [encode_example(tok, ex, max_len) for ex in examples]
    total, count = 0.0, 0
    for chunk in _chunks(encoded, batch_size):
        batch = to_device(collate(chunk, tok.pad_token_id), device_of(model))
        with autocast_for(model):
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        n = int((batch["labels"][:, 1:] != -100).sum())
        total += float(causal_lm_loss(out.logits, batch["labels"])) * n
        count += n
    return total / max(count, 1)


@torch.no_grad()
def example_losses(model: nn.Module, tok, examples: list[Example], max_len: int, batch_size: int) -> list[float]:
    """Each example's mean CE over its own answer tokens (NaN for an example without any)."""
    encoded = [encode_example(tok, ex, max_len) for ex in examples]
    out: list[float] = []
    for chunk in _chunks(encoded, batch_size):
        batch = to_device(collate(chunk, tok.pad_token_id), device_of(model))
        with autocast_for(model):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           use_cache=False).logits  # [B, S, V]
        labels = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)  # [B, S] next-token labels
        ce = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100,
                                               reduction="none")  # [B, S], 0 where ignored
        n = (labels != -100).sum(1)  # [B]
        out.extend(float(c) / int(k) if int(k) else math.nan for c, k in zip(ce.sum(1), n, strict=True))
    return out


def example_scores(model: nn.Module, tok, task: str, examples: list[Example], max_len: int, cfg: EvalConfig
                   ) -> list[tuple[bool, float]]:
    """``(answered correctly, mean answer loss)`` per example, in order."""
    preds = generate_answers(model, tok, examples, max_len, cfg)
    ok = [check_answer(task, ex.prompt_messages[-1]["content"], p, ex.answer)
          for ex, p in zip(examples, preds, strict=True)]
    return list(zip(ok, example_losses(model, tok, examples, max_len, cfg.batch_size), strict=True))


@torch.no_grad()
def generate_answers(model: nn.Module, tok, examples: list[Example], max_len: int, cfg: EvalConfig
                     ) -> list[str]:
    prompts = [encode_prompt(tok, ex, max_len - cfg.max_new_tokens) for ex in examples]
    answers: list[str] = []
    eos = tok.eos_token_id
    for chunk in _chunks(prompts, cfg.batch_size):
        batch = to_device(collate_prompts(chunk, tok.pad_token_id), device_of(model))
        with autocast_for(model):
            out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 max_new_tokens=cfg.max_new_tokens, do_sample=False, eos_token_id=eos,
                                 pad_token_id=tok.pad_token_id, use_cache=True)
        new = out[:, batch["input_ids"].shape[1]:]  # [B, T]
        answers.extend(tok.batch_decode(new, skip_special_tokens=True))
    return answers


def task_accuracy(model: nn.Module, tok, task: str, examples: list[Example], max_len: int,
                  cfg: EvalConfig) -> float:
    preds = generate_answers(model, tok, examples, max_len, cfg)
    ok = [check_answer(task, ex.prompt_messages[-1]["content"], p, ex.answer)
          for ex, p in zip(examples, preds, strict=True)]
    return sum(ok) / max(len(ok), 1)


@torch.no_grad()
def routing_on(model: nn.Module, tok, examples: list[Example], max_len: int, batch_size: int
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(per-sequence-mean routing summed [L, E], valid-token router logits L x [N, E])."""
    encoded = [encode_example(tok, ex, max_len) for ex in examples]
    total = None
    valid: list[list[torch.Tensor]] = []
    for chunk in _chunks(encoded, batch_size):
        batch = to_device(collate(chunk, tok.pad_token_id), device_of(model))
        out = forward_with_router(model, batch["input_ids"], batch["attention_mask"])
        s = per_sequence_mean_routing(out.router_logits, batch["attention_mask"]).sum(0)  # [L, E]
        total = s if total is None else total + s
        # top-k/argmax of these is the experts chosen (the routing bias included, routing.balance "bias")
        valid.append(selection_scores(model, rm.select_valid(out.router_logits, batch["attention_mask"])))
    layers = [torch.cat([v[li] for v in valid], 0) for li in range(len(valid[0]))]
    return total, layers


def routing_set(heldout: dict[str, list[Example]]) -> list[Example]:
    """The fixed set the routing metrics are taken on: every held-out example, in task order."""
    return [ex for examples in heldout.values() for ex in examples]


def evaluate_party(model: nn.Module, tok, heldout: dict[str, list[Example]], max_len: int,
                   cfg: EvalConfig, num_experts: int, anchor: torch.Tensor | None,
                   ref_valid: list[torch.Tensor] | None) -> dict[str, float]:
    """Metrics keyed ``acc/<task>``, ``loss/<task>``, ``n/<task>`` and the routing keys.

    ``ref_valid`` is the reference model's valid-token router logits on ``routing_set(heldout)``
    (``routing_on``), for top-1 consistency; None leaves it NaN. A task the party does not hold gets
    ``n = 0`` and NaN accuracy/loss.
    """
    model.eval()
    out: dict[str, float] = {}
    fixed = routing_set(heldout)
    for task, examples in heldout.items():
        if not examples:
            out.update({f"acc/{task}": math.nan, f"loss/{task}": math.nan, f"n/{task}": 0.0})
            continue
        out[f"acc/{task}"] = task_accuracy(model, tok, task, examples, max_len, cfg)
        out[f"loss/{task}"] = answer_loss(model, tok, examples, max_len, cfg.batch_size)
        out[f"n/{task}"] = float(len(examples))
    out.update({"routing_kl": math.nan, "load_cv": math.nan, "top1_consistency": math.nan})
    if fixed:
        summed, valid = routing_on(model, tok, fixed, max_len, cfg.batch_size)
        out["load_cv"] = rm.load_cv(rm.top1_counts(valid, num_experts))
        if anchor is not None:
            out["routing_kl"] = rm.kl_to_anchor(summed / len(fixed), anchor)
        if ref_valid is not None:
            agree, total = rm.top1_agreement(valid, ref_valid)
            out["top1_consistency"] = agree / max(total, 1)
    return out
