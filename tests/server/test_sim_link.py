"""The ServerApp's link to the Simulation Engine (``server/sim_link.py``) on Flower's own in-memory state, grid and
engine extractor thread (``vce_api.add_messages_to_queue``, flwr 1.42), without Ray: a pushed message is in the
engine's queue as soon as it is handed off instead of at the extractor's next 0.1 s read, every message exactly
once while both threads read, each stage gets its replies over the link, and any other grid is left to plain
polling."""

from __future__ import annotations

import logging
import threading
import time
from queue import Empty, Queue

import pytest
from flwr.app import Message, RecordDict
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid import InMemoryGrid

from server import app, sim_link


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch):
    """The identity ``run_simulation`` sets for its process (the grid's messages are created under it)."""
    from flwr.common.constant import SUPERLINK_NODE_ID

    for attr, value in (("_task_id", 11), ("_run_id", 7), ("_node_id", SUPERLINK_NODE_ID)):
        monkeypatch.setattr(TaskIdentity, attr, value)


def _grid():
    """Flower's in-memory state factory and grid as ``run_simulation._main_loop`` makes them."""
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    state = factory.state()
    run = Run.create_empty(run_id=7)
    run.primary_task_id, run.federation_id = 11, NOOP_FEDERATION_ID
    state.run_ids[run.run_id] = RunRecord(run=run)
    state.task_store[11] = Task(task_id=11, run_id=run.run_id)
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    return factory, grid


def _engine(nodes: int = 3, attach: bool = True):
    """``_grid``, its nodes as ``vce_api`` registers them, and the engine's real extractor thread filling a queue
    (no backend drains it); the link attached first (``attach``), as the ServerApp's first exchange does."""
    factory, grid = _grid()
    mapping = vce_api._register_nodes(nodes, factory)
    link = sim_link.attach(grid) if attach else None
    queue, stop = Queue(), threading.Event()
    th = threading.Thread(target=vce_api.add_messages_to_queue, args=(factory.state(), queue, mapping, stop),
                          daemon=True)
    th.start()
    return grid, link, queue, stop, th, sorted(mapping)


def _party(grid, queue: Queue, stop: threading.Event, before_reply=None) -> threading.Thread:
    """A party as the engine's worker and injector make one: takes a message from the queue and stores its reply
    (after ``before_reply(msg)``, when given)."""

    def serve():
        while not stop.is_set():
            try:
                msg = queue.get(timeout=0.05)
            except Empty:
                continue
            if before_reply is not None:
                before_reply(msg)
            reply = Message(RecordDict(), reply_to=msg)
            reply.metadata.__dict__["_message_id"] = f"r-{msg.metadata.message_id}"
            grid.state.store_message_res(reply)

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()
    return worker


def _msgs(grid, nodes):
    return [Message(RecordDict(), dst_node_id=n, message_type="train") for n in nodes]


def _in_queue(queue: Queue) -> list:
    """What the queue holds now, without waiting."""
    got = []
    while True:
        try:
            got.append(queue.get_nowait())
        except Empty:
            return got


def _drain(queue: Queue, n: int, timeout: float) -> list:
    got, end = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < end:
        try:
            got.append(queue.get(timeout=max(0.0, end - time.monotonic())))
        except Empty:
            break
    return got


def test_a_pushed_message_is_in_the_engine_queue_as_soon_as_it_is_handed_off():
    """Right after ``push_messages`` and ``hand_off`` every message is already in the engine's queue, once (without
    the hand-off only Flower's extractor puts it there, at its next read every 0.1 s, so an immediate look finds
    it almost never: this test then fails)."""
    grid, link, queue, stop, th, nodes = _engine()
    try:
        for _ in range(5):
            time.sleep(0.013)  # somewhere in the extractor's 0.1 s cycle
            grid.push_messages(_msgs(grid, nodes))
            link.hand_off()
            got = _in_queue(queue)
            assert sorted(m.metadata.dst_node_id for m in got) == nodes
        time.sleep(0.25)  # two more extractor reads: a message delivered twice would arrive here
        assert _in_queue(queue) == []
    finally:
        stop.set()
        th.join(2)


