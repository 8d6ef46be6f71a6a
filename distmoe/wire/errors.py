"""The error replies a party can send, by name: one table, shared by the ClientApp, the in-process
transport and the server guard.

Owns: ``ErrorCode`` (the ``Error.code`` of a party's error reply; every value lies outside the range
Flower uses for its own codes, ``flwr.common.constant.ErrorCode`` 0-8, so the server can always tell
a party's refusal from Flower's ``MESSAGE_UNAVAILABLE`` or ``NODE_UNAVAILABLE``), ``FLOWER_LINK_CODES``
(the Flower codes the SuperLink itself writes for an undeliverable message), and the two exceptions a
party raises to answer with an error: ``Refused`` and ``Blocked``.

Must not: import anything but the standard library.
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    REFUSED = 1001  # the party refused the instruction; the reason is guarded, canary-scanned and anchored
    BLOCKED = 1002  # the party's outbound guard stopped its own reply; nothing of it left
    CONFIG = 1003  # the party rejects the run config or its node config
    INTERNAL = 1004  # a failure outside the party guard; no text leaves (details in the party's own log)


# flwr.common.constant.ErrorCode MESSAGE_UNAVAILABLE, REPLY_MESSAGE_UNAVAILABLE, NODE_UNAVAILABLE
FLOWER_LINK_CODES = frozenset({3, 4, 5})


class Refused(RuntimeError):
    """The party refuses to answer; ``str(exc)`` goes back as the error reply (after the canary scan)."""

    code = ErrorCode.REFUSED


class Blocked(Refused):
    """The outbound guard stopped a nonconforming reply; nothing of it left."""

    code = ErrorCode.BLOCKED
