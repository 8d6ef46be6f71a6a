"""Benchmark: median local training step time with distmoe's additions (router-logit capture,
aux load-balance loss with the attention mask, batch- and token-level anchor KL) against a plain
``transformers`` step (``model(input_ids, attention_mask, labels)`` + backward + AdamW) of the
same model and batch, measured in one run, interleaved so that machine noise hits both alike.

    python bench/step_overhead.py [--steps 30] [--batch 16] [--threads 2]

Prints the medians and the ratios (goal: <= 1.05).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from distmoe.config import parse_run_config
from distmoe.data.formats import parse_line
from distmoe.data.synth import generate
from distmoe.data.template import collate, encode_example
from distmoe.model.build import build_model, describe
from distmoe.train.sft import sft_loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = parse_run_config({})
    model, tok = build_model(cfg.model)
    ms = describe(model)
    rows = generate("lookup", 0, args.batch, 0)
    examples = [parse_line(r, f"bench:{i}") for i, r in enumerate(rows)]
    batch = collate([encode_example(tok, ex, cfg.model.max_seq_len) for ex in examples], tok.pad_token_id)
    anchor = torch.full((ms.num_moe_layers, ms.num_experts), 1.0 / ms.num_experts)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()

    def plain() -> None:
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    labels=batch["labels"], use_cache=False)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()

    def ours(granularity: str):
        routing = parse_run_config({"routing.anchor-granularity": granularity}).routing

        def step() -> None:
            loss, _ = sft_loss(model, batch, routing, ms.num_experts, ms.top_k, anchor)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return step

    arms = {"plain transformers": plain, "distmoe (batch anchor KL)": ours("batch"),
            "distmoe (token anchor KL)": ours("token")}
    times: dict[str, list[float]] = {k: [] for k in arms}
    for i in range(args.warmup + args.steps):
        for name, fn in arms.items():  # interleaved
            t = time.perf_counter()
            fn()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t)
    base = statistics.median(times["plain transformers"])
    tokens = int(batch["attention_mask"].sum())
    print(f"model {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, batch {args.batch} x "
          f"{batch['input_ids'].shape[1]} ({tokens} tokens), {args.threads} threads, {args.steps} steps")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:28s} median {med * 1000:8.2f} ms   ratio {med / base:.3f}")


if __name__ == "__main__":
    main()
