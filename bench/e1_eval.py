"""The read-outs of the continual-learning instrument (``bench/retention_e1.py``): the warm base's format gate,
the teacher-forced endpoints (exact match and NLL per answer token), A's routing captured and forced on A's
evaluation (the routing oracle's readout), and the expert oracle's set of A's experts.

Teacher-forced exact match: every answer token (and the end token) is the argmax given the gold prefix, which is
exactly greedy decoding's exact match of the answer's tokens; NLL = mean over items of the mean cross-entropy per
answer token (nats).

Must not: train, choose arms or write rows (the bench does), or change the library (it reads the router's own
outputs through forward hooks).
"""

from __future__ import annotations

import re

import torch

from distmoe.data.formats import parse_line
from distmoe.data.synth import TASK_FAMILIES, generate
from distmoe.model.build import router_modules
from distmoe.train.evaluate import generate_answers, routing_on
from distmoe.train.warmup import PUBLIC_SEED_OFFSET

FORMAT = {"arith": re.compile(r"^-?\d+$"), "strings": re.compile(r"^[A-Za-z]+$"), "lookup": re.compile(r"^[A-Z]{3}$")}
GATE_ITEMS = 60  # per family
EVAL_BS = 96


def format_gate(model, tok, cfg, base_seed: int) -> dict[str, float]:
    """Share of format-valid greedy answers per family on unseen public items (party window 5 of the warm-up seed)."""
    out = {}
    for fam in TASK_FAMILIES:
        exs = [parse_line(o, f"gate {fam}:{i}")
               for i, o in enumerate(generate(fam, 5, GATE_ITEMS, base_seed + PUBLIC_SEED_OFFSET + 7))]
        preds = generate_answers(model, tok, exs, cfg.model.max_seq_len, cfg.eval)
        out[fam] = sum(bool(FORMAT[fam].match(p.strip())) for p in preds) / len(preds)
    return out


def capture_router(model, batches) -> list[list[tuple]]:
    """Per batch, per MoE layer: the router's (logits, weights, experts) on that batch."""
    out = []
    for batch in batches:
        got: list[tuple] = []
        hooks = [m.register_forward_hook(lambda _m, _i, o, keep=got: keep.append(tuple(t.detach().clone() for t in o)))
                 for _, m in router_modules(model)]
        with torch.no_grad():
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        for h in hooks:
            h.remove()
        out.append(got)
    return out


@torch.no_grad()
def evaluate(model, batches, forced: list[list[tuple]] | None = None) -> tuple[float, float]:
    """(exact-match accuracy, mean NLL per answer token) over the batches, teacher-forced; ``forced``: router
    outputs to substitute per batch and layer (``capture_router``)."""
    model.eval()
    ok, nll = [], []
    for bi, batch in enumerate(batches):
        hooks = []
        if forced is not None:
            for li, (_, m) in enumerate(router_modules(model)):
                hooks.append(m.register_forward_hook(lambda _m, _i, _o, fix=forced[bi][li]: fix))
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       use_cache=False).logits  # [B, S, V]
        for h in hooks:
            h.remove()
        labels = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)  # [B, S] next-token labels
        sup = labels != -100  # [B, S]
        ce = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100,
                                               reduction="none")  # [B, S]
        hit = (logits.argmax(-1) == labels) | ~sup  # [B, S]
        ok.extend(hit.all(1).tolist())
        nll.extend((ce.sum(1) / sup.sum(1)).tolist())
    return sum(ok) / len(ok), sum(nll) / len(nll)


def a_experts(model, tok, examples, max_len: int, top_k: int) -> torch.Tensor:
    """``[L, E]`` bool: per MoE layer the fewest experts that take >= half of A's top-k assignments."""
    _, valid = routing_on(model, tok, examples, max_len, EVAL_BS)
    rows = []
    for v in valid:  # [N, E] per layer
        counts = torch.bincount(torch.topk(v, top_k, -1).indices.reshape(-1), minlength=v.shape[-1]).float()
        order = torch.argsort(counts, descending=True)
        share = torch.cumsum(counts[order], 0) / counts.sum()
        keep = torch.zeros(v.shape[-1], dtype=torch.bool)
        keep[order[: int((share < 0.5).sum()) + 1]] = True
        rows.append(keep)
    return torch.stack(rows)