def test_every_message_is_delivered_exactly_once_while_the_extractor_and_hand_offs_all_read():
    """Flower's extractor and two threads handing off in a loop, with the interpreter switching threads every
    microsecond: each of 800 pushed messages reaches the queue once (Flower's ``get_message_ins`` alone marks a
    message delivered after releasing its lock, and two readers then both take it)."""
    import sys

    grid, link, queue, stop, th, nodes = _engine(nodes=8)
    done = threading.Event()

    def hand_offs():
        while not done.is_set():
            link.hand_off()

    readers = [threading.Thread(target=hand_offs, daemon=True) for _ in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for r in readers:
            r.start()
        ids = []
        for _ in range(100):
            ids += grid.push_messages(_msgs(grid, nodes))
        got = _drain(queue, len(ids), 10.0)
        time.sleep(0.25)  # two more extractor reads: a message delivered twice would arrive here
        got += _in_queue(queue)
    finally:
        sys.setswitchinterval(interval)
        done.set()
        stop.set()
        for r in readers:
            r.join(2)
        th.join(2)
    assert sorted(m.metadata.message_id for m in got) == sorted(ids)


def test_stages_round_trip_through_the_link():
    """The ServerApp's ``_send_and_receive`` over the link against parties that answer at once: every stage gets
    every reply (how much sooner than with the extractor's 0.1 s read and a 0.1 s pull is measured by
    ``bench/round_profile.py --ledger``, not in a test)."""
    grid, link, queue, stop, th, nodes = _engine(nodes=2)
    transport = _round_trips(grid, queue, stop, th, nodes, 5)
    assert transport.link is link


def _round_trips(grid, queue: Queue, stop: threading.Event, th: threading.Thread, nodes, n: int):
    """``n`` stages through a new ``GridTransport`` over ``grid`` (``_engine``'s) against parties that answer at
    once, each with every reply; the engine's and the parties' threads stopped after. Returns the transport."""
    party_stop = threading.Event()
    worker = _party(grid, queue, party_stop)
    try:
        transport = app.GridTransport(grid)
        for _ in range(n):
            got = transport._send_and_receive(_msgs(grid, nodes), timeout=5.0)
            assert sorted(m.metadata.src_node_id for m in got) == nodes
    finally:
        party_stop.set()
        stop.set()
        worker.join(2)
        th.join(2)
    return transport


def test_a_reply_is_handed_to_the_guards_early_check_while_a_slower_party_is_awaited():
    """``GridTransport`` gives each pulled reply to ``GuardedTransport._arrived`` while other replies are still
    awaited (so the server guard's content checks overlap the slowest party's work); the last one is left to the
    exchange, which checks and logs every reply after all are in. The slow party replies only once the early
    check has seen the fast reply (or after 5 s, which fails the test)."""
    grid, link, queue, stop, th, nodes = _engine(nodes=2)
    slow, early = nodes[1], threading.Event()

    def wait_for_early(msg):
        if msg.metadata.dst_node_id == slow:
            early.wait(5.0)

    party_stop = threading.Event()
    workers = [_party(grid, queue, party_stop, wait_for_early) for _ in range(2)]
    try:
        transport, calls = app.GridTransport(grid), []

        def arrived(node, content):
            calls.append((node, early.is_set(), content))
            early.set()

        transport._arrived = arrived
        got = transport._send_and_receive(_msgs(grid, nodes), timeout=10.0)
        assert sorted(m.metadata.src_node_id for m in got) == nodes
        assert [(c[0], c[1]) for c in calls] == [(nodes[0], False)]  # the fast reply, before the slow one came
        assert calls[0][2] is next(m.content for m in got if m.metadata.src_node_id == nodes[0])
    finally:
        party_stop.set()
        stop.set()
        for w in workers:
            w.join(2)
        th.join(2)


def test_any_other_grid_is_left_to_plain_polling():
    class Other:
        state = None

    assert sim_link.attach(Other()) is None
    assert app.GridTransport(Other()).link is None


def _flower_methods(state) -> bool:
    """Whether the state's methods are still Flower's own (no link wrapped them)."""
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    return (getattr(state.get_message_ins, "__func__", None) is InMemoryLinkState.get_message_ins
            and getattr(state.store_message_res, "__func__", None) is InMemoryLinkState.store_message_res)


def test_another_flower_version_falls_back_to_plain_polling_with_one_log_line(monkeypatch, caplog):
    """Under a Flower other than 1.42.x the link leaves the state alone and says so once; the stages still get
    every reply, from the engine's own extractor and the pull loop's polls."""
    import flwr

    monkeypatch.setattr(flwr, "__version__", "1.43.0")
    grid, link, queue, stop, th, nodes = _engine(nodes=2, attach=False)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        transport = _round_trips(grid, queue, stop, th, nodes, 3)
    assert transport.link is None and _flower_methods(grid.state)
    lines = [r.getMessage() for r in caplog.records if "sim_link" in r.getMessage()]
    assert len(lines) == 1 and "flwr 1.43.0, not 1.42.x" in lines[0] and "polls" in lines[0], lines


@pytest.mark.parametrize("change, said", [
    (lambda state: setattr(state, "lock", threading.Lock()), "not a re-entrant lock"),
    (lambda state: delattr(state, "lock"), "NoneType, not a re-entrant lock"),
    (lambda state: setattr(state, "get_message_ins", lambda node_id: []), "get_message_ins does not take"),
    (lambda state: setattr(state, "store_message_res", lambda message, extra: None), "store_message_res does not"),
])
def test_a_state_without_the_expected_shape_falls_back(change, said, caplog):
    """An in-memory state that differs from flwr 1.42's (the lock the wrapped selection re-enters, the methods' and
    their arguments' shape) is left unwrapped, with one log line naming what differs: ``attach`` gives ``None``."""
    factory, grid = _grid()
    change(grid.state)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert sim_link.attach(grid) is None
    lines = [r.getMessage() for r in caplog.records if "sim_link" in r.getMessage()]
    assert len(lines) == 1 and said in lines[0], lines
    assert not hasattr(grid.state, "_distmoe_sim_link")


def test_the_shape_of_flower_142_is_recognised():
    """The check passes on Flower's own 1.42 state (else every simulation would poll: the fallback tests above
    could then pass for the wrong reason)."""
    factory, grid = _grid()
    assert sim_link.unexpected(grid, "1.42.0") is None
    assert _flower_methods(grid.state)
    link = sim_link.attach(grid)
    assert link is not None and sim_link.attach(grid) is link and not _flower_methods(grid.state)
