"""The owner's ``flower-supernode`` launcher (``clients/supernode.py``): Flower's SuperNode loop sleeps through
its module's ``time``, and the launcher's clock caps only the sleeps."""

from __future__ import annotations

import inspect
import time

from flwr.supernode import start_client_internal

from clients.supernode import IDLE_POLL_S, CappedClock


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
