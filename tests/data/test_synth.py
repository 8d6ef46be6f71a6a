"""``distmoe.data.synth.disjoint_lookup``: tables with disjoint keys, distinct codes and 480 held-out items each,
every key trained and held out in different phrasings, deterministic in its arguments; ``disjoint_split``: a
family's training and held-out items share no prompt (``arith`` from a wider operand window only there), or a
clear error where the family has too few; the default files unchanged (their hash); ``shift6``:
6-letter answers, distinct words, exact-match verification.

Must not: train anything.
"""

from __future__ import annotations

import hashlib
import re

import pytest

from distmoe.data.formats import DataError, parse_line
from distmoe.data.synth import (
    ARITH_MAX_OPERAND,
    ARITH_PHRASINGS,
    SHIFT6_PHRASINGS,
    arith_window,
    check_answer,
    disjoint_lookup,
    disjoint_split,
    generate,
    lookup_table,
    prompt_of,
    shift_word,
    synth_tasks,
    write_synthetic,
)


def _keys(objs):
    return {re.search(r"\bk(\d+)\b", o["instruction"]).group(0) for o in objs}


def test_disjoint_tables_hold_480_unseen_phrasings_each():
    tables = disjoint_lookup(3, 2, 80)
    (a_train, a_held), (b_train, b_held) = tables
    assert [len(x) for x in (a_train, a_held, b_train, b_held)] == [480] * 4
    assert _keys(a_train) == _keys(a_held) and len(_keys(a_held)) == 80
    assert not _keys(a_train) & _keys(b_train)  # disjoint keys
    assert not {o["output"] for o in a_train} & {o["output"] for o in b_train}  # distinct codes
    assert not {o["instruction"] for o in a_train} & {o["instruction"] for o in a_held}  # held out = unseen prompts
    assert not {f"k{i}" for i in range(60)} & (_keys(a_train) | _keys(b_train))  # not the default table's keys
    assert set(lookup_table(3)) == {f"k{i}" for i in range(60)}
    assert disjoint_lookup(3, 2, 80) == tables and disjoint_lookup(4, 2, 80) != tables


def test_disjoint_lookup_refuses_bad_sizes():
    with pytest.raises(DataError, match="keys"):
        disjoint_lookup(0, 2, 1000)


@pytest.mark.parametrize("task", ["strings", "shift6"])
def test_disjoint_split_holds_480_items_out_with_no_prompt_in_training(task):
    train, held = disjoint_split(task, 0, 480, 480)
    assert len(train) == len(held) == 480
    assert not {prompt_of(o) for o in train} & {prompt_of(o) for o in held}
    assert len({prompt_of(o) for o in held}) == 480
    assert disjoint_split(task, 0, 480, 480) == (train, held) and disjoint_split(task, 1, 480, 480) != (train, held)
    assert train + held == generate(task, 0, 960, 0)  # the family's own items, nothing invented


def test_disjoint_split_widens_arith_only_where_the_party_window_is_too_small():
    train, held = disjoint_split("arith", 0, 480, 480)  # party 0's own window 0..7 has 400 prompts
    prompts = [prompt_of(o) for o in train + held]
    assert len(train) == len(held) == 480 and len(set(prompts)) == 960  # distinct, so disjoint
    assert not set(prompts[:480]) & set(prompts[480:])
    operands = [int(x) for o in train + held for x in re.split(r"[+-]", o["input"])]
    assert min(operands) == 0 and max(operands) == 13 == arith_window(0, 960)  # the smallest window that holds 960
    assert sum(max(int(x) for x in re.split(r"[+-]", o["input"])) >= 10 for o in held) > 100  # new two-digit facts
    for o in train + held:
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)", o["input"]).groups()
        assert o["output"] == str(int(a) + int(b) if op == "+" else int(a) - int(b))  # the same format: an integer
        assert re.fullmatch(r"\d+", o["output"]) and o["instruction"] in ARITH_PHRASINGS
    assert sum("+" in o["input"] for o in train + held) == 720  # party 0's operator mix: 3/4 sums
    assert disjoint_split("arith", 0, 480, 480) == (train, held)
    assert disjoint_split("arith", 1, 480, 480) != (train, held)
    small = disjoint_split("arith", 0, 100, 100)  # the party's own window suffices: generate's items, unchanged
    assert small[0] + small[1] == generate("arith", 0, 200, 0) and arith_window(0, 200) == 7
    default = generate("arith", 0, 960, 0)  # the default data never widens: repeats instead
    assert max(int(x) for o in default for x in re.split(r"[+-]", o["input"])) == 7
    assert len({prompt_of(o) for o in default}) == 400


