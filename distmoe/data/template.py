"""Chat-template encoding for SFT and generation: token ids, prompt-masked labels, padding, batching.

Owns: how an ``Example`` becomes ``(input_ids, labels)`` (the tokenizer's own chat template; every
prompt token -- up to and including the generation prompt before the final assistant turn -- is
labelled -100, the answer and the closing end/eos token are supervised), system turns folded into the
first user turn for templates that reject the system role, left truncation that keeps
the answer, right-padded training batches, left-padded generation prompts, the deterministic
batch order, and ``encode_fitting``: the one place a party's work paths leave out an example whose answer does
not fit ``model.max-seq-len`` (a refusal would tell a coordinator that searches over that setting the length of
the party's longest answer). Encodings are memoised per tokenizer object (``encode_example``): a party on the
Simulation Engine keeps its process, and re-rendering its whole training set through the chat template every
round cost more than its 40 training steps' overhead budget (``docs/results.md``, How close is distmoe to a plain
Flower app).

Must not: assume the default character tokenizer (only the generic HF tokenizer API is used, so a
real checkpoint's tokenizer with a ``chat_template`` works the same), touch the model, or read files.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch

from distmoe.data.formats import DataError, Example

IGNORE_INDEX = -100  # label value the HF causal-LM loss ignores

T = TypeVar("T")


class AnswerTooLong(DataError):
    """An example's completion (answer + end token) needs ``max_len`` tokens or more: it cannot be kept whole."""


def _template_kwargs(tokenizer: Any) -> dict[str, Any]:
    """Keyword arguments that make ``apply_chat_template`` return a plain list of ids, if supported."""
    try:
        params = inspect.signature(tokenizer.apply_chat_template).parameters
    except (TypeError, ValueError):
        return {}
    kwargs: dict[str, Any] = {}
    if "return_dict" in params:
        kwargs["return_dict"] = False
    if "sanitize_control_tokens" in params:
        # control tokens written inside message text are encoded as text, so data cannot forge turns
        kwargs["sanitize_control_tokens"] = True
    return kwargs


def _as_ids(out: Any) -> list[int]:
    """Normalise the return of ``apply_chat_template(tokenize=True)`` (list, nested list, dict)."""
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    if isinstance(out, torch.Tensor):
        out = out.tolist()
    out = list(out)
    if out and isinstance(out[0], (list, tuple)):
        if len(out) != 1:
            raise DataError(f"chat template returned a batch of {len(out)} sequences for one conversation")
        out = list(out[0])
    return [int(i) for i in out]


