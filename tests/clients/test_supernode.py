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
