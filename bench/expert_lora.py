"""Benchmark: expert LoRA on the routed tokens (``distmoe.model.expert_lora``, what ``model.trainable = "lora"``
runs) against peft's ``target_parameters`` path (every expert's ``W + BA`` built on every forward) and against a
plain peft attention-only LoRA step, at the same tokens, on the scaled Qwen3-MoE / OLMoE shapes of
``bench/real_model.py`` (random init, saved as a checkpoint and loaded as a party loads it).

    python bench/expert_lora.py [--sizes 0.1b 1b] [--families qwen3_moe olmoe] [--arms routed peft attention]
                                [--steps 3] [--warmup 1] [--no-memory] [--batch-size 4] [--seq-len 128]
                                [--threads 2] [--out f.json]

Arms (one plain step each: ``model(input_ids, attention_mask, labels)``, ``loss.backward()``,
``clip_grad_norm_``, the party's AdamW, ``distmoe.train.optim.adamw``, on the arm's trainable tensors):

- ``routed``: distmoe's ``apply_trainable`` (adapters on attention, router and experts; experts routed);
- ``peft``: the same adapters with peft's own ``ParamWrapper`` forward on the experts (``expert_lora.install(...,
  routed=False)``), as distmoe ran before;
- ``attention``: adapters on the attention projections only (``model.lora-experts = false``,
  ``model.lora-router = false``): the plain peft LoRA step the time goal is measured against.

Memory: one subprocess per arm loads the checkpoint, builds the arm and runs two steps; its peak RSS (``VmHWM``)
minus the RSS of a process that only imports the same modules is the arm's figure. ``base`` is the bytes of the
frozen base; the attention arm's figure minus ``base`` is taken as the activations (plus the small adapters and
their optimizer state), so the goal reads ``routed - activations <= 1.3 x base``.
Time: one subprocess loads the checkpoint once and runs the arms interleaved on the same model and batch (the
arm is switched by changing which forward peft's wrappers run: no reload), alternating the order, medians after
warm-up; the ratio of the median wall times, of the median process CPU times and the median of the per-iteration
ratios (both steps of an iteration ran back to back under about the same load).

Timings on a shared machine are noisy: compare the ratios within one invocation. No timing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_model as rm  # noqa: E402  (the shapes, the checkpoint writer, the batch and the RSS readers)

ARMS = ("routed", "peft", "attention")
PHASES = ("forward", "backward", "optimizer")
MB = 1e6


def build_arm(ckpt: str, arm: str):
    """``(model, trainable params)`` of ``arm`` over the checkpoint, loaded as a party loads it."""
    from distmoe.model import expert_lora
    from distmoe.model.build import build_model
    from distmoe.model.trainable import apply_trainable

    over = {"model.lora-experts": False, "model.lora-router": False} if arm == "attention" else {}
    cfg = rm.run_config(ckpt, **over)
    model = apply_trainable(build_model(cfg.model)[0], cfg.model)
    if arm == "peft":
        expert_lora.install(model, routed=False)
    return model, cfg


def _outer_wrappers(model):
    from peft.tuners.lora.layer import ParamWrapper

    found = [m for _, m in model.named_modules() if isinstance(m, ParamWrapper)]
    inner = {id(m.base_layer) for m in found}
    return [m for m in found if id(m) not in inner]


def switch(model, arm: str) -> list:
    """Make the ``routed``-built ``model`` compute ``arm``; returns the arm's trainable tensors. ``attention``:
    the expert and router wrappers run their base module only and their adapters are frozen, which is exactly
    the computation of an attention-only peft model."""
    from peft.tuners.lora.layer import ParamWrapper

    from distmoe.model import expert_lora

    class _BaseOnly(ParamWrapper):
        def forward(self, x, *args, **kwargs):
            return self.get_base_layer()(x, *args, **kwargs)

    for w in _outer_wrappers(model):
        is_stack = getattr(w, "num_experts", 1) > 1
        if arm == "attention":
            w.__class__ = _BaseOnly
        elif is_stack:
            w.__class__ = expert_lora.RoutedExpertsLoRA if arm == "routed" else ParamWrapper
        else:
            w.__class__ = ParamWrapper
        for mod in (m for m in w.modules() if isinstance(m, ParamWrapper)):
            for p in (*mod.lora_A.parameters(), *mod.lora_B.parameters()):
                p.requires_grad_(arm != "attention")
                p.grad = None
    return [p for p in model.parameters() if p.requires_grad]


def plain_step(model, params, opt, batch) -> dict[str, float]:
    """One step; returns the wall seconds of its phases: ``forward``, ``backward``, ``optimizer`` (the clip
    and AdamW)."""
    t0 = time.perf_counter()
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                use_cache=False)
    t1 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    out.loss.backward()
    t2 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": time.perf_counter() - t2}


def _mem_main(args) -> dict:
    from distmoe.train.optim import adamw

    t = time.perf_counter()
    model, _ = build_arm(args.ckpt, args.arm)
    base = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    params = [p for p in model.parameters() if p.requires_grad]
    after_load = rm._rss_split_mb()
    batch = rm.make_batch(args.batch_size, args.seq_len, model.config.vocab_size)
    opt = adamw(params, lr=1e-4)
    model.train()
    for _ in range(2):
        plain_step(model, params, opt, batch)
    return {"arm": args.arm, "peak_rss_mb": rm._peak_rss_mb(), "after_load": after_load, "base_mb": base / MB,
            "trainable": sum(p.numel() for p in params), "mem_s": time.perf_counter() - t}


def _time_main(args) -> dict:
    from distmoe.train.optim import adamw

    model, _ = build_arm(args.ckpt, "routed")
    batch = rm.make_batch(args.batch_size, args.seq_len, model.config.vocab_size)
    arms = [a for a in ARMS if a in args.arms]
    opts = {}
    for arm in arms:
        params = switch(model, arm)
        opts[arm] = (params, adamw(params, lr=1e-4))
    wall: dict[str, list[float]] = {a: [] for a in arms}
    cpu: dict[str, list[float]] = {a: [] for a in arms}
    phases: dict[str, list[dict[str, float]]] = {a: [] for a in arms}
    loads = [os.getloadavg()[0]]
    model.train()
    for i in range(args.warmup + args.steps):
        order = arms if i % 2 == 0 else arms[::-1]
        took = {}
        for arm in order:
            params, opt = opts[arm]
            switch(model, arm)
            t, c = time.perf_counter(), time.process_time()
            split = plain_step(model, params, opt, batch)
            took[arm] = time.perf_counter() - t
            if i >= args.warmup:
                wall[arm].append(took[arm])
                cpu[arm].append(time.process_time() - c)
                phases[arm].append(split)
        rm.say("  step " + f"{i + 1}/{args.warmup + args.steps}: " + ", ".join(f"{a} {took[a]:.2f} s" for a in arms)
               + f" (load {os.getloadavg()[0]:.1f})")
        loads.append(os.getloadavg()[0])
    ref = "attention" if "attention" in arms else arms[0]
    res: dict = {"tokens": int(batch["attention_mask"].sum()), "ref": ref, "load1": [min(loads), max(loads)]}
    for arm in arms:
        res[arm] = {"wall_s": statistics.median(wall[arm]), "cpu_s": statistics.median(cpu[arm]),
                    "ratio_wall": statistics.median(wall[arm]) / statistics.median(wall[ref]),
                    "ratio_cpu": statistics.median(cpu[arm]) / statistics.median(cpu[ref]),
                    "ratio_pairs": statistics.median(a / b for a, b in zip(wall[arm], wall[ref], strict=True)),
                    **{f"{k}_s": statistics.median(p[k] for p in phases[arm]) for k in PHASES}}
    return res


def _sub(args, role: str, ckpt: Path, arm: str = "") -> dict:
    cmd = [sys.executable, __file__, "--role", role, "--ckpt", str(ckpt), "--threads", str(args.threads),
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--arm", arm or "routed", "--arms", *args.arms]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": rm._pythonpath()})
    lines = proc.stdout.splitlines()
    for line in lines:
        if not line.startswith("{"):
            print(line, flush=True)
    if proc.returncode != 0 or not lines or not lines[-1].startswith("{"):
        raise RuntimeError(f"{role} {arm} subprocess failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def cell(family: str, size: str, args, root: Path, baseline: float) -> dict:
    ckpt = root / f"{family}-{size}"
    info = rm.save_checkpoint(family, rm.SHAPES[(family, size)], ckpt)
    rm.say(f"{family} {size}: {info['parameters'] / 1e9:.3f}B parameters ({info['config']})")
    out = {"family": family, "size": size, **info, "mem": {}}
    for arm in args.arms if args.memory else ():
        m = _sub(args, "mem", ckpt, arm)
        m["net_mb"] = m["peak_rss_mb"] - baseline
        out["mem"][arm] = m
        rm.say(f"  {arm}: peak RSS {m['peak_rss_mb']:.0f} MB ({m['net_mb']:.0f} MB over the imports), base "
               f"{m['base_mb']:.0f} MB, load1 {os.getloadavg()[0]:.1f}")
    if args.steps > 0:
        out["time"] = _sub(args, "time", ckpt)
    shutil.rmtree(ckpt, ignore_errors=True)
    return out


def print_tables(cells: list[dict], baseline: float, args) -> None:
    print(f"\nbatch {args.batch_size} x {args.seq_len}, {args.threads} torch threads; baseline RSS {baseline:.0f} MB\n")
    print("| family | size | parameters | base (frozen) | arm | trainable | peak RSS over imports | "
          "x base | (peak - activations) / base |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in cells:
        mem = c["mem"]
        act = mem["attention"]["net_mb"] - mem["attention"]["base_mb"] if "attention" in mem else None
        for arm, m in mem.items():
            goal = f"{(m['net_mb'] - act) / m['base_mb']:.2f}" if act is not None else "-"
            print(f"| {c['family']} | {c['size']} | {c['parameters'] / 1e6:.0f}M | {m['base_mb']:.0f} MB | {arm} | "
                  f"{m['trainable'] / 1e6:.2f}M | {m['net_mb']:.0f} MB | {m['net_mb'] / m['base_mb']:.2f} | {goal} |")
    if any("time" in c for c in cells):
        print("\n| family | size | tokens | arm | median step s | CPU s | / attention (wall) | (CPU) | (pairs) | "
              "forward / backward / optimizer s | load (1 min) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for c in cells:
            t = c.get("time")
            for arm in (a for a in ARMS if t and a in t):
                r = t[arm]
                split = " / ".join(f"{r[f'{k}_s']:.2f}" for k in PHASES)
                print(f"| {c['family']} | {c['size']} | {t['tokens']} | {arm} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | "
                      f"{r['ratio_wall']:.3f} | {r['ratio_cpu']:.3f} | {r['ratio_pairs']:.3f} | {split} | "
                      f"{t['load1'][0]:.1f}-{t['load1'][1]:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["0.1b"], choices=["0.1b", "0.5b", "1b"])
    ap.add_argument("--families", nargs="+", default=["qwen3_moe"], choices=["olmoe", "qwen3_moe"])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per arm (0: memory only)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                    help="the per-arm peak RSS subprocesses (--no-memory: the timing only)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="")
    ap.add_argument("--role", choices=["mem", "time"], help=argparse.SUPPRESS)
    ap.add_argument("--arm", choices=ARMS, default="routed", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.role:
        print(json.dumps(_mem_main(args) if args.role == "mem" else _time_main(args)), flush=True)
        return
    baseline = rm.baseline_rss(args)
    cells = []
    with tempfile.TemporaryDirectory(prefix="distmoe-xlora-") as tmp:
        for size in args.sizes:
            for family in args.families:
                cells.append(cell(family, size, args, Path(tmp), baseline))
    print_tables(cells, baseline, args)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "baseline_rss_mb": baseline, "cells": cells},
                                             indent=1, default=str))


if __name__ == "__main__":
    main()
