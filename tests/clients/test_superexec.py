"""The owner's ``flower-superexec`` launcher (``clients/superexec.py``) and its SuperNode's side
(``clients/supernode.py``: ``SuperExecWaker``, ``wake_on_task``): Flower's SuperExec loop sleeps through its
module's ``time``; the launcher's sleep ends when the SuperNode writes to the wake pipe, right after Flower's SuperNode
loop creates a task. A Flower that moves the sleep, the SuperExec's start or the task's creation fails here."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import threading
import time

import pytest
from flwr.supercore.constant import TaskType
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supernode import start_client_internal
from flwr.supernode.nodestate import NodeStateFactory

from clients.superexec import WAKE_FLAG, WakeableClock, split_wake_fd
from clients.supernode import SuperExecWaker, wake_on_task

LOOP = importlib.import_module("flwr.supercore.superexec.run_superexec")


def test_flowers_superexec_loop_sleeps_through_its_module_time_between_asks():
    src = inspect.getsource(LOOP.run_superexec)
    assert "client.AcquireTask(" in src and "time.sleep(task_poll_interval)" in src and LOOP.time is time


def test_flowers_supernode_starts_the_superexec_through_its_module_subprocess_and_creates_the_task_first():
    """flwr 1.42: ``subprocess.Popen(["flower-superexec", ...])`` in the loop's module, and the message's task is
    created before its content is pulled (so a wake at the task starts the ClientApp while the content arrives)."""
    src = inspect.getsource(start_client_internal.start_client_internal)
    assert 'command = ["flower-superexec"]' in src and "subprocess.Popen(command)" in src
    pull = inspect.getsource(start_client_internal._pull_and_store_message)
    assert 0 < pull.index("state.create_task(") < pull.index("pull_objects(")


def test_the_wakeable_sleep_ends_at_a_wake_and_drains_every_wake_written():
    read, write = os.pipe()
    clock = WakeableClock(read)
    try:
        t0 = time.monotonic()
        clock.sleep(0.05)  # nothing written: the whole interval
        assert time.monotonic() - t0 >= 0.045 and clock.wakes == 0
        threading.Timer(0.1, os.write, (write, b"w")).start()
        t0 = time.monotonic()
        clock.sleep(30)
        assert time.monotonic() - t0 < 5 and clock.wakes == 1
        os.write(write, b"www")  # three wakes before the next sleep: one early return, then a full sleep again
        clock.sleep(30)
        t0 = time.monotonic()
        clock.sleep(0.05)
        assert clock.wakes == 2 and time.monotonic() - t0 >= 0.045
        assert clock.time() > 0 and clock.monotonic is time.monotonic
    finally:
        os.close(write)
    t0 = time.monotonic()
    clock.sleep(0.05)  # the writer is gone: a plain sleep from now on, the pipe closed
    assert clock.fd is None and time.monotonic() - t0 >= 0.045


def test_the_wake_flag_is_read_first_and_the_rest_is_flowers():
    assert split_wake_fd([WAKE_FLAG, "12", "--insecure"]) == (12, ["--insecure"])
    assert split_wake_fd(["--insecure"]) == (None, ["--insecure"])
    with pytest.raises(SystemExit, match="file descriptor"):
        split_wake_fd([WAKE_FLAG, "--insecure"])


def test_the_waker_starts_flowers_superexec_through_the_launcher_with_the_pipe(tmp_path):
    """A real process: ``flower-superexec --help`` as Flower's SuperNode would start it, through the waker: the
    launcher takes the pipe and hands the rest to Flower's own entry point, which prints its help; a wake after it
    ended is dropped without an error. Any other command is started as it is."""
    waker = SuperExecWaker()
    out = (tmp_path / "out").open("w")
    proc = waker.popen(["flower-superexec", "--help"], stdout=out, stderr=subprocess.STDOUT)
    assert proc.args[:5] == [sys.executable, "-P", "-m", "clients.superexec", WAKE_FLAG]
    assert proc.wait(timeout=120) == 0 and waker.fd is not None
    out.close()
    assert "--runtime-api-address" in (tmp_path / "out").read_text()
    waker.wake()
    waker.wake()  # broken pipe: the SuperExec is gone; the write end is dropped
    assert waker.fd is None
    other = waker.popen([sys.executable, "-c", "print('as it is')"], stdout=subprocess.PIPE, text=True)
    assert other.communicate(timeout=60)[0].strip() == "as it is"


def test_the_supernode_wakes_its_superexec_once_per_task_flowers_node_state_creates():
    """Flower's real in-memory node state: each task created wakes the SuperExec once, a pull that creates none
    (no message) does not; the state is wrapped once however many pulls there are."""
    state = NodeStateFactory(objectstore_factory=ObjectStoreFactory()).state()
    wakes = []

    def pull(*, state, message):
        if message:
            state.create_task(task_type=TaskType.CLIENT_APP, run_id=7, fab_hash="ab")
            return 7
        return None

    woken = wake_on_task(pull, lambda: wakes.append(1))
    assert [woken(state=state, message=m) for m in (False, True, False, True)] == [None, 7, None, 7]
    assert len(wakes) == 2


def test_a_wake_reaches_a_sleeping_superexec_clock_through_the_wakers_pipe():
    """The two halves together in one process: the waker's pipe, the launcher's clock on its read end."""
    waker = SuperExecWaker()
    read, write = os.pipe()
    waker.fd = write
    clock = WakeableClock(read)
    threading.Timer(0.1, waker.wake).start()
    t0 = time.monotonic()
    clock.sleep(30)
    assert time.monotonic() - t0 < 5 and clock.wakes == 1
    waker.close()
    os.close(read)
