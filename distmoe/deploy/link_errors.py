"""Errors of a Flower SuperLink that asking again may clear, and the one retry both adapters use for them.

flwr 1.42 retries a request to the SuperLink itself only on a refused connection and on HTTP 502, 503 and 504
(``supercore/retry``); an HTTP 500 (gRPC ``UNKNOWN`` or ``INTERNAL``), e.g. ``database is locked`` from the
SuperLink's SQLite state (``--database``) on a loaded machine, reaches the caller: it ends a SuperNode's loop
(``clients.supernode``) and fails the ServerApp's run (``server.app``). :func:`transient` names those errors and
:func:`retry_transient` asks again after a back-off, up to ``TRANSIENT_MAX`` times in a row, so a SuperLink that
stays broken still ends the loop or the run, as it would have at the first error.

Must not: retry a request whose repetition is not harmless (the ServerApp's push of a stage's messages: a push the
SuperLink stored in part and then failed would, pushed again, send a party the same instruction twice), or
import Flower (the caller passes the call; gRPC only to read an error's status code).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

TRANSIENT_MAX = 20  # SuperLink errors in a row before the caller gives up as Flower does at the first
TRANSIENT_FIRST_S = 0.2  # seconds before the first repeat; doubling after each error in a row
TRANSIENT_BACKOFF_CAP_S = 5.0  # seconds, the longest wait before asking again


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a SuperLink-side error that asking again may clear (HTTP 5xx; gRPC UNKNOWN/INTERNAL)."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(status, int):
        return status >= 500
    code = getattr(exc, "code", None)
    if callable(code):
        import grpc

        try:
            return code() in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
        except Exception:  # noqa: BLE001 - not a gRPC error after all
            return False
    return False


def backoff(in_a_row: int) -> float:
    """Seconds to wait after the ``in_a_row``-th transient error in a row (1, 2, ...)."""
    return min(TRANSIENT_FIRST_S * 2 ** (in_a_row - 1), TRANSIENT_BACKOFF_CAP_S)


def retry_transient(call: Callable[[], T], what: str, log: Callable[[str], None],
                    sleep: Callable[[float], None] = time.sleep) -> T:
    """``call()``, asked again after :func:`backoff` on each transient SuperLink error (logged; ``what`` names the
    request), up to ``TRANSIENT_MAX`` errors in a row; any other error, and the ``TRANSIENT_MAX``-th, is raised.
    For the ServerApp's pull of replies: if the failed pull had already taken a reply from the SuperLink, that reply
    is not pulled again, and its party counts as dropped out of the stage when the stage's timeout passes (the
    secure sum goes on without it, or the round releases nothing), never as a reply seen twice."""
    in_a_row = 0
    while True:
        try:
            return call()
        except Exception as exc:
            in_a_row += 1
            if not transient(exc) or in_a_row >= TRANSIENT_MAX:
                raise
            wait = backoff(in_a_row)
            log(f"the SuperLink failed {what} ({exc}); asking again in {wait:.1f} s ({in_a_row} in a row; at "
                f"{TRANSIENT_MAX} the run stops)")
            sleep(wait)
