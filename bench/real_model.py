"""Benchmark: distmoe at a realistic model size. OLMoE- and Qwen3-MoE-shaped models of about 0.1B, 0.5B
and 1B parameters (random init, built locally from a ``transformers`` config, saved with
``save_pretrained`` next to a word-level tokenizer so that a party loads them as a checkpoint), LoRA
through distmoe's own path (``apply_trainable`` with ``model.trainable = "lora"``).

    python bench/real_model.py [--sizes 0.1b 0.5b 1b] [--families olmoe qwen3_moe] [--steps 3]
                               [--warmup 1] [--batch-size 4] [--seq-len 128] [--threads 2]
                               [--plain-arm peft|routed] [--rl-engines bf16 ...] [--rl-copy]
                               [--device cpu] [--out results.json]
    python bench/real_model.py --device cuda --shape qwen3-30b-a3b   # one GPU, bf16 (not run on CPU)

Per family and size:

(a) **plain step** (``--plain-arm``): ``model(input_ids, attention_mask, labels)`` (the model's own loss),
    ``loss.backward()``, ``clip_grad_norm_``, AdamW step, on the same LoRA model with its expert adapters run
    either by peft's own ``target_parameters`` forward (``peft``, the default: ``transformers`` + ``peft`` as a
    user would write it, every ``W + BA`` built; ``distmoe.model.expert_lora.install(model, routed=False)`` for
    that arm only) or by distmoe's routed expert LoRA (``routed``: then (b)/(a) is the cost of distmoe's loss
    terms alone). The tables name the arm;
(b) **distmoe's party step**: the body of ``distmoe.train.sft.train_sft``'s loop on the optimizer of
    ``distmoe.train.optim.build_optimizer``: ``sft_loss`` (router-logit capture, the task loss, the aux
    load-balance loss and the router-anchor KL, as a party trains with the defaults), the finite checks,
    ``clip_grad_norm_``, the optimizer and scheduler steps. Both on the same model and fixed batch,
    interleaved (alternating which goes first), medians after warm-up; ratio (b)/(a) of the median wall
    times, of the median process CPU times (``time.process_time``: less disturbed by other load on a shared
    machine) and the median of the per-iteration ratios (the two steps of one iteration ran back to back).
(c) **peak RSS** (``VmHWM``) of a subprocess that is one party (loads the checkpoint with ``build_model`` as
    a party does, ``apply_trainable``, one ``train_sft`` step on the same batch; the timing of (a) and (b)
    then runs in that process, after its peak RSS was read) and of a subprocess that is the server
    (``distmoe.model.adapters.server_model`` when it exists, otherwise today's ``coordinator.loop._build_model``
    path: ``build_model`` + ``apply_trainable`` + ``trainable_state``; the table says which), against a
    subprocess that only imports the same modules.
(d) **bytes per party per round** from the real encoders (``distmoe.wire.inspect.record_bytes`` of the
    codec's records): downlink = the ``SftInstruction`` (the trainable weights and the ``[L, E]`` anchor);
    uplink = the masked secure-aggregation input (``UpdateLayout.encode`` -> ``uint64`` vector in a
    ``MaskedReply``); and, for comparison, the plaintext ``ModelUpdate`` (float32 delta). The share keys
    and round start that ride along in secagg mode (a few hundred bytes per peer) are not included.
(e) **an RL round's peak RSS** (``--rl-engines``): per engine profile, a subprocess that loads the checkpoint as
    a party does and runs one GRPO step (``distmoe.rl.grpo.run_grpo``: rollouts from the inference engine, the
    recompute, the update; ``--rl-prompts`` x ``--rl-group`` rollouts of a prompt of ``seq-len / 2`` tokens plus
    ``seq-len / 2`` new tokens, so as many tokens as one SFT row each) with the engine as a view over the
    policy's weights (today's), and with ``--rl-copy`` also with the deep-copy engine (``share_weights=False``,
    the former path), against the SFT party's peak of (c).

With ``--device cuda`` the model is built directly on the GPU in the dtype of ``--dtype`` (bfloat16 by
default there), the RSS subprocesses are skipped and peak GPU memory and tokens per second are reported;
``--shape qwen3-30b-a3b`` uses the real Qwen3-30B-A3B dimensions (48 layers x 128 experts, top-8).

Timings on a shared machine are noisy: compare the ratios within one invocation. No timing is asserted.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

VOCAB = 32768  # one vocabulary for every scaled shape (the real ones: OLMoE 50304, Qwen3 151936)

# (family, size) -> the transformers config fields that differ from the family's defaults.
# OLMoE-1B-7B: hidden 2048, 16 layers, 16 heads, 64 experts of width 1024 (= hidden / 2), top-8, untied.
# Qwen3-30B-A3B: hidden 2048, 48 layers, 32 heads of 128 (4 kv), 128 experts of width 768 (= 0.375 hidden),
# top-8, normalised top-k, untied. Scaled: the hidden size and the layer count; experts, top-k and the width
# ratios kept.
SHAPES: dict[tuple[str, str], dict] = {
    ("olmoe", "0.1b"): dict(hidden_size=512, intermediate_size=256, num_hidden_layers=3, num_attention_heads=8),
    ("olmoe", "0.5b"): dict(hidden_size=1024, intermediate_size=512, num_hidden_layers=4, num_attention_heads=16),
    ("olmoe", "1b"): dict(hidden_size=1024, intermediate_size=512, num_hidden_layers=9, num_attention_heads=16),
    ("qwen3_moe", "0.1b"): dict(hidden_size=512, moe_intermediate_size=192, num_hidden_layers=2,
                                num_attention_heads=8, num_key_value_heads=1),
    ("qwen3_moe", "0.5b"): dict(hidden_size=1024, moe_intermediate_size=384, num_hidden_layers=3,
                                num_attention_heads=16, num_key_value_heads=2),
    ("qwen3_moe", "1b"): dict(hidden_size=1024, moe_intermediate_size=384, num_hidden_layers=6,
                              num_attention_heads=16, num_key_value_heads=2),
}
FULL_SHAPES = {"qwen3-30b-a3b": ("qwen3_moe", dict(
    vocab_size=151936, hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128))}
FAMILY_FIXED = {
    "olmoe": dict(num_experts=64, num_experts_per_tok=8, norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, head_dim=128,
                      decoder_sparse_step=1, mlp_only_layers=[]),
}
MB = 1e6


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def hf_config(family: str, fields: dict):
    """The ``transformers`` config of one shape (``vocab_size`` defaults to ``VOCAB``)."""
    from transformers import OlmoeConfig, Qwen3MoeConfig

    kw = {"vocab_size": VOCAB, "tie_word_embeddings": False, "max_position_embeddings": 4096,
          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "use_cache": False,
          **FAMILY_FIXED[family], **fields}
    if family == "olmoe":
        kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
        kw.pop("head_dim", None)
        return OlmoeConfig(**kw)
    kw.setdefault("intermediate_size", 3 * kw["hidden_size"])  # dense MLP width; unused (every layer is MoE)
    return Qwen3MoeConfig(**kw)


def shape_summary(cfg) -> str:
    e = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    width = getattr(cfg, "moe_intermediate_size", None) if cfg.model_type == "qwen3_moe" else cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return (f"h{cfg.hidden_size} L{cfg.num_hidden_layers} E{e} k{cfg.num_experts_per_tok} ffn{width} "
            f"heads {cfg.num_attention_heads}/{cfg.num_key_value_heads}x{hd} V{cfg.vocab_size}")


def save_checkpoint(family: str, fields: dict, path: Path) -> dict:
    """Random-init the model (float32, CPU) and write it with ``save_pretrained`` plus a word-level tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    cfg = hf_config(family, fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    del model
    gc.collect()
    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(cfg.vocab_size - len(specials))])}
    tk = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = WhitespaceSplit()
    from distmoe.model.fabricate import CHATML_TEMPLATE

    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                  unk_token="<unk>")
    tok.chat_template = CHATML_TEMPLATE  # a party refuses a tokenizer without one (docs/checkpoints.md)
    tok.save_pretrained(path)
    return {"parameters": n, "config": shape_summary(cfg)}


