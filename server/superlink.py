"""The coordinator's ``flower-superlink`` with its working state in memory (``distmoe deploy superlink``).

flwr 1.42's SuperLink keeps two things in the ``--database`` it is given: its object store, the content of every
message in flight (each array of a model-carrying message, 28 MB and more), and its link state: the registered
SuperNodes, the runs, and every message's metadata, claim and traffic count. With a SQLite file every request of
every process goes through SQLAlchemy and SQLite, most of them as write transactions under SQLite's one-writer
lock: each SuperNode's ask for a message claims rows, each object pushed or pulled counts its bytes, and each
request's check that its run is still running first clears expired task tokens. Measured with
``bench/deploy_round.py --trace`` on a 2-core machine, a message took a median 3.64 s from the ServerApp's push to
its reply with that state in SQLite and 1.79 s with it in memory.

This launcher runs Flower's own ``flower-superlink`` entry point unchanged but for which state it is given:

- **memory** (the default): the object store and the link state are Flower's in-memory ones (those of a SuperLink
  started without ``--database``), and only the SuperNode registrations are also kept in the database, in
  Flower's own SQLite schema (:class:`RegistrationsInDatabase`): each registration and unregistration is written
  there before Flower's in-memory state takes it, and a SuperLink restarted on the same database starts with
  every registration it holds, under the same node IDs. Runs and messages are not kept: a Flower 1.42 run does not
  survive its SuperLink anyway (the SuperExec exits with it and no ServerApp is started for the run again), and
  distmoe continues an interrupted run as a new Flower run (``run.resume``). What a restart loses: the list of
  earlier runs (``flwr ls``) and their logs (``flwr log``).
- **database**: Flower's SQLite link state in the database, the object store in memory (the content of messages in
  flight is worth nothing after a restart). Runs stay listed after a restart.

Must not: change anything of Flower's but which state its SuperLink uses, or import anything of distmoe.
"""

from __future__ import annotations

import sys

LINK_STATES = ("memory", "database")


def registrations_in_database():
    """:class:`RegistrationsInDatabase`, defined once Flower is imported (the launcher imports it only in ``main``)."""
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
    from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState

    class RegistrationsInDatabase(InMemoryLinkState):
        """Flower's in-memory link state whose SuperNode registrations are written through to, and read back at
        start from, Flower's SQLite link state in ``database`` (the table ``flower-superlink --database`` keeps).

        Only ``create_node`` and ``delete_node`` (``flwr supernode register|unregister``) write the database; a
        node's activation, heartbeats and going offline stay in memory, as the runs and messages do. A
        registration the database refuses (a public key already in use) is refused, and nothing is kept in memory.
        """

        def __init__(self, database: str, federation_manager, object_store) -> None:
            self.registrations = SqlLinkState(database, federation_manager, object_store)
            self.registrations.initialize()  # Flower's migrations: the same file a stock SuperLink reads
            super().__init__(federation_manager, object_store)  # after: federation_manager.linkstate is this one
            for info in self.registrations.get_node_info():  # every node, unregistered ones too (keys stay used)
                self._hold(info)

        def _hold(self, info) -> None:
            with self.lock:
                self.nodes[info.node_id] = info
                self.node_public_key_to_node_id[info.public_key] = info.node_id
                self.owner_to_node_ids.setdefault(info.owner_aid, set()).add(info.node_id)

        def create_node(self, owner_aid: str, owner_name: str, public_key: bytes, heartbeat_interval: float, *,
                        location: str | None = None, name: str | None = None) -> int:
            with self.lock:
                node_id = self.registrations.create_node(owner_aid, owner_name, public_key, heartbeat_interval,
                                                         location=location, name=name)
                if node_id:  # Flower's 0: an ID collision, logged by Flower, nothing stored
                    self._hold(self.registrations.get_node_info(node_ids=[node_id])[0])
                return node_id

        def delete_node(self, owner_aid: str, node_id: int) -> None:
            with self.lock:
                self.registrations.delete_node(owner_aid, node_id)  # ValueError as Flower's when it is not one
                super().delete_node(owner_aid, node_id)

    return RegistrationsInDatabase


def memory_state(loader, *users, link_state: str = "memory") -> None:
    """Flower's SuperLink config loader (``flwr.superlink.config_loader``), and each module in ``users`` that
    imported its factory function by name, made to keep the object store in memory and the link state as
    ``link_state`` says (module docstring), for a SQLite database (a non-SQLite URL, Flower's enterprise back-ends,
    is left as it is)."""
    if link_state not in LINK_STATES:
        raise ValueError(f"--link-state: {link_state!r} is not one of {', '.join(LINK_STATES)}")
    factory, make = loader.ObjectStoreFactory, loader.get_objectstore_linkstate_factories
    state_class = registrations_in_database() if link_state == "memory" else None

    class RegistrationsFactory(loader.LinkStateFactory):
        def state(self):
            if self.state_instance is None:  # built once, on the first request, as Flower's factory does
                with self._state_lock:
                    if self.state_instance is None:
                        self.state_instance = state_class(self.database, self.federation_manager,
                                                          self.objectstore_factory.store())
            return self.state_instance

    def factories(database, federation_manager):
        if loader._is_non_sqlite_database_url(database):
            return make(database, federation_manager)
        objects = factory()  # no database: Flower's InMemoryObjectStore
        links = RegistrationsFactory if state_class is not None else loader.LinkStateFactory
        return objects, links(database, federation_manager, objects)

    for module in (loader, *users):
        module.get_objectstore_linkstate_factories = factories


def split_link_state(argv: list[str]) -> tuple[str, list[str]]:
    """The launcher's own ``--link-state memory|database`` (default memory) and the arguments left for Flower."""
    rest, link_state, i = [], "memory", 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--link-state" and i + 1 < len(argv):
            link_state, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--link-state="):
            link_state = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    if link_state not in LINK_STATES:
        raise SystemExit(f"server.superlink: --link-state: {link_state!r} is not one of {', '.join(LINK_STATES)}")
    return link_state, rest


def main(argv: list[str] | None = None) -> None:
    from flwr.superlink import config_loader
    from flwr.superlink import main as superlink_main
    from flwr.superlink.cli import flower_superlink

    link_state, rest = split_link_state(sys.argv[1:] if argv is None else argv)
    memory_state(config_loader, superlink_main, link_state=link_state)
    sys.argv = ["flower-superlink", *rest]
    flower_superlink()


if __name__ == "__main__":
    main()
