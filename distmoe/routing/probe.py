"""The public routing probe: a small fixed set of public prompts, the global model's routing on it, and the
routing metrics of that routing (DistMoE's "routing KL stays flat over rounds" diagnostic, every round).

Owns:

- the probe set: ``default_probe_prompts(seed, n)`` (deterministic prompts of the public synthetic task
  families, ``distmoe.data.synth``, drawn for a probe-only generator index no party has, seeded by the run seed)
  or ``read_probe_file(path)`` (a user's JSONL file of ``{"prompt": "..."}`` lines, validated with file and line);
- ``probe_routing(model, tok, prompts, ...)``: the model's routing on the prompts, ``(R [L, E], T [L, N])``,
  ``R`` the mean over prompts of each prompt's mean routing distribution (``routing.stats``), ``T`` the top-1
  expert the router chooses (balancing bias included) for every valid prompt token per MoE layer;
- ``combine(replies)``: the element-wise median of the parties' ``(R, T)`` and which parties disagree with it;
- ``probe_metrics(R, T, anchor, prev_T)``: routing KL to the anchor, load CV, top-1 consistency with the previous
  probe, per-layer per-expert top-1 counts (the formulas of ``distmoe.routing.metrics``)::

      counts[l, e] = #{n : T[l, n] = e}                              [L, E]
      load_cv      = mean_l std_e(counts[l]) / mean_e(counts[l])
      routing_kl   = mean_l KL(anchor[l] || R[l])
      top1_cons    = mean_{l, n} 1[T[l, n] = T_prev[l, n]]

Everything here is a deterministic function of public inputs (the probe prompts, the global weights a party
received, the anchor): no party data is read. The privacy argument is in ``docs/privacy.md`` (§3, the probe).

Must not: read party data files, train, or send anything (the caller hands the arrays to the wire codec).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from distmoe.data.formats import DataError
from distmoe.data.synth import TASK_FAMILIES, generate
from distmoe.data.template import chat_ids, collate_prompts
from distmoe.model.balance import selection_scores
from distmoe.model.device import device_of
from distmoe.model.router import forward_with_router
from distmoe.routing import metrics as rm
from distmoe.routing.stats import per_sequence_mean_routing

PROBE_GENERATOR_INDEX = 1_000_003  # the synthetic generator's party index for probes: no party is numbered so
BALANCE_GENERATOR_INDEX = 1_000_033  # and for the public balance set (routing.public-balance): disjoint from both
MAX_PROBE_PROMPTS = 256
MAX_PROMPT_CHARS = 2000
DISAGREE_TOL = 1e-3  # max |R_party - R_median| above which a party's probe routing disagrees
DISAGREE_TOP1 = 0.98  # top-1 agreement with the median below which a party's probe routing disagrees


class ProbeError(ValueError):
    """A probe file or probe replies cannot be used; the message names what and where."""


def _prompt_text(obj: dict) -> str:
    """The user text of a synthetic example (alpaca: instruction + input; chat: the last user turn)."""
    if "messages" in obj:
        return next(m["content"] for m in reversed(obj["messages"]) if m["role"] == "user")
    return obj["instruction"] + (f"\n{obj['input']}" if obj.get("input") else "")


def family_probe_prompts(family: str, seed: int, n: int, index: int = PROBE_GENERATOR_INDEX) -> list[str]:
    """The first ``n`` probe prompts of one synthetic family (the pool ``default_probe_prompts`` draws from);
    ``index`` = ``BALANCE_GENERATOR_INDEX`` gives the public balance set's pool instead."""
    return [_prompt_text(o) for o in generate(family, index, n, seed + 7919)]


