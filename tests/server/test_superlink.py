"""The coordinator's SuperLink launcher (``server/superlink.py``): Flower's SuperLink with its object store (message
content) in memory and its link state (runs, registered SuperNodes) in the ``--database`` it is given."""

from __future__ import annotations

import pytest
from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState
from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore
from flwr.supercore.object_store.sql_object_store import SqlObjectStore
from flwr.superlink import config_loader
from flwr.superlink import main as superlink_main

from server import superlink


@pytest.fixture
def loader(monkeypatch):
    """Flower's loader and the SuperLink's main module, restored after the test."""
    for module in (config_loader, superlink_main):
        monkeypatch.setattr(module, "get_objectstore_linkstate_factories",
                            module.get_objectstore_linkstate_factories)
    return config_loader


def test_flower_keeps_message_content_in_the_database_file_and_the_launcher_keeps_it_in_memory(loader, tmp_path):
    db = str(tmp_path / "state.db")
    objects, _ = loader.get_objectstore_linkstate_factories(db, loader.get_federation_manager())
    assert isinstance(objects.store(), SqlObjectStore)  # flwr 1.42 on its own: every message's arrays in SQLite
    superlink.memory_object_store(loader, superlink_main)
    for module in (loader, superlink_main):  # main.py imported the function by name: both are replaced
        objects, links = module.get_objectstore_linkstate_factories(str(tmp_path / f"{module.__name__}.db"),
                                                                     loader.get_federation_manager())
        store, state = objects.store(), links.state()
        assert isinstance(store, InMemoryObjectStore)
        assert isinstance(state, SqlLinkState) and state.object_store is store  # the link state stays in the file
        assert (tmp_path / f"{module.__name__}.db").is_file()


def test_a_database_url_that_is_not_sqlite_is_left_to_flower(loader):
    superlink.memory_object_store(loader, superlink_main)
    with pytest.raises(ValueError, match="Unsupported value for `--database`"):
        loader.get_objectstore_linkstate_factories("postgresql://db.example.org/flwr", loader.get_federation_manager())
