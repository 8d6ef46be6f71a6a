"""The ServerApp's link to Flower's Simulation Engine in its own process: a message handed to a party as soon as it is
pushed, and a reply seen as soon as it is stored, instead of at the engine's and the pull loop's 0.1 s polls.

In flwr 1.42 the Simulation Engine runs the ServerApp in a thread of the process that runs the engine, over an
``InMemoryGrid`` whose ``InMemoryLinkState`` the engine shares. Two fixed polls sit between the coordinator and a
party: the engine's extractor thread (``vce_api.add_messages_to_queue``) reads the state for new messages every
0.1 s (``f_stop.wait(0.1)``: a message waits 0-100 ms, 50 ms on average, on every message stage), and the ServerApp
pulls replies on its own schedule (``server/app.py``: at most every 0.1 s). :func:`attach` returns a
:class:`SimLink` for such a grid:

- ``hand_off()`` (after a push) does the extractor's own step at once: for every node of the engine, the state's
  ``get_message_ins(node_id, limit=1)`` into the engine's message queue, the queue the extractor fills (found as the
  running extractor thread's arguments, and used only when its state is this grid's state). Both threads then read
  the state; Flower's ``get_message_ins`` selects a message under the state's ``RLock`` but marks it delivered after
  releasing it, so two readers could both take one message. ``attach`` therefore wraps this state object's
  ``get_message_ins`` so that selection and marking happen under the lock (the lock is re-entrant): every message is
  delivered exactly once, by whichever thread reads it first; the extractor keeps running as before (a message pushed
  before the engine's queue exists, at the run's start, is delivered by it).
- ``wait(seconds)`` returns as soon as the state stores a reply (this state object's ``store_message_res`` sets an
  event after storing) or after ``seconds``.

What it relies on (flwr 1.42 internals, none of them Flower's public API), checked by :func:`attach` before it
touches anything: Flower's version is 1.42.x (``FLWR_SERIES``); the grid is an ``InMemoryGrid`` whose ``state`` is an
``InMemoryLinkState`` with a re-entrant ``lock`` (``threading.RLock``) and instance-replaceable methods
``get_message_ins(node_id, limit, ...)`` and ``store_message_res(message)``; ``vce_api.add_messages_to_queue(state,
queue, nodes_mapping, f_stop)`` is the extractor, and its running thread keeps its target and arguments in
``Thread._target``/``Thread._args`` (looked for at each hand-off until found; until then the extractor alone delivers).

Any other grid (deployment: ``GrpcGrid``/``HttpGrid``) gets ``None`` and the ServerApp's plain polling. So does an
in-memory grid of a Flower that does not look as described, with one log line (WARNING, Flower's logger) saying what
differs: the run goes on at the engine's and the pull loop's 0.1 s polls. Nothing here changes what a message carries
or who receives it.

Must not: change, drop, reorder or duplicate a message; touch a state other than the grid's own; stop or replace
Flower's threads.
"""

from __future__ import annotations

import inspect
import logging
import threading
from queue import Queue

from flwr.common.logger import log

EXTRACTOR = "add_messages_to_queue"  # flwr.server.superlink.fleet.vce.vce_api's thread target
FLWR_SERIES = "1.42."  # the Flower whose internals this module relies on (module docstring)


class SimLink:
    """The hand-off and the reply event for one ``InMemoryGrid`` (module docstring)."""

    def __init__(self, state):
        self.state = state
        self.replied = threading.Event()
        self._engine: tuple[Queue, object] | None = None  # the extractor's (queue, nodes mapping), once found
        get_ins, store_res = state.get_message_ins, state.store_message_res

        def get_message_ins(*args, **kwargs):  # selection and marking as delivered under the one re-entrant lock
            with state.lock:
                return get_ins(*args, **kwargs)

        def store_message_res(*args, **kwargs):
            stored = store_res(*args, **kwargs)
            self.replied.set()
            return stored

        state.get_message_ins, state.store_message_res = get_message_ins, store_message_res

    def _find_engine(self) -> tuple[Queue, object] | None:
        for th in threading.enumerate():
            target, args = getattr(th, "_target", None), getattr(th, "_args", None)
            if (getattr(target, "__name__", "") == EXTRACTOR and isinstance(args, tuple) and len(args) == 4
                    and args[0] is self.state and isinstance(args[1], Queue) and hasattr(args[2], "keys")):
                return args[1], args[2]
        return None

    def hand_off(self) -> int:
        """Every message waiting in the state for one of the engine's nodes, into the engine's queue now (the
        extractor's step); how many. 0 while the engine's extractor is not running yet."""
        if self._engine is None:
            self._engine = self._find_engine()
            if self._engine is None:
                return 0
        queue, nodes = self._engine
        n = 0
        for node_id in list(nodes.keys()):
            for msg in self.state.get_message_ins(node_id=node_id, limit=1):
                queue.put(msg)
                n += 1
        return n

    def wait(self, seconds: float) -> None:
        """Until a reply is stored after the last ``clear()`` or ``seconds`` pass."""
        self.replied.wait(seconds)

    def clear(self) -> None:
        self.replied.clear()


def _params(fn) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def unexpected(grid, version: str) -> str | None:
    """What differs from the Flower this module relies on (module docstring) for the in-memory ``grid`` under Flower
    ``version``; ``None`` when nothing does."""
    if not version.startswith(FLWR_SERIES):
        return f"flwr {version}, not {FLWR_SERIES}x"
    try:
        from flwr.server.superlink.fleet.vce import vce_api
        from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
    except ImportError as e:
        return f"flwr {version} lacks {e.name or e}"
    state = getattr(grid, "state", None)
    if not isinstance(state, InMemoryLinkState):
        return f"the grid's state is a {type(state).__name__}, not an InMemoryLinkState"
    if not isinstance(getattr(state, "lock", None), type(threading.RLock())):
        # selection under a lock we can re-enter is what makes two readers safe
        return f"the state's lock is a {type(getattr(state, 'lock', None)).__name__}, not a re-entrant lock"
    if _params(getattr(state, "get_message_ins", None))[:2] != ["node_id", "limit"]:
        return "the state's get_message_ins does not take (node_id, limit, ...)"
    if len(_params(getattr(state, "store_message_res", None))) != 1:
        return "the state's store_message_res does not take (message)"
    if _params(getattr(vce_api, EXTRACTOR, None)) != ["state", "queue", "nodes_mapping", "f_stop"]:
        return f"vce_api.{EXTRACTOR} is not (state, queue, nodes_mapping, f_stop)"
    return None


def attach(grid) -> SimLink | None:
    """A :class:`SimLink` for Flower's in-memory grid of the Simulation Engine; ``None`` for any other grid, and for
    an in-memory grid of a Flower that differs from what this module relies on (then with one log line)."""
    import flwr

    try:
        from flwr.superlink.grid import InMemoryGrid
    except ImportError:  # a Flower without it has no in-memory grid of this shape: plain polling, as for any grid
        return None
    if not isinstance(grid, InMemoryGrid):
        return None
    link = getattr(getattr(grid, "state", None), "_distmoe_sim_link", None)
    if link is not None:
        return link  # attached already (its wrapped methods no longer show Flower's signatures)
    why = unexpected(grid, getattr(flwr, "__version__", "(no version)"))
    if why is not None:
        log(logging.WARNING, "server/sim_link: %s; the ServerApp polls the Simulation Engine instead (0.1 s)", why)
        return None
    link = SimLink(grid.state)
    grid.state._distmoe_sim_link = link
    return link
