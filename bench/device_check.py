"""Device check: the first thing to run on an accelerator. One command builds a Qwen3-30B-A3B-shaped model with
random weights directly on the device (``meta``-device construction, ``to_empty``, random initialisation: no
download, no CPU copy), wraps it as a party does (``model.trainable = "lora"``: adapters on attention, router and
experts, the experts' computed on the routed tokens), and runs with gradient checkpointing on:

1. LoRA training steps, interleaved with a plain peft attention-only LoRA step on the same model and batch (the
   arm is switched by which forward peft's wrappers run, ``bench/expert_lora.py``), and prints tokens/s, the
   peak device memory of each arm and their ratio;
2. one RL-style step: rollouts sampled from the inference engine of ``--rl-engine`` (``bf16`` by default:
   ``distmoe.rl.engines.InferenceEngine``, a view over the policy's own weights, no second copy), rewards, group
   advantages, the no-grad recompute of ``log pi_old``, the GRPO loss with IcePop's mismatch weights
   (``distmoe.rl``) and an optimizer step;
3. the 4-bit path: the expert stacks stored as NF4 (``distmoe.model.expert_quant``, ``model.quantize-experts =
   "nf4"``), then routed expert LoRA steps that dequantise the routed experts only: the base's bytes before and
   after, tokens/s and peak memory (needs bitsandbytes, the ``quant-experts`` extra).

    python bench/device_check.py                        # cuda when there is one; Qwen3-30B-A3B shape, bf16
    python bench/device_check.py --tiny --device cpu    # the same code at a tiny shape (the test suite runs this)
    python bench/device_check.py --layers 8             # the real widths, fewer layers (a smaller device)

Budget on one H100 (80 GB): the bf16 base is 61 GB; with gradient checkpointing a step of 4 x 256 tokens (the
default) keeps one layer's activations plus the residual stream of each layer; ``distmoe plan --model
qwen3-30b-a3b --device h100 --batch 4 --seq 256 --dtype bfloat16 --gradient-checkpointing`` predicts the peak.
Nothing here was run on an accelerator when it was written: the CPU run checks the code path, not the figures.
The table it prints goes into ``docs/results.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import expert_lora as xl  # noqa: E402  (switching a routed-built model between arms)

QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
TINY = dict(vocab_size=512, hidden_size=64, moe_intermediate_size=32, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True)
GB = 1e9


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def hf_config(shape: dict):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**shape, tie_word_embeddings=False, max_position_embeddings=4096, decoder_sparse_step=1,
                          mlp_only_layers=[], router_aux_loss_coef=0.0, pad_token_id=0, bos_token_id=1,
                          eos_token_id=2, use_cache=True, attention_dropout=0.0)


@torch.no_grad()
def build_on_device(shape: dict, device: torch.device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """The model built on ``meta``, storage allocated on ``device`` (``to_empty``), weights drawn there: norms 1,
    biases 0, matrices N(0, 0.02), routers N(0, 0.5) (distinct routing, as a trained model has); the rotary
    buffers (computed at construction, so meta here) recomputed."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(1.0) if "norm" in name else p.zero_()
        else:
            p.normal_(0.0, 0.5 if ".gate." in name else 0.02, generator=gen)
    for mod in model.modules():
        if "inv_freq" in getattr(mod, "_buffers", {}):
            fresh = type(mod)(mod.config)  # on the CPU, real values
            for key in ("inv_freq", "original_inv_freq"):
                if key in mod._buffers:
                    mod._buffers[key] = fresh._buffers[key].to(device)
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    return model.eval()


