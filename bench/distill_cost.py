"""The compute cost of output distillation (``retention.distill-weight``) in the party's SFT loop: process CPU time of
``--steps`` local steps of the tiny default model with the anchor KL, without and with distillation against the
pre-task model (one extra no-gradient forward per step), ``--repeats`` times each, one thread. CPU time rather than
wall time, so that a loaded machine changes the ratio less; still, read the ratio, not the seconds.

    python bench/distill_cost.py --steps 40 --repeats 2

Must not: change the library's loop or write files.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from distmoe.config import parse_run_config
from distmoe.data.formats import parse_line
from distmoe.data.synth import generate
from distmoe.data.template import encode_example
from distmoe.model.build import build_model, describe
from distmoe.model.trainable import apply_trainable, trainable_state
from distmoe.train.retention import Retention
from distmoe.train.sft import train_sft


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = parse_run_config({"run.seed": 0, "train.threads": 1})
    model, tok = build_model(cfg.model)
    model = apply_trainable(model, cfg.model)
    ms = describe(model)
    enc = [encode_example(tok, parse_line(o, f"arith:{i}"), cfg.model.max_seq_len)
           for i, o in enumerate(generate("arith", 0, 256, 0))]
    anchor = torch.full((len(ms.moe_layers), ms.num_experts), 1.0 / ms.num_experts)  # [L, E]
    train = dataclasses.replace(cfg.train, local_steps=args.steps)
    out: dict[str, list[float]] = {"anchor": [], "anchor+distill": []}
    for _ in range(args.repeats):
        for name in out:
            ret = (Retention(ref_state={k: v.clone() for k, v in trainable_state(model).items()}, distill_weight=1.0)
                   if name.endswith("distill") else None)
            t0 = time.process_time()
            train_sft(model, enc, tok.pad_token_id, train, cfg.routing, ms.num_experts, ms.top_k, anchor, 1, ret)
            out[name].append(time.process_time() - t0)
    ratio = sum(out["anchor+distill"]) / sum(out["anchor"])
    print(f"{args.steps} steps, batch {cfg.train.batch_size}, CPU s: "
          + ", ".join(f"{k} {[round(x, 2) for x in v]}" for k, v in out.items()) + f"; ratio {ratio:.2f}")
    return out


if __name__ == "__main__":
    main()
