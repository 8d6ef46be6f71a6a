"""The ServerApp's Flower adapter (``server/app.py``): the waits it shortens are where it expects them in flwr 1.42,
so a Flower that moves them fails here rather than silently bringing the waits back."""

from __future__ import annotations

import functools
import inspect
import os
import subprocess
import sys
import time

import pytest
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
    assert "push_messages(" in src and "self._pull" in src and "send_and_receive(" not in src.split('"""')[-1]
    assert "pull_messages(" in inspect.getsource(app.GridTransport._pull)
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


def _http_error(status: int):
    import httpx

    req = httpx.Request("POST", "https://superlink:9091/api/v0/serverappio/pull-messages")
    return httpx.HTTPStatusError(f"Server error '{status}'", request=req, response=httpx.Response(status, request=req))


class _FailingGrid(_Grid):
    """``_Grid`` whose pulls (and node list) fail with the given errors first; a push that fails, if ``push_error``."""

    def __init__(self, after, errors, push_error=None):
        super().__init__(after)
        self.errors, self.push_error, self.asks = list(errors), push_error, 0

    def push_messages(self, msgs):
        if self.push_error is not None:
            self.asks += 1
            raise self.push_error
        return super().push_messages(msgs)

    def pull_messages(self, ids):
        self.asks += 1
        if self.errors:
            raise self.errors.pop(0)
        return super().pull_messages(ids)

    def get_node_ids(self):
        self.asks += 1
        if self.errors:
            raise self.errors.pop(0)
        return [3, 1, 2]


def test_flowers_grid_gives_up_on_a_superlink_500():
    """What the adapter guards: flwr 1.42's HTTP retry asks again only on 502-504 and refused connections, so an
    HTTP 500 (the SuperLink's SQLite state answering ``database is locked`` under load) reaches the ServerApp and
    ended the run (a Flower that retries it itself fails here)."""
    from flwr.supercore.retry import http_retry

    assert 500 not in http_retry._RETRYABLE_STATUS_CODES and 503 in http_retry._RETRYABLE_STATUS_CODES


def test_a_pull_the_superlink_fails_is_asked_again_and_the_stage_goes_on(monkeypatch):
    """Two HTTP 500s on the pull for replies, one on the node list: each is logged and asked again after a back-off,
    and the stage ends with every reply (before, the first 500 failed the run)."""
    from distmoe.deploy import link_errors

    monkeypatch.setattr(link_errors, "TRANSIENT_FIRST_S", 0.001)
    said: list[str] = []
    monkeypatch.setattr(app, "_warn", said.append)  # what goes to Flower's log as a WARNING
    grid = _FailingGrid({"a": 0.0, "b": 0.01}, [_http_error(500), _http_error(500)])
    got = app.GridTransport(grid)._send_and_receive([], timeout=5.0)
    assert sorted(m.metadata.reply_to_message_id for m in got) == ["a", "b"] and grid.asks >= 3
    assert len(said) == 2 and "the SuperLink failed a pull for replies" in said[0]
    assert len(said) == 2 and "500" in said[0] and "2 in a row" in said[1], said
    assert app.GridTransport(_FailingGrid({}, [_http_error(500)])).node_ids() == [1, 2, 3]


def test_errors_asking_again_cannot_clear_a_run_of_500s_and_a_failed_push_still_end_the_run(monkeypatch):
    """401/404 raise at once, as in Flower; ``TRANSIENT_MAX`` 500s in a row raise too (a SuperLink that stays broken
    still ends the run); a stage's push is never repeated (stored in part, it would reach a party twice)."""
    from distmoe.deploy import link_errors

    monkeypatch.setattr(link_errors, "TRANSIENT_FIRST_S", 0.0)
    for status in (401, 404):
        grid = _FailingGrid({"a": 0.0}, [_http_error(status)])
        with pytest.raises(Exception, match=str(status)):
            app.GridTransport(grid)._send_and_receive([], timeout=5.0)
        assert grid.asks == 1
    grid = _FailingGrid({"a": 0.0}, [_http_error(500)] * link_errors.TRANSIENT_MAX)
    with pytest.raises(Exception, match="500"):
        app.GridTransport(grid)._send_and_receive([], timeout=5.0)
    assert grid.asks == link_errors.TRANSIENT_MAX
    grid = _FailingGrid({"a": 0.0}, [], push_error=_http_error(500))
    with pytest.raises(Exception, match="500"):
        app.GridTransport(grid)._send_and_receive([], timeout=5.0)
    assert grid.asks == 1


_CHILD = """import os, signal, sys, time
from pathlib import Path
from server.app import stop_reason, watch_parent
parent, out = os.getppid(), Path(sys.argv[1])
out.write_text(stop_reason(parent) + "\\n")  # while the parent lives


def stopped(*_):  # Flower's graceful exit runs distmoe's exit handler here
    out.write_text(out.read_text() + stop_reason(parent) + "\\n")
    os._exit(0)


signal.signal(signal.SIGINT, stopped)
watch_parent(parent, 0.05)
time.sleep(120)  # only the SIGINT of watch_parent ends this early
"""
_MIDDLE = """import subprocess, sys, time
from pathlib import Path
subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]])
while not Path(sys.argv[2]).exists():  # the child has its parent's PID (and wrote its first line)
    time.sleep(0.05)
"""


def test_watch_parent_sends_sigint_once_the_parent_is_another():
    import signal

    got: list[int] = []
    old = signal.signal(signal.SIGINT, lambda *_: got.append(1))
    try:
        app.watch_parent(os.getppid(), poll=0.5)  # the parent is there: nothing (a daemon thread, polling slowly)
        app.watch_parent(-1, poll=0.01).join(10)  # no process has PID -1: the parent at the start is gone
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:  # the handler runs in the main thread
            time.sleep(0.01)
        time.sleep(0.6)
    finally:
        signal.signal(signal.SIGINT, old)
    assert got == [1]


def test_the_stop_reason_names_the_superlink_when_the_parent_changed():
    assert app.stop_reason(os.getppid()) == "stopped by a signal (Flower's graceful exit)"
    text = app.stop_reason(-1)  # no process has PID -1: the parent at the start is gone
    assert text == app.SUPERLINK_STOPPED and "run.resume" in text and len(text) <= 80, text  # the audit's limit


@pytest.mark.integration
def test_a_stop_after_the_superexec_is_gone_names_the_superlink_and_the_resume(tmp_path):
    """A real process tree: a middle process starts the child and exits (as the SuperLink's SuperExec exits with its
    SuperLink); ``watch_parent`` stops the orphaned child with SIGINT (Flower's graceful exit), which says that the
    SuperLink stopped and how to resume; while its parent lives, that it was stopped by a signal."""

    child, out = tmp_path / "child.py", tmp_path / "out.txt"
    child.write_text(_CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    subprocess.run([sys.executable, "-c", _MIDDLE, str(child), str(out)], env=env, timeout=120, check=True)
    deadline = time.monotonic() + 60
    while (not out.exists() or out.read_text().count("\n") < 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = out.read_text().splitlines()
    assert len(lines) == 2, lines
    assert lines[0] == "stopped by a signal (Flower's graceful exit)", lines
    assert lines[1] == app.SUPERLINK_STOPPED, lines
