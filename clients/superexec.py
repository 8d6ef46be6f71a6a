"""The data owner's ``flower-superexec``, woken by its SuperNode when a message arrives (``clients/supernode.py``).

flwr 1.42's SuperExec (``supercore/superexec/run_superexec.py``) asks its SuperNode for a task (``AcquireTask``,
one HTTP request to the SuperNode's Runtime API) and sleeps a fixed interval between asks
(``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``, 1 s by default). A short interval starts the ClientApp soon after a message
arrives but costs CPU all the time, also while nothing arrives: measured with ``bench/deploy_idle.py`` on an idle
three-owner deployment, 50 ms asks took 116 ms of CPU per second in the SuperExecs and about 160 ms in the
SuperNodes serving them, a quarter of a core taken from the owners' training. Flower has no way to tell the
SuperExec that a task exists. This launcher runs Flower's own ``flower-superexec`` entry point unchanged, except
that its sleep between asks ends as soon as a byte arrives on ``--wake-fd N``, a pipe whose other end the
SuperNode's launcher writes to right after Flower's loop creates a task (:func:`clients.supernode.wake_on_task`).
So the SuperExec asks at once when there is a task and otherwise at the poll interval (``SUPEREXEC_POLL_S`` of
:mod:`distmoe.deploy.commands`), which is then only the fallback. When the pipe's writer is gone (the SuperNode
ended) the sleeps are Flower's own again.

Must not: change anything of Flower's but that sleep, or import anything of an app bundle.
"""

from __future__ import annotations

import importlib
import os
import select
import sys
import time

WAKE_FLAG = "--wake-fd"


class WakeableClock:
    """``time`` for Flower's SuperExec loop: every function as it is; ``sleep`` returns early once ``fd`` (a
    pipe's read end, non-blocking) has bytes, which it drains, and is a plain sleep after the writer closed it."""

    def __init__(self, fd: int):
        os.set_blocking(fd, False)
        self.fd: int | None = fd
        self.wakes = 0  # sleeps ended early by a wake (tests read it)

    def __getattr__(self, name: str):
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        seconds = max(0.0, float(seconds))
        if self.fd is None:
            time.sleep(seconds)
            return
        ready, _, _ = select.select([self.fd], [], [], seconds)
        if not ready:
            return
        try:
            data = os.read(self.fd, 4096)  # every wake written so far: one ask serves them all
        except BlockingIOError:  # another reader took them; nothing to do
            return
        if data:
            self.wakes += 1
            return
        os.close(self.fd)  # end of file: the SuperNode is gone; Flower's loop ends with it (its parent monitor)
        self.fd = None
        time.sleep(seconds)


def split_wake_fd(args: list[str]) -> tuple[int | None, list[str]]:
    """``--wake-fd N`` first in ``args`` -> (N, the rest: Flower's own arguments); else (None, args)."""
    if args[:1] != [WAKE_FLAG]:
        return None, args
    if len(args) < 2 or not args[1].isdigit():
        raise SystemExit(f"distmoe superexec: {WAKE_FLAG} needs a file descriptor number, got {args[1:2]}")
    return int(args[1]), args[2:]


def main(argv: list[str] | None = None) -> None:
    fd, args = split_wake_fd(list(sys.argv[1:] if argv is None else argv))
    loop = importlib.import_module("flwr.supercore.superexec.run_superexec")
    from flwr.supercore.cli.flower_superexec import flower_superexec

    if fd is not None:
        loop.time = WakeableClock(fd)
    sys.argv = ["flower-superexec", *args]
    flower_superexec()


if __name__ == "__main__":
    main()
