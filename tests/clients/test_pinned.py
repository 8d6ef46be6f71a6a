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
