"""The coordinator's SuperLink launcher (``server/superlink.py``): Flower's SuperLink with its object store (message
content) in memory, and its link state in memory with the SuperNode registrations written through to the
``--database`` it is given (``--link-state memory``, the default), or Flower's link state in that database
(``--link-state database``)."""

from __future__ import annotations

import sqlite3

import pytest
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState
from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore
from flwr.supercore.object_store.sql_object_store import SqlObjectStore
from flwr.superlink import config_loader
from flwr.superlink import main as superlink_main

from server import superlink

KEY_A, KEY_B = b"owner-a public key", b"owner-b public key"


@pytest.fixture
def loader(monkeypatch):
    """Flower's loader and the SuperLink's main module, restored after the test."""
    for module in (config_loader, superlink_main):
        monkeypatch.setattr(module, "get_objectstore_linkstate_factories",
                            module.get_objectstore_linkstate_factories)
    return config_loader


def _state(loader, db: str):
    """A fresh SuperLink's link state on ``db`` (what a started or restarted SuperLink builds)."""
    _, links = loader.get_objectstore_linkstate_factories(db, loader.get_federation_manager())
    return links.state()


def _rows(db) -> dict[bytes, tuple[int, str]]:
    """Flower's node table in the database file, read with sqlite3 alone: {public key: (node id, status)}."""
    with sqlite3.connect(str(db)) as con:
        return {key: (nid, status) for nid, status, key in con.execute("SELECT node_id, status, public_key FROM node")}


@pytest.mark.parametrize("link_state", ["memory", "database"])
def test_flower_keeps_message_content_in_the_database_file_and_the_launcher_keeps_it_in_memory(loader, tmp_path,
                                                                                               link_state):
    db = str(tmp_path / "state.db")
    objects, links = loader.get_objectstore_linkstate_factories(db, loader.get_federation_manager())
    assert isinstance(objects.store(), SqlObjectStore)  # flwr 1.42 on its own: every message's arrays in SQLite
    assert isinstance(links.state(), SqlLinkState)  # and every run, message, claim and traffic count
    superlink.memory_state(loader, superlink_main, link_state=link_state)
    for module in (loader, superlink_main):  # main.py imported the function by name: both are replaced
        path = tmp_path / f"{module.__name__}.db"
        objects, links = module.get_objectstore_linkstate_factories(str(path), loader.get_federation_manager())
        store, state = objects.store(), links.state()
        assert isinstance(store, InMemoryObjectStore)
        assert state.object_store is store and links.state() is state  # one state per SuperLink, as Flower's
        if link_state == "memory":
            assert isinstance(state, InMemoryLinkState) and not isinstance(state, SqlLinkState)
            assert isinstance(state.registrations, SqlLinkState)  # the registrations' copy in the file
        else:
            assert isinstance(state, SqlLinkState)  # Flower's link state, in the file
        assert path.is_file()


def test_registrations_survive_a_restart_under_the_same_node_ids_and_unregistrations_too(loader, tmp_path):
    db = tmp_path / "state.db"
    superlink.memory_state(loader, superlink_main)
    first = _state(loader, str(db))
    a = first.create_node("coordinator", "coordinator", KEY_A, 10.0, name="hospital-a")
    b = first.create_node("coordinator", "coordinator", KEY_B, 10.0, name="hospital-b")
    assert first.get_node_id_by_public_key(KEY_A) == a and first.activate_node(a, 10.0)
    assert _rows(db) == {KEY_A: (a - 2**64 if a >= 2**63 else a, "registered"),
                         KEY_B: (b - 2**64 if b >= 2**63 else b, "registered")}  # Flower's sint64 column
    first.delete_node("coordinator", b)
    assert _rows(db)[KEY_B][1] == "unregistered" and first.get_node_id_by_public_key(KEY_B) is None

    again = _state(loader, str(db))  # the SuperLink restarted on the same database
    assert again is not first
    assert again.get_node_id_by_public_key(KEY_A) == a  # the owner's SuperNode is let in under its node ID
    assert again.get_node_id_by_public_key(KEY_B) is None  # an unregistered one stays out
    assert again.activate_node(a, 10.0)  # its SuperNode comes online again
    assert {n.name for n in again.get_node_info()} == {"hospital-a", "hospital-b"}
    with pytest.raises(ValueError, match="already in use"):  # a key, once used, is refused again, as Flower does
        again.create_node("coordinator", "coordinator", KEY_B, 10.0)
    assert len(again.nodes) == 2 and len(_rows(db)) == 2  # nothing kept of the refused registration
    stock = SqlLinkState(str(db), loader.get_federation_manager(), InMemoryObjectStore())
    stock.initialize()  # the file is Flower's own: a stock SuperLink (--link-state database) reads the same nodes
    assert {n.node_id for n in stock.get_node_info()} == {a, b}


def test_runs_and_messages_are_not_written_to_the_database(loader, tmp_path):
    """The point of the memory link state: a run, its messages, claims and traffic counts never reach SQLite."""
    db = tmp_path / "state.db"
    superlink.memory_state(loader, superlink_main)
    state = _state(loader, str(db))
    node = state.create_node("coordinator", "coordinator", KEY_A, 10.0)
    before = db.read_bytes() + (db.with_name("state.db-wal").read_bytes() if db.with_name("state.db-wal").exists()
                                else b"")
    for _ in range(50):  # what each SuperNode's ask for a message and each request's run check do
        state.get_node_id_by_public_key(KEY_A)
        state.acknowledge_node_heartbeat(node, 10.0)
        state.get_run_status(set())
    after = db.read_bytes() + (db.with_name("state.db-wal").read_bytes() if db.with_name("state.db-wal").exists()
                               else b"")
    assert after == before


def test_the_launchers_own_flag_is_taken_out_of_flowers_arguments():
    assert superlink.split_link_state(["--port", "9092"]) == ("memory", ["--port", "9092"])
    assert superlink.split_link_state(["--link-state", "database", "--port", "9092"]) == ("database",
                                                                                         ["--port", "9092"])
    assert superlink.split_link_state(["--link-state=memory"]) == ("memory", [])
    with pytest.raises(SystemExit, match="'disk' is not one of memory, database"):
        superlink.split_link_state(["--link-state", "disk"])


def test_a_database_url_that_is_not_sqlite_is_left_to_flower(loader):
    superlink.memory_state(loader, superlink_main)
    with pytest.raises(ValueError, match="Unsupported value for `--database`"):
        loader.get_objectstore_linkstate_factories("postgresql://db.example.org/flwr", loader.get_federation_manager())
