"""The owner's pinned ``flwr-clientapp`` (``clients/pinned.py``) replaces two module functions of flwr 1.42's ClientApp
runtime: the FAB installation (checked against the pin) and the message pull (a short back-off). A Flower that
moves either fails here: the pin check or the short back-off would otherwise be silently skipped."""

from __future__ import annotations

import inspect

from flwr.supernode.runtime import run_clientapp as rc

from clients import pinned


def test_flowers_clientapp_installs_the_bundle_through_the_module_function_the_pin_check_replaces():
    assert "install_from_fab(fab.content" in inspect.getsource(rc.run_clientapp)
    assert "rc.install_from_fab = " in inspect.getsource(pinned.main)


def test_flowers_clientapp_pulls_its_message_through_the_module_function_the_launcher_shortens():
    assert "pull_and_inflate_object_from_tree(" in inspect.getsource(rc.pull_task_input)
    params = inspect.signature(rc.pull_and_inflate_object_from_tree).parameters
    assert params["initial_backoff"].default >= 1 and "backoff_cap" in params
    assert pinned.PULL_BACKOFF_S < params["initial_backoff"].default and pinned.PULL_BACKOFF_CAP_S <= 0.5


def test_flower_moves_a_messages_objects_through_the_worker_count_the_launchers_raise():
    """flwr 1.42 pulls and pushes a message's objects on ``get_num_workers(...)`` threads (min(2, CPU count));
    with the launchers' count, 8 objects that each take 0.2 s to arrive come in about 0.2 s, not 0.8 s."""
    import time
    import types

    from flwr.supercore.inflatable import inflatable_utils

    for fn in (inflatable_utils.pull_objects, inflatable_utils.push_object_contents_from_iterable):
        assert "num_workers = get_num_workers(" in inspect.getsource(fn)
    utils = types.SimpleNamespace(get_num_workers=inflatable_utils.get_num_workers)
    pinned.more_transfers(utils)
    assert utils.get_num_workers(2) == pinned.OBJECT_TRANSFERS >= 8

    def slow(object_id):
        time.sleep(0.2)
        return object_id.encode()

    original = inflatable_utils.get_num_workers
    try:
        inflatable_utils.get_num_workers = utils.get_num_workers
        t0 = time.monotonic()
        got = inflatable_utils.pull_objects([str(i) for i in range(8)], slow)
        assert len(got) == 8 and time.monotonic() - t0 < 0.6
    finally:
        inflatable_utils.get_num_workers = original