def make_batch(batch_size: int, seq_len: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A fixed batch: row r has ``seq_len - 8 r mod seq_len/4`` real tokens (right padding); the first
    third of each row is the prompt (labels -100), the rest is supervised."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (batch_size, seq_len), generator=g)  # [B, S]
    mask = torch.zeros(batch_size, seq_len, dtype=torch.long)  # [B, S]
    labels = torch.full((batch_size, seq_len), -100, dtype=torch.long)  # [B, S]
    for r in range(batch_size):
        n = seq_len - (8 * r) % max(seq_len // 4, 1)
        mask[r, :n] = 1
        labels[r, n // 3:n] = ids[r, n // 3:n]
        ids[r, n:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def encoded_rows(batch: dict[str, torch.Tensor]) -> list[tuple[list[int], list[int]]]:
    """The batch as the (input_ids, labels) pairs ``train_sft`` takes (collate rebuilds the same batch)."""
    out = []
    for r in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][r].sum())
        out.append((batch["input_ids"][r, :n].tolist(), batch["labels"][r, :n].tolist()))
    return out


def run_config(ckpt: str, **over):
    from distmoe.config import parse_run_config

    return parse_run_config({"model.path": ckpt, "model.trainable": "lora", **over})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------- (a) and (b): step time
def time_steps(model, batch: dict, cfg, steps: int, warmup: int, device: torch.device,
               plain_arm: str = "peft") -> dict:
    """Medians of the plain and the distmoe step, interleaved on one model and batch (``plain_arm``: the expert
    adapters of the plain step run by peft's own forward, ``peft``, or by distmoe's routed one, ``routed``)."""
    from distmoe.model import expert_lora
    from distmoe.model.build import describe
    from distmoe.train.optim import build_optimizer
    from distmoe.train.sft import sft_loss

    ms = describe(model)
    g = torch.Generator().manual_seed(1)
    anchor = torch.softmax(torch.randn(ms.num_moe_layers, ms.num_experts, generator=g), -1).to(device)  # [L, E]
    params = [p for p in model.parameters() if p.requires_grad]
    plain_opt = torch.optim.AdamW(params, lr=1e-4)
    opt, sched = build_optimizer(model, cfg.train)
    routing = cfg.routing
    model.train()

    def plain() -> None:
        if plain_arm == "peft":
            expert_lora.install(model, routed=False)  # peft's target_parameters forward for this arm only
        try:
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        labels=batch["labels"], use_cache=False)
            plain_opt.zero_grad(set_to_none=True)
            out.loss.backward()
        finally:
            expert_lora.install(model, routed=True)
        torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        plain_opt.step()

    def ours() -> None:  # train_sft's loop body
        loss, parts = sft_loss(model, batch, routing, ms.num_experts, ms.top_k, anchor)
        opt.zero_grad(set_to_none=True)
        if not math.isfinite(float(loss.detach())):
            return
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        if not torch.isfinite(grad_norm):
            opt.zero_grad(set_to_none=True)
            return
        opt.step()
        sched.step()

    arms = {"plain": plain, "distmoe": ours}
    times: dict[str, list[float]] = {k: [] for k in arms}
    cpu: dict[str, list[float]] = {k: [] for k in arms}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(warmup + steps):
        order = list(arms) if i % 2 == 0 else list(arms)[::-1]
        took = {}
        for name in order:
            _sync(device)
            t, c = time.perf_counter(), time.process_time()
            arms[name]()
            _sync(device)
            took[name] = time.perf_counter() - t
            if i >= warmup:
                times[name].append(took[name])
                cpu[name].append(time.process_time() - c)
        say(f"  step {i + 1}/{warmup + steps}{' (warm-up)' if i < warmup else ''}: plain {took['plain']:.2f} s, "
            f"distmoe {took['distmoe']:.2f} s")
    model.eval()
    plain_s, ours_s = statistics.median(times["plain"]), statistics.median(times["distmoe"])
    tokens = int(batch["attention_mask"].sum())
    plain_c, ours_c = statistics.median(cpu["plain"]), statistics.median(cpu["distmoe"])
    # the two steps of one iteration ran back to back, under about the same load: their ratio is steadier
    pair = statistics.median(o / p for o, p in zip(times["distmoe"], times["plain"], strict=True))
    res = {"plain_arm": plain_arm, "plain_s": plain_s, "distmoe_s": ours_s, "ratio": ours_s / plain_s, "tokens": tokens,
           "plain_cpu_s": plain_c, "distmoe_cpu_s": ours_c, "ratio_cpu": ours_c / plain_c, "ratio_pairs": pair,
           "plain_tok_s": tokens / plain_s, "distmoe_tok_s": tokens / ours_s, "times": times, "cpu_times": cpu}
    if device.type == "cuda":
        res["peak_gpu_mb"] = torch.cuda.max_memory_allocated(device) / MB
    return res


# ------------------------------------------------------------------------------------------ (d): bytes
def round_bytes(model, mspec, tspec, cfg) -> dict:
    from distmoe.model.trainable import trainable_state
    from distmoe.privacy import secagg as sa
    from distmoe.privacy.vectors import UpdateLayout
    from distmoe.wire import codec
    from distmoe.wire.inspect import record_bytes
    from distmoe.wire.schema import TRAIN_METRIC_KEYS, MaskedReply, ModelUpdate, SftInstruction

    weights = {k: v.cpu().numpy() for k, v in trainable_state(model).items()}
    anchor = np.full((mspec.num_moe_layers, mspec.num_experts), 1.0 / mspec.num_experts)  # [L, E]
    down = record_bytes(codec.encode(SftInstruction(round=1, task="lookup", weights=weights, base_hash="0" * 64,
                                                    seed=0, anchor=anchor, anchor_version=1)))
    rng = np.random.default_rng(0)
    delta = {k: (rng.standard_normal(v.shape) * 1e-3).astype(np.float32) for k, v in weights.items()}
    metrics = {k: 0.0 for k in TRAIN_METRIC_KEYS}
    p = cfg.privacy
    layout = UpdateLayout.build(tspec.shapes, 3, p.update_clip)
    y, _ = layout.encode(delta, 16)  # [length] uint64
    up = record_bytes(codec.encode(MaskedReply(release="model-update", masked=sa.MaskedInput(1, 1, y),
                                               late_keys=None)))
    plain_up = record_bytes(codec.encode(ModelUpdate(party="p0", delta=delta, num_examples=16, metrics=metrics)))
    return {"down_bytes": down, "up_secagg_bytes": up, "up_plain_bytes": plain_up, "update_length": layout.length,
            "trainable_numel": tspec.numel}


# ----------------------------------------------------------------------------- (c): RSS in subprocesses
def _peak_rss_mb() -> float:
    """This process's peak RSS: ``VmHWM`` (reset by ``exec``, unlike ``ru_maxrss``, which a child inherits
    from the parent it was forked from)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / MB  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB  # not Linux: KiB on most systems


def _rss_split_mb() -> dict[str, float]:
    """The current RSS split: anonymous memory (tensors the process owns) and file-backed pages (a mapped
    checkpoint, shared libraries), from ``/proc/self/status``."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("RssAnon", "RssFile"):
            out[key] = int(line.split()[1]) * 1024 / MB  # kB
    return out


def _role_main(args) -> None:
    """Subprocess entry: play ``--role`` and print one JSON line with the figures.

    ``party``: load the checkpoint as a party does, ``apply_trainable``, one ``train_sft`` step on the batch,
    then read the peak RSS (the party's figure); then, in the same process, the interleaved step timing and
    the bytes per round. ``server``: hold what the coordinator holds, then read the peak RSS."""
    torch.set_num_threads(args.threads)
    from distmoe.model.build import build_model, describe
    from distmoe.model.trainable import apply_trainable, spec_of, trainable_state
    from distmoe.train.sft import train_sft

    out: dict = {"role": args.role}
    if args.role == "party":
        cfg = run_config(args.ckpt, **{"train.local-steps": 1, "train.batch-size": args.batch_size,
                                       "model.quantize-experts": args.quantize_experts})
        t = time.perf_counter()
        model, tok = build_model(cfg.model)
        model = apply_trainable(model, cfg.model)
        out.update(load_s=time.perf_counter() - t, after_load_mb=_peak_rss_mb(), after_load=_rss_split_mb())
        ms = describe(model)
        anchor = torch.full((ms.num_moe_layers, ms.num_experts), 1.0 / ms.num_experts)  # [L, E]
        batch = make_batch(args.batch_size, args.seq_len, model.config.vocab_size)
        res = train_sft(model, encoded_rows(batch), tok.pad_token_id, cfg.train, cfg.routing, ms.num_experts,
                        ms.top_k, anchor, 0)
        out.update(party_steps=res.steps, peak_rss_mb=_peak_rss_mb())
        if args.steps > 0:
            say(f"  party: loaded in {out['load_s']:.0f} s, peak RSS {out['peak_rss_mb']:.0f} MB; timing "
                f"{args.warmup} + {args.steps} interleaved steps")
            tspec = spec_of(model, "lora")
            out["trainable_numel"] = tspec.numel
            out.update(time_steps(model, batch, cfg, args.steps, args.warmup, torch.device("cpu"), args.plain_arm))
            out.update(round_bytes(model, ms, tspec, cfg))
    elif args.role == "server":
        cfg = run_config(args.ckpt)
        try:
            from distmoe.model.adapters import server_model  # the server that never materialises the base
        except ImportError:
            server_model = None
        if server_model is not None:
            held = server_model(cfg.model)
            out["path"] = "server_model"
        else:  # today's coordinator.loop._build_model
            model, _ = build_model(cfg.model)
            model = apply_trainable(model, cfg.model)
            held = trainable_state(model)
            out["path"] = "build_model+apply_trainable"
        out.update(held=type(held).__name__, peak_rss_mb=_peak_rss_mb(), after_load=_rss_split_mb())
    elif args.role == "party-rl":
        out.update(_rl_main(args))
    print(json.dumps(out), flush=True)


def _rl_main(args) -> dict:
    """Subprocess body of (e): one GRPO step of a party with engine ``args.engine`` (a view, or with
    ``--engine-copy`` the deep copy), then the peak RSS."""
    import functools

    from distmoe.config import replace
    from distmoe.data.formats import Example
    from distmoe.model.build import build_model
    from distmoe.model.trainable import apply_trainable
    from distmoe.rl import engines, grpo

    cfg = run_config(args.ckpt, **{"model.quantize-experts": args.quantize_experts})
    model, tok = build_model(cfg.model)
    model = apply_trainable(model, cfg.model)
    after_load = _peak_rss_mb()
    half = max(args.seq_len // 2, 2)
    rl = replace(cfg.rl, prompts_per_step=args.rl_prompts, group_size=args.rl_group, max_new_tokens=half,
                 engine=args.engine, minibatches=min(cfg.rl.minibatches, args.rl_prompts * args.rl_group), steps=1)
    g = torch.Generator().manual_seed(0)
    words = [f"w{int(i)}" for i in torch.randint(0, model.config.vocab_size - 8, (args.rl_prompts * half,),
                                                generator=g)]
    prompts = [Example(messages=(("user", " ".join(words[i * half:(i + 1) * half][:half - 8])), ("assistant", "w1")))
               for i in range(args.rl_prompts)]  # about half a row of prompt after the chat template
    if args.engine_copy:  # the former engine: a deep copy of the policy with the profile applied to it
        grpo.InferenceEngine = functools.partial(engines.InferenceEngine, share_weights=False)
    t = time.perf_counter()
    res = grpo.run_grpo(model, tok, prompts, "lookup", rl, seed=0, max_prompt_len=args.seq_len)
    return {"engine": args.engine, "engine_copy": bool(args.engine_copy), "rl_s": time.perf_counter() - t,
            "after_load_mb": after_load, "peak_rss_mb": _peak_rss_mb(), "steps": len(res.steps),
            "response_len": res.steps[-1]["response_len"]}


def run_role(role: str, ckpt: str, args, *extra: str) -> dict:
    cmd = [sys.executable, __file__, "--role", role, "--ckpt", ckpt, "--threads", str(args.threads),
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--plain-arm", args.plain_arm, "--rl-prompts", str(args.rl_prompts),
           "--rl-group", str(args.rl_group), "--quantize-experts", args.quantize_experts, *extra]
    t = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "PYTHONPATH": _pythonpath()})
        last = ""
        for line in proc.stdout:  # progress lines as they come; the last line is the JSON result
            if line.startswith("{"):
                last = line
            else:
                print(line, end="", flush=True)
        if proc.wait() != 0 or not last:
            err.seek(0)
            raise RuntimeError(f"{role} subprocess failed:\n{err.read()[-3000:]}")
    res = json.loads(last)
    res["wall_s"] = time.perf_counter() - t
    return res


