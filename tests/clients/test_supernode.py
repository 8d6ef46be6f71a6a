"""The owner's ``flower-supernode`` launcher (``clients/supernode.py``): Flower's SuperNode loop sleeps through
its module's ``time`` and pulls a message's content through its module's ``pull_objects``; the launcher caps the
sleeps and shortens that pull's back-off, and a Flower that moves either fails here."""

from __future__ import annotations

import inspect
import time
import types

from flwr.supercore.inflatable import inflatable_utils
from flwr.supernode import start_client_internal

from clients.supernode import IDLE_POLL_S, CappedClock, shorten_waits


def test_flowers_supernode_loop_sleeps_through_its_module_time():
    """What the launcher replaces: flwr 1.42's fixed idle sleep of 3 s (a Flower upgrade that moves it fails here)."""
    src = inspect.getsource(start_client_internal)
    assert "time.sleep(3)" in src and start_client_internal.time is time


def test_the_capped_clock_caps_sleeps_and_keeps_the_rest():
    clock = CappedClock(0.01)
    t0 = time.monotonic()
    clock.sleep(3)
    assert time.monotonic() - t0 < 1.0
    assert clock.time() > 0 and clock.monotonic is time.monotonic and 0 < IDLE_POLL_S <= 0.5


def test_flowers_supernode_pulls_a_messages_content_through_its_module_pull_objects():
    """What the launcher shortens: the SuperNode's pull of a message's content from the SuperLink, retried with
    Flower's back-off (1, 2, 4, 8 s) while the ServerApp is still pushing it."""
    src = inspect.getsource(start_client_internal._pull_and_store_message)
    assert "pull_objects(" in src and start_client_internal.pull_objects is inflatable_utils.pull_objects
    params = inspect.signature(inflatable_utils.pull_objects).parameters
    assert params["initial_backoff"].default >= 1 and "backoff_cap" in params


def test_the_shortened_pull_retries_content_not_yet_at_the_superlink_within_a_fraction_of_a_second():
    """Three refusals (the content not yet pushed), then the object: Flower's own back-off sleeps >= 2.4 s
    (1 + 2 s, jitter -20 %); the launcher's retries take well under one."""
    loop = types.SimpleNamespace(pull_objects=inflatable_utils.pull_objects)
    shorten_waits(loop)
    refusals = iter(range(3))

    def pull_one(object_id):
        if next(refusals, None) is not None:
            raise inflatable_utils.ObjectUnavailableError(object_id)
        return b"content"

    t0 = time.monotonic()
    assert loop.pull_objects(["a"], pull_one) == {"a": b"content"}
    assert time.monotonic() - t0 < 1.0 and isinstance(loop.time, CappedClock)


def test_the_waits_on_the_supernodes_own_state_are_capped_shorter_than_the_superlink_poll():
    """flwr 1.42 waits 0.5 s between looks at its in-memory state for the ClientApp's reply and its objects (the
    launcher's short cap) and 3 s between asks of the SuperLink (the launcher's longer cap)."""
    src = inspect.getsource(start_client_internal._push_messages)
    assert src.count("time.sleep(0.5)") == 2 and "time.sleep(3)" not in src
    clock = CappedClock(5.0, 0.01)
    t0 = time.monotonic()
    clock.sleep(0.5)
    assert time.monotonic() - t0 < 0.3


def _http_error(status: int):
    import httpx

    req = httpx.Request("POST", "https://superlink:9095/api/v0/fleet/pull-messages")
    return httpx.HTTPStatusError(f"Server error '{status}'", request=req, response=httpx.Response(status, request=req))


def _pull_args(receive):
    """Arguments of flwr 1.42's ``_pull_and_store_message`` with ``receive`` as the ask for a message."""
    return dict(state=None, object_store=None, node_config={}, receive=receive, get_run=None, get_fab=None,
                pull_object=None, confirm_message_received=None, trusted_entities=None)


def test_flowers_loop_ends_on_one_superlink_error_on_the_ask_for_a_message():
    """What the launcher guards: in flwr 1.42 an HTTP 500 on ``pull-messages`` (the SuperLink's SQLite state
    answering ``database is locked`` under load) propagates out of ``_pull_and_store_message`` and so out of the
    SuperNode's loop, which then deactivates the node (a Flower that handles it itself fails here)."""
    import pytest

    def receive():
        raise _http_error(500)

    with pytest.raises(Exception, match="500"):
        start_client_internal._pull_and_store_message(**_pull_args(receive))
    assert "_pull_and_store_message(" in inspect.getsource(start_client_internal.start_client_internal)


def test_a_superlink_error_on_the_ask_is_asked_again_and_the_loop_goes_on():
    """Flower's real ``_pull_and_store_message``, guarded: two HTTP 500s answer "no message" (the loop asks again
    after a back-off), then the SuperLink has no message (None, as Flower returns); the count resets."""
    from clients.supernode import survive_server_errors

    answers = iter([_http_error(500), _http_error(503), None])
    waits, said = [], []

    def receive():
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    pull = survive_server_errors(start_client_internal._pull_and_store_message, sleep=waits.append, log=said.append)
    assert [pull(**_pull_args(receive)) for _ in range(3)] == [None, None, None]
    assert waits == [IDLE_POLL_S, 2 * IDLE_POLL_S] and "500" in said[0] and "2 in a row" in said[1]


def test_errors_that_asking_again_cannot_clear_and_a_run_of_server_errors_still_end_the_loop():
    """Not transient (401: the node's key refused; 404) raise at once, as in Flower; ``TRANSIENT_MAX`` SuperLink
    errors in a row raise too, so a SuperLink that stays broken still stops the SuperNode."""
    import pytest

    from clients.supernode import TRANSIENT_MAX, survive_server_errors, transient

    assert transient(_http_error(500)) and not transient(_http_error(401)) and not transient(_http_error(404))
    assert not transient(ValueError("x"))

    def failing(status):
        def receive():
            raise _http_error(status)
        return receive

    pull = survive_server_errors(start_client_internal._pull_and_store_message, sleep=lambda s: None,
                                 log=lambda s: None)
    with pytest.raises(Exception, match="401"):
        pull(**_pull_args(failing(401)))
    for _ in range(TRANSIENT_MAX - 1):
        assert pull(**_pull_args(failing(500))) is None
    with pytest.raises(Exception, match="500"):
        pull(**_pull_args(failing(500)))
