"""Unit tests: a party's routing probe is a function of the instruction alone (public prompts, received weights),
never of the party's private data."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from distmoe.config import parse_node_config
from distmoe.data.synth import write_synthetic
from distmoe.model.adapters import server_model
from distmoe.party.probe import run_probe
from distmoe.party.service import PartyService
from distmoe.routing.probe import default_probe_prompts
from distmoe.wire.schema import ProbeInstruction, ProbeReply


@pytest.fixture(scope="module")
def instruction(make_cfg):
    cfg = make_cfg(**{"privacy.mode": "secagg"})
    sm = server_model(cfg.model)
    weights = {k: v.numpy() for k, v in sm.weights.items()}
    return cfg, ProbeInstruction(round=3, base_hash=sm.tspec.base_hash, prompts=default_probe_prompts(0, 6),
                                 weights=weights)


def _node(cfg, tmp, data):
    return parse_node_config({"data-path": str(data), "party-name": "party-0", "work-dir": str(tmp / "work")}, cfg.sim)


def test_probe_ignores_the_party_data(instruction, tmp_path):
    cfg, instr = instruction
    dirs = write_synthetic(tmp_path / "a", parties=1, examples_per_task=24, seed=0)
    first = run_probe(cfg, _node(cfg, tmp_path, dirs[0]), instr)
    # other private data (another seed, other tasks), then none at all: the same reply
    shutil.rmtree(dirs[0])
    write_synthetic(tmp_path / "a", parties=1, examples_per_task=40, seed=5, tasks=("strings",))
    second = run_probe(cfg, _node(cfg, tmp_path, dirs[0]), instr)
    shutil.rmtree(dirs[0])
    dirs[0].mkdir()  # an empty data directory
    third = run_probe(cfg, _node(cfg, tmp_path, dirs[0]), instr)
    for other in (second, third):
        np.testing.assert_array_equal(other.routing, first.routing)
        np.testing.assert_array_equal(other.top1, first.top1)


def test_probe_measures_the_received_weights(instruction, tmp_path):
    cfg, instr = instruction
    node = _node(cfg, tmp_path, tmp_path)
    base = run_probe(cfg, node, instr)
    rng = np.random.default_rng(0)
    moved = {k: (v + rng.normal(0, 0.5, v.shape)).astype(np.float32) if "gate" in k else v
             for k, v in instr.weights.items()}
    other = run_probe(cfg, node, ProbeInstruction(instr.round, instr.base_hash, instr.prompts, moved))
    assert not np.allclose(other.routing, base.routing)


def test_probe_is_answered_in_a_secure_run_without_a_session_or_a_charge(instruction, tmp_path):
    cfg, instr = instruction
    dirs = write_synthetic(tmp_path / "d", parties=1, examples_per_task=24, seed=0)
    svc = PartyService(cfg, _node(cfg, tmp_path, dirs[0]), node_id=7, run_id="r")
    reply, dp = svc.answer("query.probe", instr)
    assert isinstance(reply, ProbeReply) and dp is None and reply.party == "party-0"