def default_probe_prompts(seed: int, n: int, index: int = PROBE_GENERATOR_INDEX) -> tuple[str, ...]:
    """``n`` prompts cycling over the synthetic task families (deterministic in ``seed`` and ``n``); with
    ``index = BALANCE_GENERATOR_INDEX`` the public balance set, a draw disjoint from the probe's."""
    if not 1 <= n <= MAX_PROBE_PROMPTS:
        raise ProbeError(f"routing.probe-prompts = {n}: expected 1..{MAX_PROBE_PROMPTS}")
    per = -(-n // len(TASK_FAMILIES))
    pools = [family_probe_prompts(f, seed, per, index) for f in TASK_FAMILIES]
    return tuple(pools[i % len(pools)][i // len(pools)] for i in range(n))


def balance_set_prompts(seed: int, styles: int, per_family: int = 32,
                        first: int = BALANCE_GENERATOR_INDEX) -> tuple[str, ...]:
    """The default public balance set: ``per_family`` prompts of each family for each of ``styles`` generator
    indices from ``first`` on, ordered family fastest, then style, so that any run of consecutive prompts mixes
    families and styles (one style: ``default_probe_prompts(seed, 3 * per_family, first)``). The synthetic
    generators vary their output with the index (string operations ``p % 4``, arithmetic ranges ``p % 3`` and
    ``p % 2``, lookup windows ``20 p % 60``: period 12), so 12 styles span every variant; from
    ``BALANCE_GENERATOR_INDEX`` no index is the probe's (``PROBE_GENERATOR_INDEX``) or a party's."""
    if not 1 <= styles <= 64:
        raise ProbeError(f"routing.public-balance-styles = {styles}: expected 1..64")
    pools = [family_probe_prompts(f, seed, per_family, first + s)
             for s in range(styles) for f in TASK_FAMILIES]  # [styles * families] lists of per_family prompts
    return tuple(pools[i % len(pools)][i // len(pools)] for i in range(per_family * len(pools)))


def check_prompts(prompts, where: str) -> tuple[str, ...]:
    """The prompts as a tuple, or ``ProbeError`` naming ``where`` (count, type, length, printable text)."""
    prompts = tuple(prompts)
    if not 1 <= len(prompts) <= MAX_PROBE_PROMPTS:
        raise ProbeError(f"{where}: {len(prompts)} probe prompts, expected 1..{MAX_PROBE_PROMPTS}")
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p.strip():
            raise ProbeError(f"{where}: prompt {i + 1} is not a non-empty string")
        if len(p) > MAX_PROMPT_CHARS:
            raise ProbeError(f"{where}: prompt {i + 1} has {len(p)} characters (at most {MAX_PROMPT_CHARS})")
        if not all(c.isprintable() or c in "\n\t" for c in p):
            raise ProbeError(f"{where}: prompt {i + 1} holds control characters")
    return prompts


def read_probe_file(path: str | Path) -> tuple[str, ...]:
    """A JSONL probe file: one ``{"prompt": "<text>"}`` object per line (blank lines skipped)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ProbeError(f"routing.probe-path: cannot read {path}: {exc}") from None
    prompts = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ProbeError(f"{where}: not JSON ({exc})") from None
        if not isinstance(obj, dict) or set(obj) != {"prompt"}:
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise ProbeError(f"{where}: expected an object with exactly the field 'prompt', got {keys}")
        prompts.append(obj["prompt"])
    return check_prompts(prompts, str(path))


@torch.no_grad()
def probe_routing(model: nn.Module, tok, prompts: tuple[str, ...], max_len: int, batch_size: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``(R [L, E] float64, T [L, N] int32)`` of ``model`` on the prompts (eval mode, no gradients; each prompt
    rendered as one user turn with the generation prompt, left-truncated to ``max_len``). ``T`` is the expert the
    router chooses first: with a balancing bias (``routing.balance = "bias"``) the top-1 of ``z + b``, as the
    layer dispatches, not of the plain logits; ``R`` is the plain softmax's mean, as the anchor statistics."""
    ids = [chat_ids(tok, [{"role": "user", "content": p}], add_generation_prompt=True)[-max_len:] for p in prompts]
    if any(not x for x in ids):
        raise DataError("a probe prompt encodes to no tokens")
    was_training = model.training
    model.eval()
    total, tops = None, []
    try:
        for i in range(0, len(ids), batch_size):
            batch = collate_prompts(ids[i:i + batch_size], tok.pad_token_id)
            mask = batch["attention_mask"].to(device_of(model))  # [B, S]
            out = forward_with_router(model, batch["input_ids"], mask)
            s = per_sequence_mean_routing(out.router_logits, mask).sum(0).double().cpu()  # [L, E]
            total = s if total is None else total + s
            chosen = selection_scores(model, rm.select_valid(out.router_logits, mask))  # L x [n, E], bias included
            tops.append(torch.stack([z.argmax(-1) for z in chosen]).cpu())  # [L, n]
    finally:
        model.train(was_training)
    return (total / len(ids)).numpy(), torch.cat(tops, 1).to(torch.int32).numpy()


def combine(replies: dict[str, tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Element-wise median of the parties' ``(R, T)`` and the parties whose arrays disagree with it.

    Honest parties compute the same function of the same public inputs, so with an honest majority the median
    is their value (for ``T``: more than half of the values equal ``v`` implies the median is ``v``); a party
    whose arrays have another shape, or differ beyond ``DISAGREE_TOL`` / ``DISAGREE_TOP1``, disagrees."""
    if not replies:
        raise ProbeError("no probe replies")
    shapes = [(r.shape, t.shape) for r, t in replies.values()]
    shape = max(set(shapes), key=shapes.count)
    same = {p: v for p, v in replies.items() if (v[0].shape, v[1].shape) == shape}
    r_med = np.median(np.stack([v[0] for v in same.values()]), 0)  # [L, E]
    t_med = np.rint(np.median(np.stack([v[1] for v in same.values()]), 0)).astype(np.int32)  # [L, N]
    bad = [p for p in replies if p not in same]
    for p, (r, t) in same.items():
        if float(np.abs(r - r_med).max()) > DISAGREE_TOL or float((t == t_med).mean()) < DISAGREE_TOP1:
            bad.append(p)
    return r_med, t_med, sorted(bad)


def expert_counts(top1: np.ndarray, num_experts: int) -> np.ndarray:
    """``[L, N]`` top-1 ids -> ``[L, E]`` counts."""
    return np.stack([np.bincount(row, minlength=num_experts)[:num_experts] for row in np.asarray(top1, np.int64)])


def probe_metrics(routing: np.ndarray, top1: np.ndarray, num_experts: int, anchor: np.ndarray | None,
                  prev_top1: np.ndarray | None) -> dict:
    """``routing_kl`` (NaN without an anchor), ``load_cv``, ``top1_consistency`` (NaN without a previous probe of
    the same shape) and ``expert_counts`` (``[L][E]`` ints) of one probe."""
    counts = expert_counts(top1, num_experts)
    kl = math.nan if anchor is None else rm.kl_to_anchor(torch.from_numpy(np.asarray(routing)),
                                                         torch.from_numpy(np.asarray(anchor)))
    cons = math.nan
    if prev_top1 is not None and np.shape(prev_top1) == np.shape(top1) and np.size(top1):
        cons = float((np.asarray(prev_top1) == np.asarray(top1)).mean())
    return {"routing_kl": kl, "load_cv": rm.load_cv(torch.from_numpy(counts)), "top1_consistency": cons,
            "expert_counts": counts.astype(int).tolist()}
