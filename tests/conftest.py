"""Shared fixtures for every test: the tiny model config (as flat run-config keys and as a RunConfig), the
settings of a short in-process run, and small synthetic party data; cache directories out of the home directory.

Test folders mirror the package (``tests/<subpackage>/test_<module>.py``); a folder's own ``conftest.py`` holds
what only its tests share. ``pytest`` alone runs the fast suite; whole runs carry the ``integration`` marker
(in process) or ``slow`` (Flower engines, real processes) and run with ``-m "slow or integration"``.

Must not: be imported by test modules (they ask for fixtures by name), or hold a test.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from types import MappingProxyType

# Tests keep every cache out of the home directory (matplotlib's font cache, Hugging Face).
_CACHE = tempfile.mkdtemp(prefix="distmoe-test-cache-")
os.environ.setdefault("MPLCONFIGDIR", os.path.join(_CACHE, "mpl"))
os.environ.setdefault("HF_HOME", os.path.join(_CACHE, "hf"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from distmoe.config import parse_run_config  # noqa: E402

torch.set_num_threads(1)

TINY = {"model.hidden-size": 64, "model.moe-intermediate-size": 64, "model.layers": 2, "model.heads": 2,
        "model.kv-heads": 1, "model.head-dim": 32, "model.experts": 4, "model.top-k": 2,
        # the per-round routing probe (default on) is off here so that tests pin each exchange they expect;
        # tests/coordinator/test_probe_runs.py runs whole schedules with it on
        "routing.probe-every": 0,
        # a checkpoint every round, so that tests pin each resume point they expect; the cadence's own tests set it
        "checkpoint.every": 1}
# a whole in-process run of the tiny model that takes seconds: 3 parties, 2 local steps, 1 round per phase
TINY_RUN = {**TINY, "train.local-steps": 2, "train.batch-size": 4, "data.max-eval-examples": 3,
            "eval.max-new-tokens": 2, "eval.batch-size": 8, "federation.wait-timeout": 1.0, "schedule.sft-rounds": 1,
            "federation.min-available": 3}


def tiny_cfg(**overrides):
    """A validated RunConfig for the tiny model; overrides use flat run-config keys."""
    return parse_run_config({**TINY, **overrides})


@pytest.fixture(scope="session")
def tiny() -> Mapping:
    """The tiny model as flat run-config keys (read-only: merge it, ``{**tiny, ...}``)."""
    return MappingProxyType(TINY)


@pytest.fixture(scope="session")
def tiny_run() -> Mapping:
    """Flat run-config keys of a short whole run of the tiny model with 3 parties (read-only)."""
    return MappingProxyType(TINY_RUN)


@pytest.fixture
def cfg():
    return tiny_cfg()


@pytest.fixture(scope="session")
def make_cfg():
    """``make_cfg(**{"flat.key": value})`` -> tiny RunConfig with those overrides."""
    return tiny_cfg


@pytest.fixture(scope="session")
def synth_dirs(tmp_path_factory):
    """Two party directories of synthetic data (24 examples per task), written once per session.

    Tests must not modify them (copy first).
    """
    from distmoe.data.synth import write_synthetic

    return write_synthetic(tmp_path_factory.mktemp("synth"), parties=2, examples_per_task=24, seed=0)
