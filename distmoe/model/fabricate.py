"""Fabricated checkpoints: a small random-initialised model of any supported MoE family, saved the way a
real one is (``save_pretrained``, safetensors), with a real byte-level BPE tokenizer trained locally and a
Jinja chat template -- for tests, benchmarks and trying distmoe without downloading a model.

Owns: ``write_checkpoint`` (one directory that ``build_model(cfg.model, path)`` loads like any local
Hugging Face checkpoint), the small per-family configs (``FAMILY_SHAPES``; ``shape`` overrides any
config field), the built-in tokenizer corpus (which covers every character of distmoe's synthetic
tasks) and the tokenizer edge cases a real checkpoint may have: no pad token, no chat template, a
template that rejects the system role (raising, as Mistral's and Gemma's do).

Must not: download anything, read party data, or decide whether a family is supported (that is
``build.py``'s table; ``write_checkpoint`` refuses the families it refuses).
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

from distmoe.model.build import REFUSED_FAMILIES, SUPPORTED_FAMILIES, ModelError

BOS, EOS, PAD, UNK = "<|endoftext|>", "<|im_end|>", "<|pad|>", "<|unk|>"
IM_START = "<|im_start|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, UNK, IM_START)

# ChatML, as Qwen's checkpoints write it; an unknown role is an error
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
# the same turns, but a system message is refused the way Gemma's and Mistral's templates refuse it
NO_SYSTEM_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{ raise_exception('System role not supported') }}"
    "{%- elif message['role'] not in ['user', 'assistant'] -%}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

_COMMON = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16, max_position_embeddings=512, num_experts_per_tok=2,
               tie_word_embeddings=False, router_aux_loss_coef=0.0, attention_dropout=0.0, use_cache=True)
# per family: the transformers config class and its small shape (4 experts, top-2, 2 layers)
FAMILY_SHAPES: dict[str, tuple[str, dict]] = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(_COMMON, num_experts=4, moe_intermediate_size=32, norm_topk_prob=True,
                                         decoder_sparse_step=1, mlp_only_layers=[])),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_COMMON, num_experts=4, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=32, norm_topk_prob=False,
                                         decoder_sparse_step=1, mlp_only_layers=[])),
    "mixtral": ("MixtralConfig", dict(_COMMON, num_local_experts=4)),
    "olmoe": ("OlmoeConfig", dict(_COMMON, num_experts=4, norm_topk_prob=False)),
    "flex_olmo": ("FlexOlmoConfig", dict(_COMMON, num_experts=4, norm_topk_prob=False)),
    "gpt_oss": ("GptOssConfig", dict(_COMMON, num_local_experts=4, sliding_window=16,
                                     layer_types=["sliding_attention", "full_attention"],
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # the first layer dense (as DeepSeek-V2-Lite's), greedy top-k of the softmax, one shared expert
    "deepseek_v2": ("DeepseekV2Config", dict(_COMMON, n_routed_experts=4, n_shared_experts=1,
                                             moe_intermediate_size=32, first_k_dense_replace=1,
                                             topk_method="greedy", n_group=1, topk_group=1,
                                             routed_scaling_factor=1.0, num_key_value_heads=2,
                                             q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                                             qk_rope_head_dim=8, v_head_dim=16)),
    # DeepSeek-V3's router: sigmoid affinities + correction bias, 8 experts in 4 groups of which the top 2 are kept,
    # top-2, renormalised, times 2.5; the first layer dense, one shared expert; multi-head latent attention without
    # a query compression (as Moonlight-16B-A3B)
    "deepseek_v3": ("DeepseekV3Config", dict(_COMMON, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32,
                                             first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
                                             routed_scaling_factor=2.5, num_key_value_heads=2, q_lora_rank=None,
                                             kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
                                             head_dim=8, num_nextn_predict_layers=0)),
    # GLM-4.5's: the same router with one group (GLM-4.5's own n_group = 1), both layers MoE, QK-norm, half rotary
    "glm4_moe": ("Glm4MoeConfig", dict(_COMMON, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32,
                                       first_k_dense_replace=0, n_group=1, topk_group=1, norm_topk_prob=True,
                                       routed_scaling_factor=2.5, use_qk_norm=True, num_nextn_predict_layers=0,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.5})),
}


# the words of distmoe's synthetic tasks (``distmoe.data.synth``, a sideways package this layer must not
# import; tests/model/test_families.py checks the two agree) and a little English
_TASK_WORDS = ("Compute", "Calculate", "Evaluate", "Solve", "Reverse", "Uppercase", "Sort", "Capitalize",
               "Look up", "Code of", "What is", "Find", "Key", "code?", "Answer with the result only.",
               "What is the recovery phrase on file?", "canary-")
_ENGLISH = ("Answer the question. The answer is short. Give only the result, nothing else.",
            "Below is an instruction that describes a task, paired with an input that provides context.",
            "Write a response that appropriately completes the request.")


def corpus() -> list[str]:
    """The built-in training text of the BPE tokenizer: every printable ASCII character, the words and
    number patterns of distmoe's synthetic tasks and a little English."""
    lines = [string.printable, string.ascii_letters, string.digits, *_TASK_WORDS, *_ENGLISH]
    lines += [f"{w}\n{a}+{b}\n{a + b}" for w in _TASK_WORDS[:4] for a in range(10) for b in range(10)]
    lines += [f"{w}\n{a}-{b}\n{a - b}" for w in _TASK_WORDS[:4] for a in range(10) for b in range(a + 1)]
    lines += [f"{w}\nabc{c}xyz" for w in _TASK_WORDS[4:8] for c in string.ascii_lowercase]
    lines += [f"{w} k{i}" for i in range(60) for w in _TASK_WORDS[8:14]]
    up = string.ascii_uppercase
    lines += [f"k{i} {up[i % 26]}{up[(3 * i + 5) % 26]}{up[(7 * i + 11) % 26]}" for i in range(60)]
    return lines