def word_tokenizer(vocab: int):
    """A word-level tokenizer over ``vocab`` ids (``w<i>``) with pad 0, bos 1, eos 2: what rollouts decode with."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    words = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(vocab - len(specials))])}
    core = Tokenizer(WordLevel(words, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>")


def make_batch(batch: int, seq: int, vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (batch, seq), generator=g)  # [B, S]
    labels = ids.clone()
    labels[:, : seq // 3] = -100  # the prompt third is not supervised
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
            "labels": labels.to(device)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None


def lora_steps(model, batch: dict, device: torch.device, steps: int, warmup: int) -> dict:
    """Routed expert LoRA against attention-only LoRA, interleaved, gradient checkpointing on: median step time,
    tokens/s and (on CUDA) the peak memory of each arm."""
    from distmoe.model.device import autocast_for

    arms = ("routed", "attention")
    opts = {}
    for arm in arms:
        params = xl.switch(model, arm)
        opts[arm] = (params, torch.optim.AdamW(params, lr=1e-4))
    times: dict[str, list[float]] = {a: [] for a in arms}
    peaks: dict[str, float] = {}
    model.train()
    for i in range(warmup + steps):
        for arm in (arms if i % 2 == 0 else arms[::-1]):
            params, opt = opts[arm]
            xl.switch(model, arm)
            _sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t = time.perf_counter()
            with autocast_for(model):
                xl.plain_step(model, params, opt, batch)
            _sync(device)
            if i >= warmup:
                times[arm].append(time.perf_counter() - t)
            peak = _peak(device)
            if peak is not None:
                peaks[arm] = max(peaks.get(arm, 0.0), peak)
        say(f"  LoRA step {i + 1}/{warmup + steps}" + (" (warm-up)" if i < warmup else ""))
    tokens = int(batch["attention_mask"].sum())
    out: dict = {"tokens": tokens}
    for arm in arms:
        med = statistics.median(times[arm])
        out[arm] = {"step_s": med, "tok_s": tokens / med, "peak_gb": peaks.get(arm)}
    out["ratio"] = out["routed"]["step_s"] / out["attention"]["step_s"]
    out["ratio_pairs"] = statistics.median(a / b for a, b in zip(times["routed"], times["attention"], strict=True))
    return out


def rl_step(model, tok, device: torch.device, prompts: int, group: int, new_tokens: int, prompt_len: int,
            engine: str = "bf16") -> dict:
    """One GRPO step on rollouts sampled from an inference engine of profile ``engine`` (a view over the policy's
    weights): generate, reward, advantages, ``log pi_old`` (no grad), the clipped surrogate with IcePop's mismatch
    weights, backward, AdamW."""
    from distmoe.rl.advantages import group_advantages
    from distmoe.rl.engines import InferenceEngine
    from distmoe.rl.losses import grpo_loss, mismatch_weights
    from distmoe.rl.rollout import generate_rollouts, train_logprobs

    params = xl.switch(model, "routed")
    opt = torch.optim.AdamW(params, lr=1e-6)
    g = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    prompt_ids = [torch.randint(4, vocab, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t = time.perf_counter()
    eng = InferenceEngine(model, engine)
    ro = generate_rollouts(eng, tok, prompt_ids, group, new_tokens, temperature=1.0, seed=0)
    del eng
    _sync(device)
    gen_s = time.perf_counter() - t
    # a reward the policy can move: the share of even token ids in the response
    rewards = ((ro.response % 2 == 0) & ro.response_mask).float().sum(-1) / ro.response_mask.sum(-1).clamp(min=1)
    adv = group_advantages(rewards.cpu(), group).to(device)  # [N]
    model.train()
    t = time.perf_counter()
    logp_old = train_logprobs(model, ro)  # [N, T], no grad
    logp_new = train_logprobs(model, ro, grad=True)  # [N, T]
    weights, _ = mismatch_weights(logp_old, ro.logp_infer, ro.response_mask, "token", "mask", 0.5, 5.0)  # [N, T]
    loss, _ = grpo_loss(logp_new, logp_old, adv, ro.response_mask, weights)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    _sync(device)
    train_s = time.perf_counter() - t
    model.eval()
    gen_tokens = int(ro.response_mask.sum())
    return {"engine": engine, "rollouts": ro.num_rollouts, "generated_tokens": gen_tokens, "generate_s": gen_s,
            "generate_tok_s": gen_tokens / gen_s, "update_s": train_s, "loss": float(loss.detach()),
            "finite": math.isfinite(float(loss.detach())), "peak_gb": _peak(device)}


def nf4_steps(model, batch: dict, device: torch.device, steps: int) -> dict:
    """Quantise the expert stacks to NF4 in place, then ``steps`` routed expert LoRA steps (gradient checkpointing
    on): the base's bytes before and after, the median step time, tokens/s and (on CUDA) the peak memory."""
    from distmoe.model.device import autocast_for
    from distmoe.model.expert_quant import quantize_experts

    def held() -> float:
        return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())) / GB

    before = held()
    params = xl.switch(model, "routed")
    quantized = quantize_experts(model)
    after = held()
    opt = torch.optim.AdamW(params, lr=1e-4)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model.train()
    times = []
    for _ in range(max(steps, 1)):
        _sync(device)
        t = time.perf_counter()
        with autocast_for(model):
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        labels=batch["labels"], use_cache=False)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        loss = float(out.loss.detach())
        _sync(device)
        times.append(time.perf_counter() - t)
    model.eval()
    med = statistics.median(times)
    tokens = int(batch["attention_mask"].sum())
    return {"stacks": quantized, "held_gb_before": before, "held_gb_after": after, "step_s": med,
            "tok_s": tokens / med, "peak_gb": _peak(device),
            "loss": loss, "finite": math.isfinite(loss)}


