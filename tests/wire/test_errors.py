"""The named error codes: distinct, and never one of Flower's own codes."""

from __future__ import annotations

from flwr.common.constant import ErrorCode as FlowerCode

from distmoe.wire.errors import FLOWER_LINK_CODES, Blocked, ErrorCode, Refused


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
