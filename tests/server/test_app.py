"""The ServerApp's Flower adapter (``server/app.py``): the waits it shortens are where it expects them in flwr 1.42,
so a Flower that moves them fails here rather than silently bringing the waits back."""

from __future__ import annotations

import functools
import inspect

from flwr.supercore.inflatable import inflatable_utils
from flwr.superlink.grid import http_grid

from server import app


def test_the_reply_content_back_off_is_shortened_where_flowers_grid_pulls_it():
    """A reply is listed once its SuperNode pushed the message, possibly before its content: ``HttpGrid.pull_messages``
    retries through the module's ``pull_objects``, which the adapter binds to a 50 ms back-off."""
    assert "pull_objects(" in inspect.getsource(http_grid.HttpGrid.pull_messages)
    patched = http_grid.pull_objects
    assert isinstance(patched, functools.partial) and patched.func is inflatable_utils.pull_objects
    assert patched.keywords == {"initial_backoff": 0.05, "backoff_cap": 0.5}
    assert inspect.signature(inflatable_utils.pull_objects).parameters["initial_backoff"].default >= 1


def test_flowers_send_and_receive_waits_3_s_between_pulls_so_the_adapter_polls_itself():
    assert "time.sleep(3)" in inspect.getsource(http_grid.HttpGrid.send_and_receive)
    src = inspect.getsource(app.GridTransport._send_and_receive)
    assert "push_messages(" in src and "pull_messages(" in src and "send_and_receive(" not in src.split('"""')[-1]
    assert 0 < app.REPLY_POLL_S <= 0.1
