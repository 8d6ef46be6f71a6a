"""The data owner's ``flower-supernode`` with short waits (``distmoe deploy supernode --code-pin``).

flwr 1.42's SuperNode asks the SuperLink for a message and, when there is none, sleeps a fixed 3 s
(``supernode/start_client_internal.py``: ``time.sleep(3)``; no option or environment variable sets it), and then
checks for its ClientApp's reply, and for each of the reply's objects, every 0.5 s. Each message stage of a round
therefore waits on average 1.5 s before the SuperNode even fetches its message. This launcher runs Flower's own
``flower-supernode`` entry point unchanged, with that module's sleeps capped: at ``IDLE_POLL_S`` between asks of
the SuperLink (5 a second, one small authenticated request each; the SuperLink answers it from its state
database), at ``LOCAL_POLL_S`` between looks at its own in-memory state (the reply, its content). The SuperExec
that Flower starts beside it (``flower-superexec``, which starts the ClientApp for each message) is started through
:mod:`clients.superexec` with a wake pipe (:class:`SuperExecWaker`), and the SuperNode writes to that pipe as soon
as Flower's loop has created the task for a message (:func:`wake_on_task`): the SuperExec asks for the task at once
instead of polling the SuperNode 20 times a second.

The SuperNode takes a message from the SuperLink as soon as the ServerApp has pushed its metadata, usually before
the ServerApp has pushed its content (the SuperLink's ``PullMessages`` does not wait for it); flwr 1.42 then retries
each missing object after 1, 2, 4, 8 s (the module's ``pull_objects``, ``supercore/constant.py``
PULL_INITIAL_BACKOFF = 1, PULL_BACKOFF_CAP = 10), and the ClientApp started for the message waits for that
content. Here the retries start at 50 ms, doubling up to 0.5 s (one request to the SuperLink each), as the
ClientApp's own (:mod:`clients.pinned`). Everything else (TLS, node authentication, the SuperExec, the ClientApp
processes) is Flower's. A SuperLink error on the SuperNode's ask for a message (HTTP 5xx; gRPC ``UNKNOWN`` or
``INTERNAL``: e.g. ``database is locked`` from the SuperLink's SQLite state under load) ends flwr 1.42's loop, and
the SuperNode deactivates itself while its process stays up, taking no more messages; here such an error is logged
and the ask repeated after a back-off, and only ``TRANSIENT_MAX`` of them in a row end the loop as before. With
``--code-pin FILE`` first it also starts the SuperNode's warm ClientApp worker
(:mod:`clients.warm`) before Flower's code runs, so the first message finds it ready.

Must not: change anything of Flower's but those sleeps, back-offs, that retry and how the SuperExec is started and
woken, or import anything of an app bundle.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
import types
from pathlib import Path

from clients.pinned import PULL_BACKOFF_CAP_S, PULL_BACKOFF_S
from clients.superexec import WAKE_FLAG
from distmoe.deploy.link_errors import TRANSIENT_MAX, backoff, transient

IDLE_POLL_S = 0.2  # seconds, the most the SuperNode sleeps between asks of the SuperLink (flwr's own: 3 s)
LOCAL_POLL_S = 0.02  # seconds, its sleeps between looks at its own in-memory state (flwr's own: 0.5 s)


class CappedClock:
    """``time`` for Flower's SuperNode loop: every function as it is, ``sleep`` capped at ``cap`` seconds, and at
    ``local_cap`` for a sleep under 1 s (flwr 1.42's 0.5 s waits for the ClientApp's reply and its content, which
    look at the SuperNode's own in-memory state; its only longer sleep is the 3 s idle poll of the SuperLink)."""

    def __init__(self, cap: float, local_cap: float | None = None):
        self.cap = cap
        self.local_cap = cap if local_cap is None else local_cap

    def __getattr__(self, name: str):
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        seconds = float(seconds)
        time.sleep(min(seconds, self.cap if seconds >= 1 else self.local_cap))


def survive_server_errors(pull, sleep=time.sleep, log=None):
    """``pull`` (Flower's ``_pull_and_store_message``) that answers "no message" (None) on a transient SuperLink
    error (``distmoe.deploy.link_errors``), after its back-off (0.2 s doubling to 5 s), and raises the
    ``TRANSIENT_MAX``-th in a row (then Flower's loop ends as it would have at the first)."""
    in_a_row = 0

    def guarded(*args, **kwargs):
        nonlocal in_a_row
        try:
            out = pull(*args, **kwargs)
        except Exception as exc:
            if not transient(exc) or in_a_row + 1 >= TRANSIENT_MAX:
                raise
            in_a_row += 1
            wait = backoff(in_a_row)
            (log or _warn)(f"distmoe supernode: the SuperLink failed the ask for a message ({exc}); asking again in "
                           f"{wait:.1f} s ({in_a_row} in a row; at {TRANSIENT_MAX} the SuperNode stops)")
            sleep(wait)
            return None
        in_a_row = 0
        return out

    return guarded


class SuperExecWaker:
    """Starts Flower's SuperExec (the ``flower-superexec`` command of flwr 1.42's SuperNode loop) as
    ``python -P -m clients.superexec --wake-fd R <Flower's arguments>``, R the read end of a pipe it keeps the write
    end of; ``wake`` writes one byte to it (never blocks: a full pipe already holds a wake; a closed one, a
    SuperExec that ended, is dropped). Any other command is started as it is."""

    def __init__(self):
        self.fd: int | None = None

    def popen(self, command, **kwargs):
        if list(command[:1]) != ["flower-superexec"]:
            return subprocess.Popen(command, **kwargs)
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            proc = subprocess.Popen([sys.executable, "-P", "-m", "clients.superexec", WAKE_FLAG, str(read),
                                     *command[1:]], pass_fds=(read,), **kwargs)
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        self.close()
        self.fd = write
        return proc

    def wake(self) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, b"w")
        except BlockingIOError:
            pass
        except OSError:  # the SuperExec is gone (broken pipe)
            self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def wake_on_task(pull, wake):
    """``pull`` (Flower's ``_pull_and_store_message``) whose node state calls ``wake()`` right after each task it
    creates: flwr 1.42 creates the ClientApp's task once the message's metadata is in, before pulling its content,
    so the SuperExec starts the ClientApp while the content is still arriving, as with a poll, without the wait."""

    def woken(*args, **kwargs):
        state = kwargs.get("state")
        if state is not None and not getattr(state, "_distmoe_wakes", False):
            create = state.create_task

            def create_task(*a, **kw):
                task_id = create(*a, **kw)
                if task_id is not None:
                    wake()
                return task_id

            state.create_task, state._distmoe_wakes = create_task, True
        return pull(*args, **kwargs)

    return woken


