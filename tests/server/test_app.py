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


class _Grid:
    """Replies that become available at given times after the push; counts the pulls."""

    def __init__(self, after: dict[str, float]):
        self.after, self.pulls, self.t0 = after, 0, 0.0

    def push_messages(self, msgs):
        import time

        self.t0 = time.monotonic()
        return list(self.after)

    def pull_messages(self, ids):
        import time
        from types import SimpleNamespace

        self.pulls += 1
        now = time.monotonic() - self.t0
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i), at=now)
                for i in ids if self.after[i] <= now]


def test_a_short_stage_is_seen_within_ms_of_its_replies_and_a_long_one_costs_few_extra_pulls():
    """The pull waits 5 ms after the push and after each reply, doubling up to ``REPLY_POLL_S`` while nothing comes:
    replies 10 and 20 ms after the push are seen within a few ms (a fixed 100 ms poll sees them 80-90 ms late; the
    bound allows for a loaded machine's late wake-ups), and a 1.2 s stage takes at most 20 pulls (a fixed 100 ms
    poll: 13)."""
    short = _Grid({"a": 0.01, "b": 0.02})
    got = app.GridTransport(short)._send_and_receive([], timeout=5.0)
    assert sorted(m.metadata.reply_to_message_id for m in got) == ["a", "b"]
    late = {m.metadata.reply_to_message_id: m.at - short.after[m.metadata.reply_to_message_id] for m in got}
    assert all(0 <= d < 0.06 for d in late.values()), late
    long = _Grid({"a": 1.2})
    got = app.GridTransport(long)._send_and_receive([], timeout=5.0)
    assert [m.metadata.reply_to_message_id for m in got] == ["a"] and long.pulls <= 20, long.pulls
    assert 0 < app.REPLY_POLL_FIRST_S < app.REPLY_POLL_S
