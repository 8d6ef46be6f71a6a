"""The coordinator's ``flower-superlink`` with message content kept in memory (``distmoe deploy superlink``).

flwr 1.42's SuperLink keeps two things in the ``--database`` it is given: its link state (runs, registered
SuperNodes, message metadata, small rows) and its object store, the content of every message in flight (each
array of a model-carrying message, 28 MB and more). With a SQLite file both go to disk: every object is written into
the database's write-ahead log, copied into the database at its checkpoint, read back out when a SuperNode or the
ServerApp pulls it, and deleted once delivered, each under SQLite's one-writer lock (a ``database is locked`` answer
under load is one symptom). Message content is worth nothing after a restart: a Flower 1.42 run does not survive its
SuperLink (the SuperExec exits with it and no ServerApp is started for the run again), so the content of its
messages in flight can never be delivered after one. This launcher runs Flower's own ``flower-superlink`` entry
point unchanged, with its object store created in memory (Flower's ``InMemoryObjectStore``, the store of a SuperLink
started without ``--database``) while the link state stays in the database: runs and registrations survive a
restart as before. Memory: the content of the messages in flight, which Flower deletes once delivered (about the
instructions of one stage to every party plus their replies).

Must not: change anything of Flower's but which object store its SuperLink uses, or import anything of distmoe.
"""

from __future__ import annotations

import sys


def memory_object_store(loader, *users) -> None:
    """Flower's SuperLink config loader (``flwr.superlink.config_loader``), and each module in ``users`` that
    imported its factory function by name, made to keep the link state in the database it is given and the object
    store in memory, for a SQLite database (a non-SQLite URL, Flower's enterprise back-ends, is left as it is)."""
    factory, make = loader.ObjectStoreFactory, loader.get_objectstore_linkstate_factories

    def factories(database, federation_manager):
        if loader._is_non_sqlite_database_url(database):
            return make(database, federation_manager)
        objects = factory()  # no database: Flower's InMemoryObjectStore
        return objects, loader.LinkStateFactory(database, federation_manager, objects)

    for module in (loader, *users):
        module.get_objectstore_linkstate_factories = factories


def main(argv: list[str] | None = None) -> None:
    from flwr.superlink import config_loader
    from flwr.superlink import main as superlink_main
    from flwr.superlink.cli import flower_superlink

    memory_object_store(config_loader, superlink_main)
    sys.argv = ["flower-superlink", *(sys.argv[1:] if argv is None else argv)]
    flower_superlink()


if __name__ == "__main__":
    main()