def run(args) -> dict:
    from distmoe.config import parse_run_config
    from distmoe.model.base import keep_trainable_fp32
    from distmoe.model.trainable import apply_trainable
    from distmoe.train.sft import set_checkpointing

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    shape = dict(TINY if args.tiny else QWEN3_30B_A3B)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    t0 = time.perf_counter()
    model = build_on_device(shape, device, dtype)
    n = sum(p.numel() for p in model.parameters())
    base_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / GB
    _sync(device)
    say(f"built {n / 1e9:.2f}B parameters ({base_gb:.1f} GB, {dtype}) on {device} in {time.perf_counter() - t0:.0f} s")
    cfg = parse_run_config({"model.trainable": "lora"}).model  # the party's LoRA settings (r, alpha, targets)
    model = apply_trainable(model, cfg)
    keep_trainable_fp32(model)  # trainable tensors in float32 (master weights), as a party keeps them
    set_checkpointing(model, True)
    batch = make_batch(args.batch, args.seq, shape["vocab_size"], device)
    res: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "dtype": str(dtype).removeprefix("torch."), "parameters": n, "base_gb": base_gb,
                 "shape": "tiny" if args.tiny else f"qwen3-30b-a3b ({shape['num_hidden_layers']} layers)",
                 "batch": args.batch, "seq": args.seq, "load1": os.getloadavg()[0]}
    res["lora"] = lora_steps(model, batch, device, args.steps, args.warmup)
    say(f"LoRA: routed {res['lora']['routed']['tok_s']:.0f} tok/s, attention-only "
        f"{res['lora']['attention']['tok_s']:.0f} tok/s, ratio {res['lora']['ratio']:.3f}")
    res["rl"] = rl_step(model, word_tokenizer(shape["vocab_size"]), device, args.rl_prompts, args.rl_group,
                        args.rl_new_tokens, args.rl_prompt_len, args.rl_engine)
    say(f"RL step: {res['rl']['generated_tokens']} tokens generated at {res['rl']['generate_tok_s']:.0f} tok/s, "
        f"update {res['rl']['update_s']:.1f} s")
    res["nf4"] = nf4_steps(model, batch, device, args.steps)
    say(f"4-bit experts: {res['nf4']['stacks']} expert weights in NF4, held {res['nf4']['held_gb_before']:.2f} -> "
        f"{res['nf4']['held_gb_after']:.2f} GB, {res['nf4']['tok_s']:.0f} tok/s")
    res["wall_s"] = time.perf_counter() - t0
    return res


def print_table(r: dict) -> None:
    def gb(x):
        return "n/a (CPU)" if x is None else f"{x:.1f} GB"

    lo, rl = r["lora"], r["rl"]
    print(f"\n{r['shape']}, {r['parameters'] / 1e9:.2f}B parameters, {r['dtype']} base {r['base_gb']:.1f} GB on "
          f"{r['device']}; batch {r['batch']} x {r['seq']}; gradient checkpointing on; load {r['load1']:.1f}\n")
    print("| step | median s | tokens/s | peak memory | / attention-only step |")
    print("|---|---|---|---|---|")
    print(f"| LoRA, experts routed (distmoe) | {lo['routed']['step_s']:.2f} | {lo['routed']['tok_s']:.0f} | "
          f"{gb(lo['routed']['peak_gb'])} | {lo['ratio']:.3f} (pairs {lo['ratio_pairs']:.3f}) |")
    print(f"| LoRA, attention only (plain peft) | {lo['attention']['step_s']:.2f} | {lo['attention']['tok_s']:.0f} | "
          f"{gb(lo['attention']['peak_gb'])} | 1 |")
    print(f"| RL: generate {rl['rollouts']} rollouts ({rl['engine']} engine, a view) | {rl['generate_s']:.2f} | "
          f"{rl['generate_tok_s']:.0f} | {gb(rl['peak_gb'])} | |")
    print(f"| RL: GRPO update | {rl['update_s']:.2f} | | | |")
    q = r["nf4"]
    print(f"| LoRA with NF4 experts ({q['held_gb_before']:.1f} -> {q['held_gb_after']:.1f} GB held) | "
          f"{q['step_s']:.2f} | {q['tok_s']:.0f} | {gb(q['peak_gb'])} | |")
    print(f"\ntotal {r['wall_s']:.0f} s")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:N")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="the base's dtype (default bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (the CPU test)")
    ap.add_argument("--layers", type=int, default=0, help="override the layer count (0: the shape's own)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rl-engine", default="bf16", help="the rollouts' inference engine profile (rl.engine)")
    ap.add_argument("--rl-prompts", type=int, default=4)
    ap.add_argument("--rl-group", type=int, default=4)
    ap.add_argument("--rl-new-tokens", type=int, default=32)
    ap.add_argument("--rl-prompt-len", type=int, default=32)
    ap.add_argument("--out", default="", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    res = run(args)
    print_table(res)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    return res


if __name__ == "__main__":
    main()
