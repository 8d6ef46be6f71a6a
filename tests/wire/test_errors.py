"""The named error codes: distinct, never one of Flower's own codes, and a closed table of fixed texts."""

from __future__ import annotations

import re

import pytest
from flwr.common.constant import ErrorCode as FlowerCode

from distmoe.wire.errors import (
    ALL_REASONS,
    FLOWER_LINK_CODES,
    REASON_TEXTS,
    REASONS,
    SERVER_REASONS,
    Blocked,
    ErrorCode,
    Reason,
    Refused,
    code_of,
    reason_name,
    reason_text,
)


def _flower_codes() -> set[int]:
    return {v for k, v in vars(FlowerCode).items() if k.isupper() and isinstance(v, int)}


def test_codes_never_collide_with_flowers():
    flower = _flower_codes()
    assert flower  # the walker does see Flower's table
    assert not {int(c) for c in ErrorCode} & flower
    assert len({int(c) for c in ErrorCode}) == len(ErrorCode)


def test_link_codes_are_flowers_unavailable_codes():
    assert FLOWER_LINK_CODES == {FlowerCode.MESSAGE_UNAVAILABLE, FlowerCode.REPLY_MESSAGE_UNAVAILABLE,
                                 FlowerCode.NODE_UNAVAILABLE}


def test_each_refusal_carries_its_code():
    assert Refused("x").code is ErrorCode.REFUSED and Blocked("y").code is ErrorCode.BLOCKED
    assert isinstance(Blocked("y"), Refused)


def test_the_reason_table_is_closed_and_carries_no_figures():
    """Every code has one fixed text; no text holds a digit (a count, a line, a length) or a placeholder."""
    assert set(REASONS) == set(ErrorCode)
    names = [n for n, _ in REASONS.values()] + list(SERVER_REASONS)
    assert len(set(names)) == len(names) and set(ALL_REASONS) == set(names)
    for code in ErrorCode:
        text = reason_text(code)
        assert text in REASON_TEXTS and code_of(text) is code
        assert not re.search(r"[\d{}%]", text) and text.isascii() and "see the party's log" in text
    for name, text in ALL_REASONS.items():
        assert text.startswith(f"{name}: ") and not re.search(r"[\d{}%]", text)
    assert code_of(reason_text(ErrorCode.DATA) + " (arith.jsonl:5)") is None


def test_a_reason_knows_its_table_entry():
    r = Reason("no-reply", "no reply within 30 s")
    assert r.name == "no-reply" and str(r) == "no reply within 30 s" and reason_name(r) == "no-reply"
    assert str(Reason("data")) == ALL_REASONS["data"]
    assert reason_name("update norm 12 x the median") == "screened"  # the coordinator's own screening
    with pytest.raises(ValueError):
        Reason("exceeds its 4 training prompts")
    assert Refused("detail", ErrorCode.DATA).code is ErrorCode.DATA and str(Refused("detail")) == "detail"