def build_bpe_tokenizer(*, pad_token: bool = True, chat_template: str | None = "default",
                        system_role: bool = True, vocab_size: int = 512):
    """A ``PreTrainedTokenizerFast`` around a byte-level BPE trained on ``corpus()`` (deterministic).

    ``chat_template``: ``"default"`` (ChatML; with ``system_role=False`` a variant that raises on a
    system message), ``None`` (no template) or a Jinja string used as is.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(corpus(), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, unk_token=UNK,
                                  pad_token=PAD if pad_token else None, clean_up_tokenization_spaces=False,
                                  model_max_length=4096, padding_side="right")
    if chat_template == "default":
        tok.chat_template = CHATML_TEMPLATE if system_role else NO_SYSTEM_TEMPLATE
    elif chat_template is not None:
        tok.chat_template = chat_template
    return tok


def family_config(family: str, vocab_size: int, shape: dict | None = None, tokenizer=None):
    """The small transformers config of ``family`` (``shape`` overrides any field)."""
    import transformers

    if family in REFUSED_FAMILIES:
        raise ModelError(f"family {family!r} is refused: {REFUSED_FAMILIES[family]}")
    if family not in FAMILY_SHAPES:
        raise ModelError(f"cannot fabricate family {family!r} (supported: {', '.join(SUPPORTED_FAMILIES)})")
    cls_name, fields = FAMILY_SHAPES[family]
    fields = dict(fields, vocab_size=vocab_size, **(shape or {}))
    if tokenizer is not None:
        fields.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
    return getattr(transformers, cls_name)(**fields)


def write_checkpoint(family: str, out: Path, *, seed: int = 0, shape: dict | None = None,
                     tokenizer: str = "bpe", pad_token: bool = True, chat_template: str | None = "default",
                     system_role: bool = True) -> Path:
    """Write a random-initialised ``family`` checkpoint (weights, config, tokenizer) to ``out``; return ``out``.

    Deterministic in its arguments (weights from ``seed``, the BPE trained on the built-in corpus).
    ``tokenizer``: ``"bpe"`` (the only kind). ``pad_token=False``: the tokenizer has no pad token;
    ``chat_template=None``: none is saved; ``system_role=False``: the template raises on a system turn.
    """
    from transformers import AutoModelForCausalLM

    if tokenizer != "bpe":
        raise ValueError(f"tokenizer {tokenizer!r}: only 'bpe' is fabricated")
    tok = build_bpe_tokenizer(pad_token=pad_token, chat_template=chat_template, system_role=system_role)
    config = family_config(family, len(tok), shape, tok)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomise_routers(model, seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def _randomise_routers(model: torch.nn.Module, seed: int) -> None:
    """Routers some families initialise to zero (uniform routing) get small random weights, so the
    fabricated model routes tokens differently, as a trained one does; a sigmoid router's correction bias
    (zero at initialisation) gets small random values too, so that it changes some choices, as a trained one does."""
    from distmoe.model.build import router_modules

    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for _, mod in router_modules(model):
            w = getattr(mod, "weight", None)
            if isinstance(w, torch.Tensor):
                w.copy_(torch.randn(w.shape, generator=gen) * 0.5)
            b = getattr(mod, "e_score_correction_bias", None)
            if isinstance(b, torch.Tensor):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
