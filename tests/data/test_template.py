"""The memo of ``encode_example``: a party that keeps its process encodes each example once, and gets exactly what
an encoding afresh gives (fresh lists, the same ``AnswerTooLong``)."""

from __future__ import annotations

import pytest

from distmoe.data import template
from distmoe.data.formats import Example
from distmoe.data.template import AnswerTooLong, encode_example, encode_fitting
from distmoe.model.tokenizer import build_default_tokenizer


def _ex(q: str, a: str) -> Example:
    return Example(messages=(("user", q), ("assistant", a)))


def test_encodings_are_memoised_per_tokenizer_and_equal_a_fresh_encoding(monkeypatch):
    tok, other = build_default_tokenizer(), build_default_tokenizer()  # two tokenizer objects
    calls = {"n": 0}
    real = template.chat_ids

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(template, "chat_ids", counting)
    examples = [_ex(f"what is {i} + 1?", str(i + 1)) for i in range(5)] + [_ex("q", "x" * 80)]
    kept, first, left = encode_fitting(tok, examples, 32)
    n = calls["n"]
    assert n == 2 * len(examples) and left == 1 and len(kept) == 5
    again = encode_fitting(tok, examples, 32)
    assert calls["n"] == n  # the second round re-renders nothing
    assert again == (kept, first, left)
    fresh = [tuple(map(list, template._encode(tok, ex, 32))) for ex in kept]
    assert [tuple(e) for e in first] == fresh
    first[0][0].append(-1)  # a caller's change to its lists never reaches the memo
    assert encode_example(tok, kept[0], 32) == fresh[0]
    with pytest.raises(AnswerTooLong):
        encode_example(tok, examples[-1], 32)
    n = calls["n"]  # (``_encode`` above rendered afresh)
    encode_example(other, kept[0], 32)  # another tokenizer object: encoded afresh
    assert calls["n"] == n + 2
    encode_example(tok, kept[0], 16)  # another length: encoded afresh
    assert calls["n"] == n + 4


def test_a_tokenizer_whose_chat_template_changes_is_encoded_afresh():
    tok = build_default_tokenizer()
    ex = _ex("what is 2 + 2?", "4")
    before = encode_example(tok, ex, 64)
    assert "'<|user|>' + message['content']" in tok.chat_template
    tok.chat_template = tok.chat_template.replace("'<|user|>' + message['content']",
                                                  "'<|user|>' + message['content'] + 'x'")
    after = encode_example(tok, ex, 64)
    assert after != before and len(after[0]) == len(before[0]) + 1
    assert list(after) == [list(x) for x in template._encode(tok, ex, 64)]
