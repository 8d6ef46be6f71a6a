"""The default character-level tokenizer for the tiny demo model.

Owns: ``build_default_tokenizer()`` -- a deterministic, offline, character-level
``PreTrainedTokenizerFast`` (printable ASCII plus ``\\n`` and ``\\t``, six special tokens, a Jinja
chat template) -- and ``DEFAULT_VOCAB_SIZE``, the vocabulary size the default model is built for.

Must not: download anything, read files, depend on the model, or know about parties or tasks.
Every other tokenizer (a real checkpoint's) is loaded by the model builder with ``AutoTokenizer``;
code that uses tokenizers must go through the generic HF API so both kinds work.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

DEFAULT_VOCAB_SIZE = 128  # the default model's embedding rows; the real vocabulary is smaller

PAD, UNK = "<pad>", "<unk>"
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = (PAD, UNK, SYSTEM, USER, ASSISTANT, END)  # ids 0..5, in this order
CHARACTERS = tuple(chr(c) for c in range(0x20, 0x7F)) + ("\n", "\t")  # printable ASCII + newline + tab

# <|user|>{content}<|assistant|>{content}<|end|>; system turns as <|system|>{content};
# add_generation_prompt appends <|assistant|>. An unknown role is an error, not silently dropped.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{ '<|system|>' + message['content'] }}"
    "{%- elif message['role'] == 'user' -%}"
    "{{ '<|user|>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ '<|assistant|>' + message['content'] + '<|end|>' }}"
    "{%- else -%}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)


def _vocab() -> dict[str, int]:
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    assert len(tokens) == len(set(tokens)) and len(tokens) <= DEFAULT_VOCAB_SIZE
    return {tok: i for i, tok in enumerate(tokens)}


def build_default_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh character tokenizer; identical (vocabulary, ids, template) on every call and machine.

    Every character is one token (unknown characters map to ``<unk>``), special tokens are matched
    as whole strings before splitting, and decoding concatenates tokens with no separator, so
    ``decode(encode(s)) == s`` for any ASCII string ``s``.
    """
    vocab = _vocab()
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # one pre-token per character, newline included ([\s\S] matches everything, unlike '.')
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()  # join tokens without inserting spaces
    core.add_special_tokens(list(SPECIAL_TOKENS))  # already in the vocab: keeps ids 0..5
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        unk_token=UNK,
        eos_token=END,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
        padding_side="right",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