def fold_system(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation without system turns: their text (joined by blank lines) is put before the first
    user turn's content, separated by a blank line (a leading user turn holds it alone if there is none)."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    rest = [dict(m) for m in messages if m["role"] != "system"]
    if not system:
        return rest
    text = "\n\n".join(system)
    for m in rest:
        if m["role"] == "user":
            m["content"] = f"{text}\n\n{m['content']}"
            return rest
    return [{"role": "user", "content": text}, *rest]


def chat_ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template.

    A template that rejects the system role (raises while rendering one, as Gemma's and Mistral's do) gets
    the conversation with the system text folded into the first user turn (``fold_system``) instead; the
    prompt and the full conversation are folded alike, so prompt masking is unchanged."""
    from jinja2.exceptions import TemplateError

    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"tokenizer {type(tokenizer).__name__} has no chat_template; distmoe encodes instruction "
                        "data with the checkpoint's chat template (add chat_template.jinja to the checkpoint; "
                        "docs/checkpoints.md)")
    kwargs = dict(add_generation_prompt=add_generation_prompt, tokenize=True, **_template_kwargs(tokenizer))
    try:
        out = tokenizer.apply_chat_template(messages, **kwargs)
    except TemplateError as exc:
        if not any(m["role"] == "system" for m in messages):
            raise DataError(f"the chat template of {type(tokenizer).__name__} refused the conversation: "
                            f"{exc}") from None
        try:
            out = tokenizer.apply_chat_template(fold_system(messages), **kwargs)
        except TemplateError as exc2:
            raise DataError(f"the chat template of {type(tokenizer).__name__} refused the conversation ({exc}), "
                            f"and also with the system text folded into the first user turn ({exc2})") from None
    return _as_ids(out)


_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {(example, max_len): result}
MEMO_MAX = 200_000  # encodings kept per tokenizer (a few hundred bytes each); the memo starts afresh beyond


def encode_example(tokenizer: Any, example: Example, max_len: int) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of the whole conversation; labels are -100 on every prompt token.

    A pure function of its arguments (the ``Example`` is frozen), memoised per tokenizer object: a process that
    encodes the same example again (a party's next round) gets fresh lists of the same ids, and the same
    ``AnswerTooLong`` for an answer that does not fit.

    The prompt is the conversation before the final assistant turn plus the generation prompt; it
    must be a token prefix of the full rendering (else ``DataError``). Sequences longer than
    ``max_len`` lose prompt tokens from the left; the completion (answer + end token) and at least
    one prompt token are always kept, so a completion of ``max_len`` tokens or more is an error.
    Tokens the template appends after the last eos token (e.g. a trailing newline) stay in
    ``input_ids`` but are not supervised.
    """
    try:
        memo = _MEMO.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: no memo
        memo = {}
    key = (example, max_len, str(getattr(tokenizer, "chat_template", None)))  # a template set later: afresh
    if key not in memo:
        if len(memo) >= MEMO_MAX:
            memo.clear()
        try:
            memo[key] = _encode(tokenizer, example, max_len)
        except AnswerTooLong as exc:
            memo[key] = exc
    got = memo[key]
    if isinstance(got, AnswerTooLong):
        raise AnswerTooLong(str(got))
    return list(got[0]), list(got[1])


def _encode(tokenizer: Any, example: Example, max_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``encode_example`` without the memo."""
    if max_len < 2:
        raise DataError(f"max_len must be at least 2, got {max_len}")
    prompt = chat_ids(tokenizer, example.prompt_messages, add_generation_prompt=True)
    full = chat_ids(tokenizer, example.as_messages(), add_generation_prompt=False)
    if full[: len(prompt)] != prompt or len(full) == len(prompt):
        raise DataError(f"the chat template of {type(tokenizer).__name__} does not render the prompt "
                        "(with generation prompt) as a token prefix of the full conversation; "
                        "prompt masking needs that")
    completion = full[len(prompt):]
    labels = [IGNORE_INDEX] * len(prompt) + completion
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and eos in completion:
        last = len(prompt) + len(completion) - 1 - completion[::-1].index(eos)
        labels[last + 1:] = [IGNORE_INDEX] * (len(full) - last - 1)
    if len(completion) >= max_len:
        raise AnswerTooLong(f"the answer needs {len(completion)} tokens (plus at least 1 prompt token) but "
                        f"max_len is {max_len}; raise model.max-seq-len or shorten the answer")
    if len(full) > max_len:
        full, labels = full[-max_len:], labels[-max_len:]
    return tuple(full), tuple(labels)


def encode_fitting(tokenizer: Any, examples: Sequence[Example], max_len: int,
                   encode: Any = encode_example) -> tuple[list[Example], list[Any], int]:
    """``(kept examples, their encodings, number left out)``: ``encode(tokenizer, ex, max_len)`` of every example,
    leaving out those whose answer does not fit (``AnswerTooLong``); any other ``DataError`` propagates.

    Left out, not truncated: a cut answer would train (and score) the model on an answer that stops mid-way and
    never ends with the end token. Left out, not refused: whether a party refuses would depend on the length of its
    longest answer, so a coordinator that searches over ``model.max-seq-len`` would learn it, run by run, at no
    epsilon. The count left out is the caller's to put in the party's own log only; when nothing is kept the
    caller takes part as a party without data for the task does (weight 0), never with an error code. ``encode``
    may encode more than one sequence per example (a preference pair: the example is left out if either does
    not fit).
    """
    kept: list[Example] = []
    encoded: list[Any] = []
    for ex in examples:
        try:
            enc = encode(tokenizer, ex, max_len)
        except AnswerTooLong:
            continue
        kept.append(ex)
        encoded.append(enc)
    return kept, encoded, len(examples) - len(kept)


def encode_prompt(tokenizer: Any, example: Example, max_len: int) -> list[int]:
    """Prompt ids (conversation before the final answer + generation prompt), left-truncated."""
    if max_len < 1:
        raise DataError(f"max_len must be at least 1, got {max_len}")
    return chat_ids(tokenizer, example.prompt_messages, add_generation_prompt=True)[-max_len:]


def collate(batch: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad (input_ids, labels) pairs into long tensors; labels are -100 on padding."""
    if not batch:
        raise ValueError("collate: empty batch")
    b, s = len(batch), max(len(ids) for ids, _ in batch)
    input_ids = torch.full((b, s), pad_id, dtype=torch.long)  # [B, S]
    attention_mask = torch.zeros((b, s), dtype=torch.long)  # [B, S]
    labels = torch.full((b, s), IGNORE_INDEX, dtype=torch.long)  # [B, S]
    for row, (ids, lab) in enumerate(batch):
        if len(ids) != len(lab):
            raise ValueError(f"collate: row {row} has {len(ids)} ids but {len(lab)} labels")
        n = len(ids)
        input_ids[row, :n] = torch.tensor(ids, dtype=torch.long)  # [n]
        attention_mask[row, :n] = 1
        labels[row, :n] = torch.tensor(lab, dtype=torch.long)  # [n]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def collate_prompts(prompts: Sequence[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-pad prompts for batched generation (new tokens then follow every row's last token)."""
    if not prompts:
        raise ValueError("collate_prompts: empty batch")
    b, s = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((b, s), pad_id, dtype=torch.long)  # [B, S]
    attention_mask = torch.zeros((b, s), dtype=torch.long)  # [B, S]
    for row, ids in enumerate(prompts):
        n = len(ids)
        if n == 0:
            raise ValueError(f"collate_prompts: row {row} is empty")
        input_ids[row, s - n:] = torch.tensor(ids, dtype=torch.long)  # [n]
        attention_mask[row, s - n:] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def batch_iterator(encoded: Sequence[T], batch_size: int, steps: int, seed: int) -> Iterator[list[T]]:
    """Exactly ``steps`` batches of ``min(batch_size, len(encoded))`` items.

    Each epoch is a fresh permutation from one ``torch.Generator`` seeded with ``seed``; an epoch's
    leftover items (fewer than a batch) are dropped, so no batch repeats an item. Same arguments,
    same batches, on any machine.
    """
    if not encoded:
        raise DataError("batch_iterator: no training examples")
    if batch_size < 1 or steps < 0:
        raise ValueError(f"batch_iterator: batch_size must be >= 1 and steps >= 0, got {batch_size}, {steps}")
    bs = min(batch_size, len(encoded))
    per_epoch = len(encoded) // bs
    gen = torch.Generator().manual_seed(seed)
    done = 0
    while done < steps:
        perm = torch.randperm(len(encoded), generator=gen).tolist()  # [N]
        for j in range(min(per_epoch, steps - done)):
            yield [encoded[i] for i in perm[j * bs:(j + 1) * bs]]
            done += 1