def baseline_rss(args) -> float:
    """Peak RSS of a process that only imports what the role subprocesses import."""
    code = ("import sys, torch, transformers, peft, distmoe.model.build, distmoe.model.trainable, distmoe.train.sft; "
            f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import real_model; "
            "print(real_model._peak_rss_mb())")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONPATH": _pythonpath()})
    return float(p.stdout.strip().splitlines()[-1])


def _pythonpath() -> str:
    root = str(Path(__file__).resolve().parent.parent)
    return os.pathsep.join([root] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x])


# ------------------------------------------------------------------------------------------------ cells
def cpu_cell(family: str, size: str, args, root: Path) -> dict:
    """Save the checkpoint here; one party process (RSS, then the timing and the bytes) and one server
    process (RSS) load it."""
    ckpt = root / f"{family}-{size}"
    t = time.perf_counter()
    say(f"{family} {size}: building and saving the checkpoint")
    info = save_checkpoint(family, SHAPES[(family, size)], ckpt)
    gc.collect()
    say(f"{family} {size}: {info['parameters'] / 1e9:.3f}B parameters ({info['config']}), saved in "
        f"{time.perf_counter() - t:.0f} s; party process")
    cell = {"family": family, "size": size, **info}
    party = run_role("party", str(ckpt), args)
    cell.update({k: v for k, v in party.items() if k not in ("role", "peak_rss_mb", "after_load_mb", "after_load")})
    cell.update(party_rss_mb=party["peak_rss_mb"], party_after_load_mb=party["after_load_mb"],
                party_after_load=party["after_load"])
    cell["rl"] = []
    for engine in args.rl_engines:
        for copy_arm in ([False, True] if args.rl_copy else [False]):
            say(f"{family} {size}: RL party process, engine {engine} ({'deep copy' if copy_arm else 'view'})")
            rl = run_role("party-rl", str(ckpt), args, "--engine", engine, *(["--engine-copy"] if copy_arm else []))
            cell["rl"].append({k: v for k, v in rl.items() if k != "role"})
            say(f"  RL peak RSS {rl['peak_rss_mb']:.0f} MB (SFT party {cell['party_rss_mb']:.0f} MB), "
                f"round {rl['rl_s']:.0f} s")
    say(f"{family} {size}: server process")
    server = run_role("server", str(ckpt), args)
    cell.update(server_rss_mb=server["peak_rss_mb"], server_path=server["path"],
                server_after_load=server["after_load"])
    shutil.rmtree(ckpt, ignore_errors=True)
    timing = (f"ratio wall {cell['ratio']:.3f} / CPU {cell['ratio_cpu']:.3f} / pairs {cell['ratio_pairs']:.3f} "
              f"(plain {cell['plain_s']:.2f} s, distmoe {cell['distmoe_s']:.2f} s); ") if "ratio" in cell else ""
    say(f"{family} {size}: {timing}party {cell['party_rss_mb']:.0f} MB, server {cell['server_rss_mb']:.0f} MB; "
        f"cell took {time.perf_counter() - t:.0f} s")
    return cell


