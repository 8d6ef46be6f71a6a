"""The party's retention context: per-task anchors checked against the model, protected experts, the pre-task
model kept in its own work directory (only the weights whose hash the coordinator named), the warm-up offset."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distmoe.model.build import hash_tensors
from distmoe.party.retention import round_retention
from distmoe.wire.schema import SftInstruction

W = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}


def _instr(weights=W, **kw) -> SftInstruction:
    return SftInstruction(round=3, task="b", weights=weights, base_hash="h", seed=0, anchor=None, anchor_version=0,
                          **kw)


def test_nothing_on_gives_no_context(make_cfg, tmp_path):
    anchors = np.full((1, 2, 4), 0.25, np.float32)
    assert round_retention(make_cfg(), tmp_path, _instr(task_anchors=anchors), 2, 4) is None


def test_anchors_protection_and_warm_up_offset(make_cfg, tmp_path):
    cfg = make_cfg(**{"retention.task-anchors": "sum", "retention.protect-mass": 0.5, "train.local-steps": 7,
                      "train.router-warmup-steps": 10})
    anchors = np.full((2, 2, 4), 0.1, np.float32)
    anchors[0, 1, 3] = 0.7
    r = round_retention(cfg, tmp_path, _instr(task_anchors=anchors, task_round=3), 2, 4)
    assert r.task_anchor_reduce == "sum" and r.task_anchors.shape == (2, 2, 4)
    assert r.protected.nonzero().tolist() == [[1, 3]] and r.task_step_offset == 14
    with pytest.raises(ValueError, match=r"expected \[T >= 1, 2, 4\]"):
        round_retention(cfg, tmp_path, _instr(task_anchors=np.full((1, 3, 4), 0.25, np.float32)), 2, 4)


def test_the_pre_task_model_is_kept_from_the_weights_the_coordinator_named(make_cfg, tmp_path):
    cfg = make_cfg(**{"retention.distill-weight": 1.0})
    ref = hash_tensors({k: torch.from_numpy(v) for k, v in W.items()})
    # a party that missed the task's first round: later weights, no file -> no distillation
    later = {"w": W["w"] + 1}
    r = round_retention(cfg, tmp_path, _instr(later, ref_hash=ref), 2, 4)
    assert r is None or r.ref_state is None
    assert not (tmp_path / "retention").exists()
    # the first round: the received weights are the pre-task model; kept
    r = round_retention(cfg, tmp_path, _instr(W, ref_hash=ref), 2, 4)
    assert torch.equal(r.ref_state["w"], torch.from_numpy(W["w"]))
    (kept,) = (tmp_path / "retention").glob("pretask-*.safetensors")
    # later rounds of the task load it, whatever weights they carry
    r = round_retention(cfg, tmp_path, _instr(later, ref_hash=ref), 2, 4)
    assert torch.equal(r.ref_state["w"], torch.from_numpy(W["w"]))
    # the next task replaces it
    ref2 = hash_tensors({k: torch.from_numpy(v) for k, v in later.items()})
    round_retention(cfg, tmp_path, _instr(later, ref_hash=ref2), 2, 4)
    assert [p.name for p in (tmp_path / "retention").glob("pretask-*")] == [f"pretask-{ref2[:32]}.safetensors"]
    # no hash named (the first task, or distillation off at the coordinator): nothing kept or used
    assert round_retention(cfg, tmp_path, _instr(W), 2, 4) is None
