"""Unit tests: default tokenizer, JSONL formats and their errors, party split, encoding, synth tasks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from distmoe.config import DataConfig
from distmoe.data.formats import DataError, Example, read_jsonl, to_dataset
from distmoe.data.party import held_out, load_party, split_key
from distmoe.data.synth import (
    ALL_FAMILIES,
    TASK_FAMILIES,
    VERIFIERS,
    check_answer,
    lookup_table,
    synth_tasks,
    write_synthetic,
)
from distmoe.data.template import (
    IGNORE_INDEX,
    batch_iterator,
    collate,
    collate_prompts,
    encode_example,
    encode_prompt,
)
from distmoe.model.tokenizer import DEFAULT_VOCAB_SIZE, build_default_tokenizer

CFG = DataConfig(eval_fraction=0.2, max_train_examples=0, max_eval_examples=1000, synth_examples=60, seed=0)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Compute\n7+5"},
        {"role": "assistant", "content": "12"}]


@pytest.fixture(scope="module")
def tok():
    return build_default_tokenizer()


def _write(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


# ------------------------------------------------------------------------------------------ tokenizer
def test_tokenizer_roundtrip_vocab_and_special_ids(tok):
    assert len(tok) <= DEFAULT_VOCAB_SIZE
    for s in ["Compute 7+5 = 12", "  two  spaces\tand\nnewline ~!", "0123456789", "<|user|>hi<|end|>"]:
        ids = tok.encode(s)
        assert tok.decode(ids) == s
    assert len(tok.encode("a b")) == 3  # one token per character, no merges
    assert tok.pad_token == "<pad>" and tok.pad_token_id == 0
    assert tok.eos_token == "<|end|>" and tok.unk_token == "<unk>"
    assert tok.encode("<|assistant|>") == [tok.convert_tokens_to_ids("<|assistant|>")]
    assert tok.encode("é") == [tok.unk_token_id]


def test_tokenizer_is_deterministic(tok):
    other = build_default_tokenizer()
    assert other is not tok and other.get_vocab() == tok.get_vocab()
    assert other.encode("Compute 7+5 = 12") == tok.encode("Compute 7+5 = 12")
    assert other.chat_template == tok.chat_template


def test_tokenizer_save_load_identical(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "<|user|>Reverse\nab c<|assistant|>c ba<|end|>"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.decode(loaded.encode(text)) == text
    assert loaded.apply_chat_template(CHAT, tokenize=False) == tok.apply_chat_template(CHAT, tokenize=False)
    assert (loaded.pad_token_id, loaded.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)


def test_chat_template_rendering(tok):
    assert tok.apply_chat_template(CHAT, tokenize=False) == \
        "<|system|>Be brief.<|user|>Compute\n7+5<|assistant|>12<|end|>"
    prompt = tok.apply_chat_template(CHAT[1:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>Compute\n7+5<|assistant|>"
    ids = tok.apply_chat_template(CHAT[1:2], tokenize=True, add_generation_prompt=True, return_dict=False)
    assert tok.decode(ids) == prompt


# ------------------------------------------------------------------------------------------ formats
def test_read_jsonl_both_formats(tmp_path):
    path = _write(tmp_path / "t.jsonl", [
        {"instruction": "Compute", "input": "7+5", "output": "12"},
        "",
        {"instruction": "Say hi", "input": "", "output": "hi"},
        {"instruction": "Say yo", "output": "yo"},
        {"messages": CHAT},
    ])
    exs = read_jsonl(path)
    assert len(exs) == 4
    assert exs[0].messages == (("user", "Compute\n7+5"), ("assistant", "12"))
    assert exs[1].messages == (("user", "Say hi"), ("assistant", "hi"))
    assert exs[2].messages == (("user", "Say yo"), ("assistant", "yo"))
    assert exs[3].answer == "12"
    assert exs[3].prompt_messages == CHAT[:2] and exs[3].as_messages() == CHAT
    ds = to_dataset(exs)
    assert ds.column_names == ["messages", "answer"] and ds[0]["answer"] == "12"
    assert ds[3]["messages"] == CHAT


@pytest.mark.parametrize("line, field", [
    ('{"instruction": "a", "output": 3}', "field 'output': expected a string, got int"),
    ('{"instruction": "a", "output": "b",}', "invalid JSON"),
    ('[1, 2]', "expected a JSON object, got list"),
    ('{"instruction": "a"}', "field 'output': missing"),
    ('{"input": "a", "output": "b"}', "field 'instruction': missing"),
    ('{"foo": 1}', "field 'messages': missing"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}',
     "field 'messages[1].role': 'bot' is not one of system, user, assistant"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 5}]}',
     "field 'messages[1].content': expected a string, got int"),
    ('{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}',
     "field 'messages[1].role': the last turn must be 'assistant'"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]}',
     "field 'messages[1].content'"),
    ('{"messages": [{"role": "system", "content": "a"}, {"role": "assistant", "content": "b"}]}',
     "field 'messages': needs at least one user turn"),
    ('{"messages": [{"role": "user"}, {"role": "assistant", "content": "b"}]}',
     "field 'messages[0].content': missing"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], '
     '"instruction": "x", "output": "y"}', "mixes the chat format"),
    # unknown fields are errors naming the allowed ones (a typo is not silently dropped)
    ('{"instruction": "a", "inptu": "x", "output": "b"}',
     "field 'inptu': unknown field in an Alpaca line (allowed: instruction, input, output)"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "id": 3}',
     "field 'id': unknown field in a chat line (allowed: messages)"),
    ('{"messages": [{"role": "user", "content": "a", "name": "u"}, {"role": "assistant", "content": "b"}]}',
     "field 'messages[0].name': unknown field in a chat turn (allowed: role, content)"),
])
def test_read_jsonl_errors_name_file_line_field(tmp_path, line, field):
    path = tmp_path / "party-0" / "arith.jsonl"
    path.parent.mkdir()
    _write(path, [{"instruction": "ok", "output": "fine"}, "", line])
    with pytest.raises(DataError) as err:
        read_jsonl(path)
    msg = str(err.value)
    assert f"{path}:3:" in msg and field in msg


PAIR = {"prompt": "Compute\n2+3", "chosen": "5", "rejected": "6"}


@pytest.mark.parametrize("line, field", [
    ('{"prompt": "p", "chosen": "a"}', "field 'rejected': missing (preference lines need prompt, chosen and rejected)"),
    ('{"prompt": "p", "chosen": 1, "rejected": "b"}', "field 'chosen': expected a string, got int"),
    ('{"prompt": "", "chosen": "a", "rejected": "b"}', "field 'prompt': must not be empty"),
    ('{"prompt": "p", "chosen": "a", "rejected": "a"}', "field 'rejected': equals 'chosen'"),
    ('{"prompt": "p", "chosen": "a", "rejected": "b", "score": 1}',
     "field 'score': unknown field in a preference line (allowed: prompt, chosen, rejected)"),
    ('{"prompt": "p", "chosen": "a", "rejected": "b", "output": "c"}', "mixes the preference format"),
    ('{"instruction": "a", "output": "b"}', "an instruction line in a file of preference lines"),
])
def test_preference_lines_are_validated_naming_file_line_field(tmp_path, line, field):
    path = tmp_path / "pref.jsonl"
    _write(path, [PAIR, "", line])
    with pytest.raises(DataError) as err:
        read_jsonl(path)
    assert f"{path}:3:" in str(err.value) and field in str(err.value)


def test_preference_pairs_load_as_examples_with_a_rejected_answer(tmp_path):
    d = tmp_path / "p"
    d.mkdir()
    _write(d / "pref.jsonl", [PAIR, {**PAIR, "prompt": "Add\n2+3", "rejected": "2+3"}])
    _write(d / "arith.jsonl", [{"instruction": "a", "output": "b"}, {"instruction": "c", "output": "d"}])
    party = load_party(d, CFG)
    assert party.is_preference("pref") and not party.is_preference("arith")
    ex = read_jsonl(d / "pref.jsonl")[0]
    assert ex.is_pair and ex.answer == "5" and ex.rejected == "6"
    assert ex.rejected_example().as_messages() == [{"role": "user", "content": "Compute\n2+3"},
                                                    {"role": "assistant", "content": "6"}]
    assert ex.to_json() != Example(messages=ex.messages).to_json()  # the split key sees the rejected answer
    _write(tmp_path / "mixed.jsonl", [{"instruction": "a", "output": "b"}, PAIR])
    with pytest.raises(DataError, match="mixed.jsonl:2: a preference line in a file of instruction lines"):
        read_jsonl(tmp_path / "mixed.jsonl")


def test_synth_pref_task_is_a_verifiable_preference(tmp_path):
    assert synth_tasks(("lookup", "pref")) == (*TASK_FAMILIES, "pref") and synth_tasks(("arith",)) == TASK_FAMILIES
    dirs = write_synthetic(tmp_path, parties=2, examples_per_task=60, seed=0, tasks=("pref", "arith"), canaries=1)
    for d in dirs:
        exs = read_jsonl(d / "pref.jsonl")
        canary = (d / "canaries.txt").read_text().strip()
        assert [ex.answer for ex in exs if ex.answer.startswith("canary-")] == [canary]  # planted as a pair
        exs = [ex for ex in exs if not ex.answer.startswith("canary-")]
        assert len(exs) == 60 and all(ex.is_pair for ex in exs)
        echoes = 0
        for ex in exs:
            prompt = ex.messages[-2][1]
            assert check_answer("pref", prompt, ex.answer, ex.answer)
            assert not check_answer("pref", prompt, ex.rejected, ex.answer)  # the rejected answer is wrong
            expr = prompt.split("\n")[1]
            assert int(ex.answer) == eval(expr)  # noqa: S307 -- the synthetic digits-only expression
            echoes += ex.rejected == expr
        assert 10 < echoes < 50  # about half echo the expression, the rest are off by one or two
        assert load_party(d, CFG).is_preference("pref")


def test_invalid_json_reports_column(tmp_path):
    path = _write(tmp_path / "bad.jsonl", ['{"a": 1 "b": 2}'])
    with pytest.raises(DataError, match=r"bad\.jsonl:1: invalid JSON: Expecting ',' delimiter \(column 9\)"):
        read_jsonl(path)


def test_file_level_errors(tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"missing\.jsonl: file not found"):
        read_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match=r"empty\.jsonl: empty file \(no examples\)"):
        read_jsonl(_write(tmp_path / "empty.jsonl", ["", "   "]))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"instruction": "caf\xe9", "output": "x"}\n')
    with pytest.raises(DataError, match=r"latin\.jsonl:1: not valid UTF-8"):
        read_jsonl(latin)
    locked = _write(tmp_path / "locked.jsonl", [{"instruction": "a", "output": "b"}])

    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", denied)  # chmod 0 does not stop root, so simulate it
    with pytest.raises(DataError, match=r"locked\.jsonl: cannot read file \(permission denied\)"):
        read_jsonl(locked)


# ------------------------------------------------------------------------------------------ party
def _party(tmp_path: Path, n: int = 100) -> Path:
    d = tmp_path / "party-a"
    d.mkdir()
    _write(d / "alpha.jsonl", [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(n)])
    _write(d / "beta.jsonl", [{"instruction": "only", "output": "one"},
                              {"instruction": "two", "output": "2"}])
    (d / "notes.txt").write_text("ignored")
    return d


def test_load_party_split_deterministic_disjoint(tmp_path):
    d = _party(tmp_path)
    a, b = load_party(d, CFG), load_party(d, CFG)
    assert a.tasks == ("alpha", "beta") and a.has("alpha") and not a.has("notes")
    assert a.train("alpha") == b.train("alpha") and a.heldout("alpha") == b.heldout("alpha")
    train, held = set(a.train("alpha")), set(a.heldout("alpha"))
    assert not train & held and len(train | held) == 100
    # held out iff the example's own keyed hash is below eval_fraction * 2^64: no rank cut (about 20 of 100)
    assert held == {ex for ex in train | held if held_out(split_key(ex, CFG.seed), CFG.eval_fraction)}
    assert 10 <= len(held) <= 30
    assert len(a.train("beta")) + len(a.heldout("beta")) == 2
    # the split does not depend on line order, and does depend on the seed
    lines = (d / "alpha.jsonl").read_text().splitlines()
    (d / "alpha.jsonl").write_text("\n".join(reversed(lines)) + "\n")
    assert set(load_party(d, CFG).heldout("alpha")) == held
    other = DataConfig(**{**CFG.__dict__, "seed": 1})
    assert set(load_party(d, other).heldout("alpha")) != held
    assert a.train_dataset("alpha").num_rows == 100 - len(held)


def test_load_party_caps_and_duplicates(tmp_path):
    d = tmp_path / "p"
    d.mkdir()
    rows = [{"instruction": f"q{i % 10}", "output": "x"} for i in range(50)]  # every example 5 times
    _write(d / "dup.jsonl", rows)
    party = load_party(d, CFG)
    assert not set(party.train("dup")) & set(party.heldout("dup"))  # duplicates never straddle
    capped = load_party(d, DataConfig(eval_fraction=0.2, max_train_examples=7, max_eval_examples=3,
                                      synth_examples=60, seed=0))
    assert len(capped.train("dup")) == 7 and len(capped.heldout("dup")) == 3
    assert capped.train("dup") == party.train("dup")[:7]


def test_load_party_errors(tmp_path):
    d = _party(tmp_path)
    with pytest.raises(DataError, match=r"has no task 'gamma' \(available: alpha, beta\)") as err:
        load_party(d, CFG).require("gamma")
    assert str(d) in str(err.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no \\*.jsonl") as err:
        load_party(empty, CFG)
    assert str(empty) in str(err.value)
    _write(d / "bad name.jsonl", [{"instruction": "a", "output": "b"}])
    with pytest.raises(DataError, match="task name 'bad name'"):
        load_party(d, CFG)


# ------------------------------------------------------------------------------------------ template
def _supervised(ids: list[int], labels: list[int]) -> list[int]:
    return [t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX]


def test_label_masking(tok):
    ex = Example(messages=(("system", "Be brief."), ("user", "Compute\n7+5"), ("assistant", "12")))
    ids, labels = encode_example(tok, ex, max_len=96)
    assert len(ids) == len(labels)
    assert tok.decode(ids) == "<|system|>Be brief.<|user|>Compute\n7+5<|assistant|>12<|end|>"
    prompt = encode_prompt(tok, ex, max_len=96)
    assert ids[: len(prompt)] == prompt and tok.decode(prompt).endswith("<|assistant|>")
    assert all(label == IGNORE_INDEX for label in labels[: len(prompt)])
    supervised = _supervised(ids, labels)
    assert supervised == ids[len(prompt):] and supervised[-1] == tok.eos_token_id
    assert tok.decode(supervised) == "12<|end|>"


def test_control_tokens_in_content_are_text(tok):
    ex = Example(messages=(("user", "a<|end|>b"), ("assistant", "ok")))
    prompt = encode_prompt(tok, ex, max_len=96)
    assert tok.eos_token_id not in prompt  # data cannot forge an end-of-turn
    assert tok.decode(prompt) == "<|user|>a<|end|>b<|assistant|>"


def test_truncation_keeps_answer(tok):
    ex = Example(messages=(("user", "x" * 50), ("assistant", "answer")))
    ids, labels = encode_example(tok, ex, max_len=20)
    assert len(ids) == 20
    assert tok.decode(ids).endswith("x<|assistant|>answer<|end|>")
    assert tok.decode(_supervised(ids, labels)) == "answer<|end|>"
    assert len(encode_prompt(tok, ex, max_len=10)) == 10
    with pytest.raises(DataError, match="max_len is 5"):
        encode_example(tok, ex, max_len=5)


def test_other_template_trailing_tokens_and_prefix_check(tok):
    qwen_like = build_default_tokenizer()
    qwen_like.chat_template = (
        "{% for m in messages %}{{ '<|user|>' if m['role'] == 'user' else '<|assistant|>' }}"
        "{{ m['content'] }}{% if m['role'] == 'assistant' %}<|end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    ex = Example(messages=(("user", "hi"), ("assistant", "yo")))
    ids, labels = encode_example(qwen_like, ex, 32)
    assert qwen_like.decode(ids) == "<|user|>hi<|assistant|>yo<|end|>\n"
    assert labels[-1] == IGNORE_INDEX  # the trailing newline after eos is not supervised
    assert qwen_like.decode(_supervised(ids, labels)) == "yo<|end|>"
    broken = build_default_tokenizer()
    broken.chat_template = tok.chat_template.replace("{{ '<|assistant|>' }}", "{{ '<|assistant|>\\n' }}")
    with pytest.raises(DataError, match="prefix"):
        encode_example(broken, ex, 32)


def test_collate_right_pads_and_prompts_left_pad():
    batch = [([5, 6, 7], [-100, 6, 7]), ([8, 9], [-100, 9])]
    out = collate(batch, pad_id=0)
    assert out["input_ids"].shape == out["labels"].shape == out["attention_mask"].shape == (2, 3)
    assert out["input_ids"].dtype == torch.long
    assert out["input_ids"][1].tolist() == [8, 9, 0]
    assert out["attention_mask"][1].tolist() == [1, 1, 0]
    assert out["labels"][1].tolist() == [-100, 9, -100]
    p = collate_prompts([[5, 6, 7], [8]], pad_id=0)
    assert p["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert p["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]


def test_batch_iterator_deterministic():
    items = list(range(10))
    a = list(batch_iterator(items, 4, 7, seed=3))
    assert a == list(batch_iterator(items, 4, 7, seed=3))
    assert a != list(batch_iterator(items, 4, 7, seed=4))
    assert len(a) == 7 and all(len(b) == 4 and len(set(b)) == 4 for b in a)
    assert not set(a[0]) & set(a[1])  # one epoch (2 full batches of 10 items) never repeats an item
    assert a[:2] != a[2:4]  # the next epoch is reshuffled
    small = list(batch_iterator([1, 2], 16, 3, 0))
    assert len(small) == 3 and all(sorted(b) == [1, 2] for b in small)
    assert list(batch_iterator(items, 4, 0, 0)) == []


# ------------------------------------------------------------------------------------------ synth
def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.jsonl"))}


def test_synth_deterministic_and_non_iid(tmp_path):
    dirs = write_synthetic(tmp_path / "a", parties=3, examples_per_task=60, seed=0)
    write_synthetic(tmp_path / "b", parties=3, examples_per_task=60, seed=0)
    snap = _snapshot(tmp_path / "a")
    assert snap == _snapshot(tmp_path / "b")
    assert [d.name for d in dirs] == ["party-0", "party-1", "party-2"]
    assert len(snap) == 9
    for task in TASK_FAMILIES:
        assert snap[f"party-0/{task}.jsonl"] != snap[f"party-1/{task}.jsonl"]
    write_synthetic(tmp_path / "c", parties=1, examples_per_task=60, seed=1)
    assert _snapshot(tmp_path / "c")["party-0/arith.jsonl"] != snap["party-0/arith.jsonl"]
    # the lookup facts are shared: a key seen by two parties has the same code
    table = lookup_table(0)
    for d in dirs:
        for ex in read_jsonl(d / "lookup.jsonl"):
            key = next(w.strip("?") for w in ex.messages[0][1].split() if w.strip("?") in table)
            assert ex.answer == table[key]


def test_synth_refuses_overwrite(tmp_path):
    write_synthetic(tmp_path, parties=2, examples_per_task=10, seed=0)
    with pytest.raises(DataError, match="party-0"):
        write_synthetic(tmp_path, parties=2, examples_per_task=10, seed=0)
    write_synthetic(tmp_path, parties=2, examples_per_task=10, seed=0, tasks=("arith",), overwrite=True)
    assert sorted(p.name for p in (tmp_path / "party-0").iterdir()) == ["arith.jsonl"]


def test_synth_answers_verify_and_load(tmp_path):
    dirs = write_synthetic(tmp_path, parties=2, examples_per_task=60, seed=0)
    assert set(VERIFIERS) == set(ALL_FAMILIES)
    for d in dirs:
        party = load_party(d, CFG)
        assert party.tasks == tuple(sorted(TASK_FAMILIES))
        for task in party.tasks:
            exs = party.train(task) + party.heldout(task)
            assert len(exs) == 60 and len(set(exs)) == 60  # distinct examples
            for ex in exs:
                prompt = ex.messages[-2][1]
                assert len(prompt) <= 40 and len(ex.answer) <= 6
                assert check_answer(task, prompt, ex.answer, ex.answer)
                assert check_answer(task, prompt, f" {ex.answer} ", ex.answer)
                assert not check_answer(task, prompt, ex.answer + "1", ex.answer)


def test_check_answer_rules():
    assert check_answer("arith", "Compute\n7+5", " 12 ", "12")
    assert check_answer("arith", "", "12.0", "12") and check_answer("arith", "", "-3", "- 3")
    assert not check_answer("arith", "", "13", "12") and not check_answer("arith", "", "twelve", "12")
    assert not check_answer("arith", "", "", "12") and not check_answer("arith", "", "nan", "12")
    assert check_answer("strings", "", "CBA\n", "CBA") and not check_answer("strings", "", "cba", "CBA")
    assert check_answer("arith-hard", "", "4", "4.0")  # family prefix selects the verifier
    assert check_answer("custom", "", " x ", "x") and not check_answer("custom", "", "y", "x")


def test_load_party_reads_a_file_again_only_when_its_bytes_change(tmp_path, monkeypatch):
    import distmoe.data.party as party_mod

    d = _party(tmp_path)
    reads = []
    real = party_mod.read_jsonl
    monkeypatch.setattr(party_mod, "read_jsonl", lambda p, *a: reads.append(Path(p).name) or real(p, *a))
    first = load_party(d, CFG)
    assert sorted(reads) == ["alpha.jsonl", "beta.jsonl"]
    again = load_party(d, CFG)  # the same bytes: nothing parsed again, the same split
    assert sorted(reads) == ["alpha.jsonl", "beta.jsonl"]
    assert again.train("alpha") == first.train("alpha") and again.heldout("alpha") == first.heldout("alpha")
    # rewritten in place with the same size (same inode, possibly the same timestamps): read afresh
    path = d / "beta.jsonl"
    before = path.stat().st_size
    _write(path, [{"instruction": "ONLY", "output": "ONE"}, {"instruction": "TWO", "output": "2"}])
    assert path.stat().st_size == before
    changed = load_party(d, CFG)
    assert reads.count("beta.jsonl") == 2
    assert {ex.as_messages()[0]["content"] for ex in changed.train("beta") + changed.heldout("beta")} == {"ONLY", "TWO"}
    # another seed splits afresh; a file that stops validating fails every time (never served from the memo)
    load_party(d, DataConfig(**{**CFG.__dict__, "seed": 7}))
    assert reads.count("alpha.jsonl") == 2
    _write(path, ["{not json"])
    for _ in range(2):
        with pytest.raises(DataError):
            load_party(d, CFG)
