"""distmoe ServerApp: drives the configured schedule (``distmoe.coordinator.Coordinator``) over
Flower's ``Grid`` with its own round loop (``push_messages``, then ``pull_messages`` at most every
``REPLY_POLL_S``, sooner just after the push or a reply, until every reply is in or the timeout passes)
rather than a stock strategy, since a round carries several records and phases of different kinds. Not
Flower's ``send_and_receive``: on the Deployment Engine it waits 3 s between pulls (flwr 1.42 ``HttpGrid``), up
to 3 s lost on each of a round's message stages; a pull is one local request to the SuperLink, so polling faster
costs little. For the same reason Flower's back-off for a reply's content that is not yet at the SuperLink starts
at 50 ms. On the Simulation Engine (``server/sim_link.py``) a pushed message goes to the engine's queue at once and a
stored reply ends the wait, and a reply that comes while others are awaited has its content checked at once
(``GuardedTransport._arrived``). A pull for replies, or for the node list, that the SuperLink fails with an error
asking again may clear (HTTP 500: e.g. ``database is locked`` from its SQLite state under load; flwr 1.42 retries
only 502-504 and refused connections) is asked again after a back-off (``distmoe.deploy.link_errors``), up to 20
times in a row; a stage's push is not repeated (a push stored in part would reach a party twice): it fails the run,
which ``run.resume`` continues.

``run.resume = "<run dir>"`` continues an interrupted run in that directory (new Flower run id, same
logical run: ``distmoe.coordinator``), e.g. ``flwr run . <federation> --run-config "run.resume='runs/42'"``.
A stop signal closes the run as interrupted (:func:`stop_reason` says why: when this process's parent, the SuperLink's
SuperExec, is gone, the SuperLink stopped, and flwr 1.42 does not continue the run when it restarts).

Must not: load party data or build records by hand (only ``distmoe.wire.codec`` does).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from pathlib import Path

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.exit import add_exit_handler
from flwr.superlink.grid import http_grid

from distmoe.config import parse_run_config
from distmoe.coordinator import Coordinator
from distmoe.deploy.link_errors import retry_transient
from distmoe.wire import codec
from distmoe.wire.server_guard import ExchangeMemo, GuardedTransport
from server import sim_link

app = ServerApp()
SUPERLINK_STOPPED = "the SuperLink stopped (its SuperExec is gone): continue the run with run.resume"
PARENT_POLL_S = 0.5  # seconds between looks at this process's parent (watch_parent)
REPLY_POLL_FIRST_S = 0.005
REPLY_POLL_S = 0.1  # the most seconds between pulls for the replies of one message stage (the Simulation Engine's own)
# the first pull after a push, or after a pull that brought a reply, waits this long; each pull with nothing new waits
# twice as long, up to REPLY_POLL_S: a short stage (the consistency check, unmasking) is seen within a few ms of its
# replies, not up to 100 ms later, at a handful of extra pulls per stage
# a reply is listed once the SuperNode pushed its message, possibly before all its content; flwr 1.42 then
# retries each missing object after 1, 2, 4, 8 s: here after 50 ms, doubling up to 0.5 s
http_grid.pull_objects = functools.partial(http_grid.pull_objects, initial_backoff=0.05, backoff_cap=0.5)


class GridTransport(GuardedTransport):
    """The coordinator's transport over the Flower Grid: one message per node, one reply each; every
    instruction and reply passes the server guard (``GuardedTransport.exchange``)."""

    def __init__(self, grid: Grid):
        self.grid = grid
        self.link = sim_link.attach(grid)  # on the Simulation Engine: hand-off at the push, a reply wakes the pull

    def node_ids(self) -> list[int]:
        return sorted(retry_transient(lambda: list(self.grid.get_node_ids()), "the ask for the node list", _warn))

    def _send(self, out, timeout: float, memo: ExchangeMemo | None = None):
        # packed with the exchange's memo (``ExchangeMemo``): a record several instructions share (the weights) once
        msgs = [codec.instruction_content(content, node, mtype, memo) for node, (mtype, content) in out.items()]
        got = {}
        for msg in self._send_and_receive(msgs, timeout):
            node = msg.metadata.src_node_id
            if node not in out or node in got:
                continue  # a reply from a node that was not asked, or a second reply: ignored
            got[node] = (codec.ErrorReply(str(msg.error.reason), int(msg.error.code)) if msg.has_error()
                         else msg.content)
        return got

    def _pull(self, ids: set[str]) -> list:
        return list(self.grid.pull_messages(ids))

    def _send_and_receive(self, msgs, timeout: float) -> list:
        """Push ``msgs``, then pull their replies until all are in or ``timeout`` passes: ``REPLY_POLL_FIRST_S`` after
        the push or a pull that brought a reply, doubling while nothing comes, at most ``REPLY_POLL_S``. On the
        Simulation Engine (``sim_link``) the messages go to the engine's queue at the push and a stored reply ends
        the wait at once."""
        link = self.link
        waiting = set(self.grid.push_messages(msgs))
        if link is not None:
            link.hand_off()
        end = time.monotonic() + timeout
        replies = []
        wait = REPLY_POLL_FIRST_S
        while waiting:
            if link is not None:
                link.clear()  # a reply stored from here on ends the next wait
            pulled = retry_transient(functools.partial(self._pull, set(waiting)), "a pull for replies", _warn)
            replies += pulled
            replied = {m.metadata.reply_to_message_id for m in pulled}
            if self._arrived is not None and waiting - replied:
                for msg in pulled:  # others still awaited: check these now (``GuardedTransport._arrived``)
                    if not msg.has_error():
                        self._arrived(msg.metadata.src_node_id, msg.content)
            waiting -= replied
            left = end - time.monotonic()
            if not waiting or left <= 0:
                break
            if link is not None:
                link.wait(min(REPLY_POLL_S, left))
                continue
            wait = REPLY_POLL_FIRST_S if pulled else min(2 * wait, REPLY_POLL_S)
            time.sleep(min(wait, left))
        return replies


def _warn(text: str) -> None:
    log(logging.WARNING, "distmoe | %s", text)


def stop_reason(parent_pid: int) -> str:
    """Why Flower's graceful exit stops this ServerApp: its SuperLink stopped when ``parent_pid`` (its parent at the
    start, the SuperLink's SuperExec, which exits with its SuperLink) is no longer its parent (flwr 1.42 does not
    continue the run when the SuperLink restarts: ``run.resume`` does); else a stop signal."""
    if os.getppid() == parent_pid:
        return "stopped by a signal (Flower's graceful exit)"
    return SUPERLINK_STOPPED  # short: run.json's "resumes" keep it, strings the audit holds to 80 characters


def watch_parent(parent_pid: int, poll: float = PARENT_POLL_S) -> threading.Thread:
    """Stop this process as Flower's graceful exit does (SIGINT to itself) once ``parent_pid`` is no longer its parent:
    its SuperExec exited, as it does with its SuperLink. flwr 1.42's own watch (``start_parent_process_monitor``) asks
    only whether that PID exists, which an exited SuperExec still does until its new parent reaps it (the SuperLink
    that started it is gone), and raises the signal in its own thread, so that the handler waits until the main
    thread's current call returns: a ServerApp outlived its SuperLink by minutes with the run ``running``."""
    main_thread = threading.main_thread().ident

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll)
        # to the main thread, where Flower's handler runs: a signal raised in this thread would wait there until the
        # main thread's current call (a sleep between retries of a SuperLink that is gone) returned by itself
        signal.pthread_kill(main_thread, signal.SIGINT)

    thread = threading.Thread(target=watch, name="distmoe-parent-watch", daemon=True)
    thread.start()
    return thread


@app.main()
def main(grid: Grid, context: Context) -> None:
    parent = os.getppid()
    if threading.current_thread() is threading.main_thread():  # a deployed ServerApp process (simulation: a thread)
        watch_parent(parent)
    cfg = parse_run_config(context.run_config)
    run_id = str(context.run_id)
    if cfg.run.resume:  # continue an interrupted run there (docs/operations.md, Resume)
        run_dir = Path(cfg.run.resume)
    else:
        run_dir = Path(cfg.run.dir) if cfg.run.dir else Path("runs") / run_id
    coord = Coordinator(cfg, run_dir, GridTransport(grid), run_id, log=lambda s: log(logging.INFO, s))
    # SIGTERM/SIGINT/SIGQUIT reach Flower's handler in the process's main thread (the Simulation Engine runs this
    # function in a worker thread, where no signal arrives): close the ledger as interrupted before Flower exits.
    add_exit_handler(lambda: coord.interrupt(stop_reason(parent)), run_before_force_exit=True)
    coord.run()
