"""Memory plan: the predicted peak memory of a party's ``sft``, ``rl`` and ``stats`` rounds and of the server, for
a checkpoint (its ``config.json``) or a named public shape, and the settings that fit a given device.

The architecture is built on the ``meta`` device from its config (no weight is read) and wrapped with the
party's own ``peft`` LoRA config, so the base's and the adapters' parameter counts are exact. The peak is a sum
of terms, each a count of bytes (``N`` tokens of a forward, ``S = N k`` routed (token, expert) pairs, ``c`` the
compute dtype's bytes, ``H`` hidden, ``I`` expert width, ``E`` experts, ``q``/``kv`` the query and key/value
widths, ``V`` the vocabulary, ``L`` layers)::

    base        parameters x dtype bytes (the frozen base, on the device); with 4-bit experts
                (``model.quantize-experts = "nf4"``) each expert weight costs 0.5 + 4/64 bytes instead
    adapters    trainable x 16 (float32 master weights, gradient, AdamW's two moments)
    attention   N (4H + 4q + 4kv) c                      saved for the backward, per layer
    moe         3NHc + 8NE + S (3H + 6I) c               (norm and router input; router logits and softmax in
                                                          float32; each pair's routed row, gate/up, activation,
                                                          product and down projection) [+ N (2H + 6 I_shared) c]
    logits      N V (c + 12)                             (the logits, their float32 copy, log-softmax, gradient)
    activations L (attention + moe) + logits; with gradient checkpointing L N H c + one layer + logits
    load (CPU)  base: the checkpoint's pages mapped while it is loaded (measured: they stay resident; with 4-bit
                experts too, which are quantised while the checkpoint is read), plus the imports (0.4 GB)

``sft`` = base + adapters + activations(micro-batch x seq) + load; ``rl`` = base + adapters + activations of one
minibatch of rollouts + the KV cache of generation + what the inference engine holds (``engine_bytes``: a view
over the policy's weights holds one unit's cast or fake-quantised tensors while it runs and, for
``int8-dynamic``, the int8 weights of the linears; the former deep copy held a whole base); ``stats`` = base + a
forward without a graph (one layer + logits) + load; the server in ``lora`` mode holds the adapters only: the
imports (0.4 GB measured) plus 24 bytes per adapter value (the global and the average in float32, the unmasked sum
in uint64). ``bench/expert_lora.py`` and ``bench/real_model.py`` measure the party terms on the CPU;
``docs/checkpoints.md`` has the comparison and the table of public checkpoints.

Owns: ``SHAPES`` (public checkpoints' configs), ``architecture``, ``engine_bytes``, ``predict``, ``fit`` and the
``distmoe plan`` subcommand. Must not: load weights, download anything, or decide what trains (``trainable.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from distmoe.config import parse_run_config

GB = 1e9
IMPORTS_GB = 0.4  # python + torch + transformers + peft + distmoe (measured, docs/checkpoints.md)

# config.json fields of public checkpoints (family, fields); the plan needs the shape only
SHAPES: dict[str, tuple[str, dict]] = {
    "qwen3-30b-a3b": ("qwen3_moe", dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                                        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                                        num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
                                        tie_word_embeddings=False)),
    "qwen3-235b-a22b": ("qwen3_moe", dict(vocab_size=151936, hidden_size=4096, num_hidden_layers=94,
                                          num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536,
                                          intermediate_size=12288, tie_word_embeddings=False)),
    "gpt-oss-20b": ("gpt_oss", dict(vocab_size=201088, hidden_size=2880, num_hidden_layers=24,
                                    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                                    num_experts_per_tok=4, intermediate_size=2880, sliding_window=128,
                                    tie_word_embeddings=False)),
    "olmoe-1b-7b": ("olmoe", dict(vocab_size=50304, hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                                  num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                                  intermediate_size=1024, tie_word_embeddings=False)),
    "mixtral-8x7b": ("mixtral", dict(vocab_size=32000, hidden_size=4096, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                                     num_experts_per_tok=2, intermediate_size=14336, tie_word_embeddings=False)),
    "moonlight-16b-a3b": ("deepseek_v3", dict(vocab_size=163840, hidden_size=2048, num_hidden_layers=27,
                                              n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
                                              n_shared_experts=2, first_k_dense_replace=1, intermediate_size=11264,
                                              num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
                                              kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                              v_head_dim=128, n_group=1, topk_group=1, routed_scaling_factor=2.446,
                                              num_nextn_predict_layers=0, tie_word_embeddings=False)),
}
DEVICES_GB = {"h200": 141.0, "h100": 80.0, "a100": 80.0, "a100-40": 40.0, "l40s": 48.0, "a6000": 48.0,
              "4090": 24.0, "l4": 24.0}


class PlanError(ValueError):
    """The model or the device cannot be planned (unknown shape, refused family, bad device)."""


@dataclass(frozen=True)
class Arch:
    """What the plan needs of an architecture (counts exact, from the meta-device model)."""

    name: str
    family: str
    params: int
    trainable: int  # LoRA values of model.trainable = "lora"
    layers: int
    moe_layers: int
    hidden: int
    q_width: int
    kv_width: int
    experts: int
    top_k: int
    expert_width: int
    shared_width: int  # always-on (shared) expert width per MoE layer, 0 if none
    dense_width: int  # MLP width of the dense (non-MoE) layers
    vocab: int


@dataclass(frozen=True)
class Settings:
    batch: int = 16  # sequences per forward (the micro-batch)
    seq: int = 128
    dtype_bytes: int = 4
    checkpointing: bool = False
    cpu: bool = True  # the checkpoint's pages count in the party's memory while loaded (CPU RSS)
    rollouts: int = 32  # rl: prompts_per_step x group_size
    minibatches: int = 2
    rl_len: int = 136  # prompt + new tokens
    engine: str = "bf16"  # rl.engine: the inference engine's profile
    engine_copy: bool = False  # the former deep-copy engine (a whole base more), for comparison
    nf4_experts: bool = False  # model.quantize-experts = "nf4": the expert stacks in 4 bits


def _hf_config(source: str):
    from transformers import AutoConfig

    if source in SHAPES:
        family, fields = SHAPES[source]
        return AutoConfig.for_model(family, **fields)
    path = Path(source)
    if not (path / "config.json").exists():
        raise PlanError(f"--model {source!r}: neither a checkpoint directory with config.json nor a known shape "
                        f"({', '.join(sorted(SHAPES))})")
    return AutoConfig.from_pretrained(path, local_files_only=True)


def architecture(source: str, lora_r: int = 8) -> Arch:
    """The ``Arch`` of a checkpoint directory or a ``SHAPES`` name (``PlanError`` for a refused family)."""
    import torch  # (here, not at the top: ``distmoe --help`` stays light)
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from distmoe.model.build import ModelError, check_family, router_modules
    from distmoe.model.trainable import lora_config

    hf = _hf_config(source)
    try:
        check_family(hf)
    except ModelError as exc:
        raise PlanError(f"{source}: {exc}") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    params = sum(p.numel() for p in model.parameters())
    cfg = parse_run_config({"model.trainable": "lora", "model.lora-r": lora_r}).model
    peft = get_peft_model(model, lora_config(cfg, model))
    trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    hd = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    experts = int(getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None)
                  or hf.n_routed_experts)
    width = int(getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size)
    shared = int(getattr(hf, "shared_expert_intermediate_size", 0) or 0)
    if getattr(hf, "n_shared_experts", None):
        shared = int(hf.n_shared_experts) * width
    return Arch(name=source, family=hf.model_type, params=params, trainable=trainable,
                layers=int(hf.num_hidden_layers), moe_layers=len(router_modules(model)), hidden=int(hf.hidden_size),
                q_width=int(hf.num_attention_heads) * hd, kv_width=int(hf.num_key_value_heads) * hd,
                experts=experts, top_k=int(hf.num_experts_per_tok), expert_width=width, shared_width=shared,
                dense_width=int(getattr(hf, "intermediate_size", width)), vocab=int(hf.vocab_size))


def _layer_bytes(a: Arch, n: int, c: int) -> tuple[float, float]:
    """(MoE layer, dense layer) activations saved for the backward at ``n`` tokens, compute dtype ``c`` bytes."""
    h = a.hidden
    attn = n * (4 * h + 4 * a.q_width + 4 * a.kv_width) * c
    s = n * a.top_k
    moe = n * 3 * h * c + n * a.experts * 8 + s * (3 * h + 6 * a.expert_width) * c
    moe += n * (2 * h + 6 * a.shared_width) * c if a.shared_width else 0
    dense = n * (3 * h + 6 * a.dense_width) * c
    return attn + moe, attn + dense


def activations(a: Arch, n: int, c: int, checkpointing: bool, grad: bool = True) -> float:
    moe, dense = _layer_bytes(a, n, c)
    logits = n * a.vocab * ((c + 12) if grad else (c + 4))
    if not grad:
        return max(moe, dense) / 2 + logits
    if checkpointing:
        return a.layers * n * a.hidden * c + max(moe, dense) + logits
    return a.moe_layers * moe + (a.layers - a.moe_layers) * dense + logits


def engine_bytes(a: Arch, s: Settings) -> float:
    """What the RL inference engine holds beyond the policy (``distmoe.rl.engine_view``): a deep copy holds the
    base; a view, while a unit runs, that unit's transformed tensors (``bf16`` over a base above bf16: the largest
    of a layer and the LM head cast to 2 bytes; ``int8-weight-only``: one layer's expert stacks fake-quantised,
    the copy and a temporary), and with ``int8-dynamic`` the int8 weights of every linear outside the experts."""
    if s.engine_copy:
        return float(a.params * s.dtype_bytes)
    parts = set(s.engine.split("+"))
    stacks = a.experts * 3 * a.hidden * a.expert_width  # one MoE layer's expert parameters
    layer = max(a.params - 2 * a.vocab * a.hidden, 0) / max(a.layers, 1)
    out = 0.0
    if "bf16" in parts and s.dtype_bytes > 2:
        out += max(layer, a.vocab * a.hidden) * 2
    if "int8-weight-only" in parts:
        out += 2 * stacks * s.dtype_bytes
    if "int8-dynamic" in parts:
        out += max(a.params - a.moe_layers * stacks - a.vocab * a.hidden, 0)
    return out


def predict(a: Arch, s: Settings) -> dict[str, float]:
    """Predicted peak bytes: the party's ``sft``, ``rl`` and ``stats`` rounds and the ``server`` (module doc)."""
    c = min(s.dtype_bytes, 4)
    base = float(a.params * s.dtype_bytes)
    if s.nf4_experts:  # NF4: half a byte per expert weight plus a float32 absmax per block of 64
        experts = a.moe_layers * a.experts * 3 * a.hidden * a.expert_width
        base -= experts * (s.dtype_bytes - (0.5 + 4 / 64))
    adapters = a.trainable * 16
    load = a.params * s.dtype_bytes if s.cpu else 0  # the checkpoint's pages, mapped while it is read
    load += IMPORTS_GB * GB if s.cpu else 0  # on the CPU the party process holds its imports too
    sft = base + adapters + activations(a, s.batch * s.seq, c, s.checkpointing) + load
    mb = max(1, s.rollouts // s.minibatches)
    kv = 2 * a.layers * a.kv_width * s.rollouts * s.rl_len * c
    rl = base + adapters + max(activations(a, mb * s.rl_len, c, s.checkpointing), kv) + load
    rl += engine_bytes(a, s)
    stats = base + activations(a, s.batch * s.seq, c, False, grad=False) + load
    server = IMPORTS_GB * GB + a.trainable * 24
    return {"base": base, "adapters": adapters, "sft": sft, "rl": rl, "stats": stats, "server": server}


def fit(a: Arch, s: Settings, device_gb: float, headroom: float = 0.9,
        rounds: tuple[str, ...] = ("sft", "rl")) -> tuple[Settings, dict] | None:
    """The first settings (bf16 before float32, checkpointing off before on, the largest micro-batch) whose peaks
    of ``rounds`` fit ``headroom x device_gb``; None if none does (the base alone may be too large)."""
    for dtype in (2, 4) if s.dtype_bytes == 4 else (s.dtype_bytes,):
        for ckpt in (False, True):
            mb = s.batch
            while mb >= 1:
                t = replace(s, dtype_bytes=dtype, checkpointing=ckpt, batch=mb)
                p = predict(a, t)
                if max(p[r] for r in rounds) <= headroom * device_gb * GB:
                    return t, p
                mb //= 2
    return None


def _device_gb(device: str) -> float | None:
    d = device.lower().removesuffix("gb")
    if d == "cpu":
        return None
    if d in DEVICES_GB:
        return DEVICES_GB[d]
    try:
        return float(d)
    except ValueError:
        raise PlanError(f"--device {device!r}: cpu, a GPU name ({', '.join(DEVICES_GB)}) or a memory size in GB "
                        "such as 24 or 80GB") from None


def table(rows: list[tuple[Arch | str, dict | None, str]]) -> str:
    out = ["| model | parameters | adapters | party sft | party rl | party stats | server | fits |",
           "|---|---|---|---|---|---|---|---|"]
    for arch, p, note in rows:
        if p is None:
            out.append(f"| {arch} | | | | | | | {note} |")
            continue
        out.append(f"| {arch.name} | {arch.params / 1e9:.1f}B | {arch.trainable / 1e6:.0f}M | {p['sft'] / GB:.1f} GB | "
                   f"{p['rl'] / GB:.1f} GB | {p['stats'] / GB:.1f} GB | {p['server'] / GB:.1f} GB | {note} |")
    return "\n".join(out)


def plan_text(source: str, device: str, s: Settings, lora_r: int = 8) -> str:
    """What ``distmoe plan`` prints for one model."""
    try:
        a = architecture(source, lora_r)
    except PlanError as exc:
        return f"{source}: refused: {exc}"
    gb = _device_gb(device)
    s = replace(s, cpu=gb is None)
    p = predict(a, s)
    lines = [f"{a.name}: {a.family}, {a.params / 1e9:.2f}B parameters ({a.layers} layers, {a.moe_layers} MoE, "
             f"{a.experts} experts, top-{a.top_k}), {a.trainable / 1e6:.1f}M LoRA values (r={lora_r})",
             f"settings: micro-batch {s.batch} x {s.seq}, base {'bf16' if s.dtype_bytes == 2 else 'float32'}, "
             f"gradient checkpointing {'on' if s.checkpointing else 'off'}, on {device}", "",
             table([(a, p, "")])]
    if gb is not None:
        found, only = fit(a, s, gb), ""
        if found is None and fit(a, s, gb, rounds=("sft",)) is not None:
            found, only = fit(a, s, gb, rounds=("sft",)), "sft "
        if found is None:
            need = predict(a, replace(s, dtype_bytes=2, checkpointing=True, batch=1))
            lines.append(f"\ndoes not fit one {gb:.0f} GB device even at bf16, checkpointing and micro-batch 1 "
                         f"(sft {need['sft'] / GB:.0f} GB): needs {-(-need['sft'] // (0.9 * gb * GB)):.0f} such "
                         "devices with the base sharded across them (distmoe runs a party on one device today), "
                         "or a 4-bit base")
        else:
            t, q = found
            dt = "bfloat16" if t.dtype_bytes == 2 else "float32"
            lines.append(f"\n{only}fits one {gb:.0f} GB device with: dtype = \"{dt}\", gradient-checkpointing = "
                         f"{str(t.checkpointing).lower()}, micro-batch-size = {t.batch} (sft {q['sft'] / GB:.1f} GB, "
                         f"rl {q['rl'] / GB:.1f} GB)")
            if only:
                lines.append(f"rl rounds do not fit ({q['rl'] / GB:.1f} GB): the policy, the generation cache or a "
                             f"minibatch's activations, and what the {s.engine} inference engine holds "
                             f"({engine_bytes(a, t) / GB:.1f} GB)")
    return "\n".join(lines)


def add_parser(sub) -> None:
    """``distmoe plan``: added to the CLI's subcommands."""
    p = sub.add_parser("plan", help="predict a party's and the server's peak memory, and the settings that fit a "
                       "device")
    p.add_argument("--model", required=True, metavar="PATH|SHAPE",
                   help=f"a checkpoint directory (config.json) or a shape: {', '.join(sorted(SHAPES))}")
    p.add_argument("--device", default="cpu", help="cpu, a GPU (h100, h200, a100, a100-40, l40s, 4090, l4) or GB")
    p.add_argument("--batch", type=int, default=0, help="sequences per forward (default: the run config's)")
    p.add_argument("--seq", type=int, default=0, help="tokens per sequence (default: model.max-seq-len)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="the base's dtype")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in the backward")
    p.add_argument("--nf4-experts", action="store_true", help="4-bit expert stacks (model.quantize-experts = nf4)")
    p.set_defaults(fn=cmd_plan)


def cmd_plan(args) -> int:
    cfg = parse_run_config({})
    t, rl = cfg.train, cfg.rl
    dtype = args.dtype or ("bfloat16" if args.device != "cpu" else t.dtype)
    s = Settings(batch=args.batch or t.micro_batch_size or t.batch_size, seq=args.seq or cfg.model.max_seq_len,
                 dtype_bytes=2 if dtype == "bfloat16" else 4, checkpointing=args.gradient_checkpointing,
                 rollouts=rl.prompts_per_step * rl.group_size, minibatches=rl.minibatches,
                 rl_len=cfg.model.max_seq_len + rl.max_new_tokens, engine=rl.engine, nf4_experts=args.nf4_experts)
    try:
        print(plan_text(args.model, args.device, s, cfg.model.lora_r))
    except PlanError as exc:
        print(f"error: {exc}")
        return 2
    return 0