def test_default_synthetic_files_are_byte_identical_to_the_quick_starts(tmp_path):
    write_synthetic(tmp_path, 3, 240, 0, tasks=("arith", "strings", "lookup", "pref"))
    h = hashlib.sha256()
    for f in sorted(tmp_path.rglob("*.jsonl")):
        h.update(f.relative_to(tmp_path).as_posix().encode())
        h.update(f.read_bytes())
    assert h.hexdigest() == "5afb99ca26158c617f7c28811fb1a4ac82d5ecbe3bcc354d8b5f1d2ea57a1ec4"  # 3 parties x 240


def test_disjoint_split_refuses_a_family_with_too_few_distinct_prompts():
    with pytest.raises(DataError, match=r"arith \(party 0\): 60000 distinct items.*0\.\.99"):
        disjoint_split("arith", 0, 30000, 30000)  # 40,000 sums and 20,200 differences at most; 45,000 sums asked
    assert arith_window(0, 40000 * 4 // 3) == ARITH_MAX_OPERAND
    with pytest.raises(DataError, match="'lookup'.*240 distinct prompts"):
        disjoint_split("lookup", 0, 200, 100)  # 40 keys x 6 phrasings in a party's window
    with pytest.raises(DataError, match="n_held"):
        disjoint_split("shift6", 0, 10, 0)
    assert prompt_of({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "Sort\nabc"},
                                   {"role": "assistant", "content": "abc"}]}) == "Sort\nabc"


def test_shift6_answers_are_six_shifted_letters_of_distinct_words():
    objs = generate("shift6", 0, 2200, 0)
    assert len({o["input"] for o in objs}) == 2200  # distinct words: any split is disjoint
    for o in objs[:200]:
        assert o["instruction"] in SHIFT6_PHRASINGS and re.fullmatch(r"[a-z]{6}", o["input"])
        assert len(o["output"]) == 6 and o["output"] != o["input"]
        assert [(ord(b) - ord(a)) % 26 for a, b in zip(o["input"], o["output"], strict=True)] == [1] * 6
    assert shift_word("xyzabc") == "yzabcd"
    assert generate("shift6", 0, 50, 0) == objs[:50] and generate("shift6", 1, 50, 0) != objs[:50]
    ex = parse_line(objs[0], "synth:0")
    assert ex.answer == objs[0]["output"] and objs[0]["input"] in ex.prompt_messages[-1]["content"]


def test_shift6_reward_is_exact_match_of_the_whole_answer():
    assert check_answer("shift6", "Shift\nabcdef", "bcdefg", "bcdefg")
    assert check_answer("shift6", "Shift\nabcdef", " bcdefg ", "bcdefg")  # stripped, like every exact task
    assert not check_answer("shift6", "Shift\nabcdef", "bcdefh", "bcdefg")  # one wrong letter of six: 0
    assert not check_answer("shift6", "Shift\nabcdef", "bcdef", "bcdefg")


def test_shift6_is_written_only_when_scheduled(tmp_path):
    assert "shift6" not in synth_tasks(["lookup"]) and "shift6" in synth_tasks(["lookup", "shift6"])
    (d,) = write_synthetic(tmp_path, 1, 20, 0, tasks=("shift6",))
    assert len((d / "shift6.jsonl").read_text().splitlines()) == 20
    with pytest.raises(DataError, match="at most 10,000,000"):
        generate("shift6", 0, 10**7 + 1, 0)