def full_shape_cell(name: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    """The real-size shape on one accelerator: built in place on the device (no checkpoint, no RSS)."""
    from transformers import AutoModelForCausalLM

    from distmoe.model.build import describe
    from distmoe.model.trainable import apply_trainable, spec_of

    family, fields = FULL_SHAPES[name]
    hcfg = hf_config(family, fields)
    say(f"{name}: building {shape_summary(hcfg)} in {dtype} on {device}")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hcfg, dtype=dtype)
    model.eval()
    n = sum(p.numel() for p in model.parameters())
    cfg = run_config("", **{"train.batch-size": args.batch_size})
    model = apply_trainable(model, cfg.model)
    model.to(device)
    mspec = describe(model)
    tspec = spec_of(model, "lora")
    batch = {k: v.to(device) for k, v in make_batch(args.batch_size, args.seq_len, mspec.vocab_size).items()}
    cell = {"family": family, "size": name, "parameters": n, "config": shape_summary(hcfg), "dtype": str(dtype),
            "trainable_numel": tspec.numel}
    cell.update(time_steps(model, batch, cfg, args.steps, args.warmup, device))
    cell.update(round_bytes(model, mspec, tspec, cfg))
    return cell


# ---------------------------------------------------------------------------------------------- output
def print_tables(cells: list[dict], base_mb: float | None, args) -> None:
    print(f"\nbatch {args.batch_size} x {args.seq_len}, {args.threads} torch threads, {args.warmup} warm-up + "
          f"{args.steps} timed steps per arm (medians)\n")
    arm = "plain peft (target_parameters)" if args.plain_arm == "peft" else "plain (routed expert LoRA)"
    print(f"| family | size | shape | parameters | LoRA trainable | {arm} s | distmoe s | ratio (wall) |"
          " plain CPU s | distmoe CPU s | ratio (CPU) | ratio (pairs) | plain tok/s | distmoe tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in (c for c in cells if "plain_s" in c):
        print(f"| {c['family']} | {c['size']} | {c['config']} | {c['parameters'] / 1e6:.0f}M | "
              f"{c['trainable_numel'] / 1e6:.2f}M | {c['plain_s']:.2f} | {c['distmoe_s']:.2f} | "
              f"{c['ratio']:.3f} | {c['plain_cpu_s']:.2f} | {c['distmoe_cpu_s']:.2f} | {c['ratio_cpu']:.3f} | "
              f"{c['ratio_pairs']:.3f} | {c['plain_tok_s']:.0f} | {c['distmoe_tok_s']:.0f} |")
    if base_mb is not None:
        print(f"\nbaseline RSS (python + torch + transformers + peft + distmoe imported): {base_mb:.0f} MB\n")
        print("| family | size | parameters | float32 weights | party peak RSS | party after load: anon + file | "
              "server peak RSS | server after load: anon + file | server path |")
        print("|---|---|---|---|---|---|---|---|---|")
        for c in cells:
            if "party_rss_mb" in c:
                pa, sv = c["party_after_load"], c["server_after_load"]
                print(f"| {c['family']} | {c['size']} | {c['parameters'] / 1e6:.0f}M | "
                      f"{c['parameters'] * 4 / MB:.0f} MB | {c['party_rss_mb']:.0f} MB | "
                      f"{pa['RssAnon']:.0f} + {pa['RssFile']:.0f} MB | {c['server_rss_mb']:.0f} MB | "
                      f"{sv['RssAnon']:.0f} + {sv['RssFile']:.0f} MB | {c['server_path']} |")
    if any("peak_gpu_mb" in c for c in cells):
        print("\n| shape | dtype | peak GPU memory |\n|---|---|---|")
        for c in cells:
            print(f"| {c['size']} | {c['dtype']} | {c['peak_gpu_mb'] / 1e3:.1f} GB |")
    if any(c.get("rl") for c in cells):
        print("\n| family | size | engine | RL round peak RSS | SFT step peak RSS | RL / SFT | over the imports: "
              "RL / SFT | rollouts |\n|---|---|---|---|---|---|---|---|")
        for c in cells:
            for r in c.get("rl", []):
                over = (f"{(r['peak_rss_mb'] - base_mb) / (c['party_rss_mb'] - base_mb):.3f}"
                        if base_mb is not None else "-")
                print(f"| {c['family']} | {c['size']} | {r['engine']} ({'deep copy' if r['engine_copy'] else 'view'})"
                      f" | {r['peak_rss_mb']:.0f} MB | {c['party_rss_mb']:.0f} MB | "
                      f"{r['peak_rss_mb'] / c['party_rss_mb']:.3f} | {over} | {args.rl_prompts} x {args.rl_group} "
                      f"of {args.seq_len} tokens |")
    print("\n| family | size | update length | downlink (SftInstruction) | uplink secagg (uint64) | "
          "uplink plaintext (float32) |")
    print("|---|---|---|---|---|---|")
    for c in (c for c in cells if "update_length" in c):
        print(f"| {c['family']} | {c['size']} | {c['update_length']:,} | {c['down_bytes'] / MB:.2f} MB | "
              f"{c['up_secagg_bytes'] / MB:.2f} MB | {c['up_plain_bytes'] / MB:.2f} MB |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["0.1b", "0.5b", "1b"], choices=["0.1b", "0.5b", "1b"])
    ap.add_argument("--families", nargs="+", default=["olmoe", "qwen3_moe"], choices=["olmoe", "qwen3_moe"])
    ap.add_argument("--shape", choices=sorted(FULL_SHAPES), default=None,
                    help="a real-size shape instead of --sizes/--families (meant for --device cuda)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per arm")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="--shape only (default bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--plain-arm", choices=["peft", "routed"], default="peft",
                    help="how the plain step runs the expert adapters: peft's target_parameters forward (as a user "
                         "would write it) or distmoe's routed expert LoRA (isolates distmoe's loss terms)")
    ap.add_argument("--rl-engines", nargs="*", default=[], help="(e): an RL party process per engine profile")
    ap.add_argument("--rl-copy", action="store_true", help="(e): also the deep-copy engine (the former path)")
    ap.add_argument("--quantize-experts", choices=["none", "nf4"], default="none",
                    help="the parties' model.quantize-experts (4-bit expert stacks)")
    ap.add_argument("--rl-prompts", type=int, default=2)
    ap.add_argument("--rl-group", type=int, default=2)
    ap.add_argument("--out", default="", help="write every figure as JSON here")
    ap.add_argument("--role", choices=["party", "server", "party-rl"], help=argparse.SUPPRESS)
    ap.add_argument("--engine", default="bf16", help=argparse.SUPPRESS)
    ap.add_argument("--engine-copy", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        _role_main(args)
        return
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    t0 = time.perf_counter()
    cells: list[dict] = []
    base = None
    if args.shape:
        dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
        cells.append(full_shape_cell(args.shape, args, device, dtype))
    else:
        if device.type != "cpu":
            raise SystemExit("the scaled sizes run on CPU; use --shape with --device cuda")
        base = baseline_rss(args)
        with tempfile.TemporaryDirectory(prefix="distmoe-real-") as tmp:
            for size in args.sizes:
                for family in args.families:
                    cells.append(cpu_cell(family, size, args, Path(tmp)))
    wall = time.perf_counter() - t0
    print_tables(cells, base, args)
    print(f"\ntotal {wall:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "baseline_rss_mb": base, "wall_s": wall,
                                              "cells": cells}, indent=1, default=str))


if __name__ == "__main__":
    main()