def _warn(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def shorten_waits(loop) -> None:
    """Flower's SuperNode loop module (``flwr.supernode.start_client_internal``) with the waits above shortened."""
    loop.time = CappedClock(IDLE_POLL_S, LOCAL_POLL_S)
    loop.pull_objects = functools.partial(loop.pull_objects, initial_backoff=PULL_BACKOFF_S,
                                          backoff_cap=PULL_BACKOFF_CAP_S)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    pin_file = None
    if args[:1] == ["--code-pin"] and len(args) > 1:
        pin_file, args = Path(args[1]).resolve(), args[2:]
    from flwr.supercore.address import resolve_bind_address
    from flwr.supernode import start_client_internal
    from flwr.supernode.cli.flower_supernode import flower_supernode

    from clients import warm

    host, port = warm.arg_value(args, "--host"), warm.arg_value(args, "--port")
    if pin_file is not None and host and port:  # the warm worker imports while the SuperNode connects
        warm.prestart(pin_file, resolve_bind_address(f"{host}:{port}"))
    shorten_waits(start_client_internal)
    waker = SuperExecWaker()
    start_client_internal.subprocess = types.SimpleNamespace(Popen=waker.popen)
    start_client_internal._pull_and_store_message = wake_on_task(survive_server_errors(
        start_client_internal._pull_and_store_message), waker.wake)
    sys.argv = ["flower-supernode", *args]
    flower_supernode()


if __name__ == "__main__":
    main()
