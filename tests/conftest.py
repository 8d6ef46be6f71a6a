"""Shared fixtures for the unit tests: a tiny model config and small synthetic party data."""

from __future__ import annotations

import os
import tempfile

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
        "model.kv-heads": 1, "model.head-dim": 32, "model.experts": 4, "model.top-k": 2}


def tiny_cfg(**overrides):
    """A validated RunConfig for the tiny model; overrides use flat run-config keys."""
    return parse_run_config({**TINY, **overrides})


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
