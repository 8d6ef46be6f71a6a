"""``distmoe.data.synth.disjoint_lookup``: tables with disjoint keys, distinct codes and 480 held-out items each,
every key trained and held out in different phrasings, deterministic in its arguments.

Must not: train anything.
"""

from __future__ import annotations

import re

import pytest

from distmoe.data.formats import DataError
from distmoe.data.synth import disjoint_lookup, lookup_table


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
