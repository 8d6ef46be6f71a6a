"""The task pairs of the continual-learning instrument (``bench/retention_e1.py --pair``) and the measurement that
chose the pair whose tokens route apart: how much task A's and task B's answer tokens share experts on the warm base.

Pairs (A is always lookup table T1 of ``distmoe.data.synth.disjoint_lookup(seed, 2, keys)``, the very A of Stage 0
and Stage 1, so a seed's pre-B state is theirs; B has ``6 * keys`` training and ``6 * keys`` held-out items):

* ``t1-t2`` (the default): B = table T2 (disjoint keys, same format: the pair Stage 0 and Stage 1 ran).
* ``t1-strings``: B = ``strings`` of party 0 (Reverse / Uppercase of 3-letter words), ``t1-shift6``: B = ``shift6``
  (every letter of a 6-letter word one place on), ``t1-arith``: B = ``arith`` of party 0: other families, split
  by ``distmoe.data.synth.disjoint_split`` (no held-out prompt among the training items; ``arith``, 400 distinct
  prompts in party 0's own window, is drawn there from the smallest wider window that holds 2 x 480: operands
  0..13). A family that cannot give that many raises ``DataError``: measured (``overlap``) but not run.

Routing overlap (``answer_routing``, ``overlap``): on the warm base, teacher-forced, per MoE layer the histogram of
the router's top-k choices over the positions that predict an answer token (the last prompt token and every answer
token but the end: where the answer's gradient enters the router and the experts), normalised to a distribution
``p [E]``; between two tasks, per layer the Jensen-Shannon distance ``JS(p, q) = sqrt((KL(p||m) + KL(q||m)) / 2)``,
``m = (p + q) / 2``, base 2, in [0, 1] (Lin 1991, "Divergence measures based on the Shannon entropy"), and the
histogram intersection ``sum_e min(p_e, q_e)`` (the share of the two tasks' expert choices that coincide), each
averaged over the layers. Beside the pairs: T1's training vs held-out items (the same task: the noise floor).

Must not: train, or change the library (it calls the data generators and reads the router's own outputs).
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.spatial.distance import jensenshannon

from distmoe.data.synth import disjoint_lookup, disjoint_split
from distmoe.model.build import router_modules

DEFAULT_PAIR = "t1-t2"
FAMILY_OF_B = {"t1-strings": "strings", "t1-shift6": "shift6", "t1-arith": "arith"}
PAIRS = (DEFAULT_PAIR, *FAMILY_OF_B)
# the arms of the route-apart run, in the pre-registered order a seed runs them in (bench/retention_e1.py)
ROUTE_APART_ARMS = ("none", "router-frozen", "experts-frozen", "distill", "replay", "anchor-5", "protect-0.1")
LEARN_BELOW = 0.5  # a B the base already answers (teacher-forced exact match >= this) is not a task to learn


def pair_tasks(pair: str, seed: int, keys: int) -> list[tuple[list[dict], list[dict]]]:
    """``[(A train, A held-out), (B train, B held-out)]`` JSONL objects of ``pair``; ``t1-t2`` is exactly
    ``disjoint_lookup(seed, 2, keys)``. ``ValueError`` naming an unknown pair; ``DataError`` where B's family has
    too few distinct items."""
    if pair not in PAIRS:
        raise ValueError(f"unknown pair {pair!r}; known: {', '.join(PAIRS)}")
    tables = disjoint_lookup(seed, 2, keys)
    if pair == DEFAULT_PAIR:
        return tables
    return [tables[0], disjoint_split(FAMILY_OF_B[pair], seed, 6 * keys, 6 * keys)]


@torch.no_grad()
def answer_routing(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """``[L, E]``: per MoE layer the distribution of the router's top-k choices over the positions that predict an
    answer token (teacher-forced, the model as it is)."""
    model.eval()
    routers = [m for _, m in router_modules(model)]
    counts: torch.Tensor | None = None
    for batch in batches:
        got: list[torch.Tensor] = []
        hooks = [m.register_forward_hook(lambda _m, _i, o, keep=got: keep.append(o[2].detach())) for m in routers]
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        for h in hooks:
            h.remove()
        labels = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)  # [B, S] next-token labels
        sup = (labels != -100).reshape(-1)  # [B*S]
        n_exp = routers[0].weight.shape[0]
        layer = []
        for idx in got:  # [B*S, k] chosen experts per token
            if idx.shape[0] != sup.shape[0]:
                raise RuntimeError(f"router output has {idx.shape[0]} rows for {sup.shape[0]} tokens")
            layer.append(torch.bincount(idx[sup].reshape(-1), minlength=n_exp).double())  # [E]
        c = torch.stack(layer)  # [L, E]
        counts = c if counts is None else counts + c
    if counts is None:
        raise ValueError("answer_routing: no batches")
    return counts / counts.sum(1, keepdim=True)


def overlap(p: torch.Tensor, q: torch.Tensor) -> dict[str, object]:
    """Between two ``[L, E]`` routing distributions: per layer and mean, the Jensen-Shannon distance (base 2) and
    the histogram intersection."""
    js = [float(jensenshannon(a.numpy(), b.numpy(), base=2)) for a, b in zip(p, q, strict=True)]
    inter = [float(torch.minimum(a, b).sum()) for a, b in zip(p, q, strict=True)]
    return {"js": [round(x, 4) for x in js], "js_mean": float(np.mean(js)),
            "intersection": [round(x, 4) for x in inter], "intersection_mean": float(np.mean(inter))}


def choose(rows: list[dict]) -> str | None:
    """The pre-registered choice: among the other-family pairs that can run (B splits into disjoint sets) and whose
    B the base does not already answer (held-out exact match < ``LEARN_BELOW``), the largest mean JS distance."""
    ok = [r for r in rows if r["pair"] in FAMILY_OF_B and r["runnable"] and r["base_acc_b"] < LEARN_BELOW]
    return max(ok, key=lambda r: r["js_mean"])["pair"] if ok else None
