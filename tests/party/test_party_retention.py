"""The party's retention context: per-task anchors checked against the model, protected experts, the pre-task
model kept in its own work directory (only the weights whose hash the coordinator named), the warm-up offset."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distmoe.model.build import hash_tensors
from distmoe.party.retention import drop_pretask, round_retention
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
    # the run completed (distmoe simulate): the copy goes, the rest of the work directory stays
    (tmp_path / "retention" / "other.json").write_text("{}")
    size = (tmp_path / "retention" / f"pretask-{ref2[:32]}.safetensors").stat().st_size
    assert drop_pretask(tmp_path) == size > 0 and drop_pretask(tmp_path) == 0
    assert [p.name for p in (tmp_path / "retention").iterdir()] == ["other.json"]


def test_after_an_expansion_every_expert_but_the_newest_k_is_frozen(make_cfg, tmp_path):
    cfg = make_cfg(**{"retention.expand-experts": 2})
    assert round_retention(cfg, tmp_path, _instr(), 2, 4, base_experts=4) is None  # not expanded (yet)
    r = round_retention(cfg, tmp_path, _instr(), 2, 8, base_experts=4)  # two expansions: 4 -> 6 -> 8
    assert r.frozen.tolist() == [[True] * 6 + [False] * 2] * 2 and "6 of 8 experts frozen" in r.notes[0]


def test_a_party_grows_its_base_to_the_weights_and_refuses_a_count_off_the_schedule(make_cfg, tmp_path):
    from distmoe.config import parse_node_config
    from distmoe.model.base import clear_cache
    from distmoe.model.build import build_model, describe
    from distmoe.model.expand import expand_experts
    from distmoe.model.trainable import apply_trainable, trainable_state
    from distmoe.party.work import PartyError, prepare_model

    cfg = make_cfg(**{"retention.expand-experts": 2, "schedule.phases": "sft:a, sft:b"})
    node = parse_node_config({"data-path": str(tmp_path), "party-name": "p", "work-dir": str(tmp_path / "w")}, cfg.sim)
    server, _ = build_model(cfg.model)
    server = apply_trainable(server, cfg.model)
    expand_experts(server, [[1, 2], [0, 3]])
    weights = {k: v.numpy() for k, v in trainable_state(server).items()}
    clear_cache()
    try:
        model, _, spec = prepare_model(cfg, node, weights, "")
        assert describe(model).num_experts == 6 and dict(spec.shapes) == {k: v.shape for k, v in weights.items()}
        for k, v in trainable_state(model).items():
            assert np.array_equal(v.numpy(), weights[k])  # the server's values, not the party's own copies
        # 8 experts: a count this run's schedule (4 -> 6) never reaches
        expand_experts(server, [[0, 0], [0, 0]])
        bad = {k: v.numpy() for k, v in trainable_state(server).items()}
        with pytest.raises(PartyError, match=r"retention.expand-experts.*\[4, 6\]"):
            prepare_model(cfg, node, bad, "")
        # the next run in this process, without expansion, gets the base as built, not the grown cached one
        plain = make_cfg(**{"schedule.phases": "sft:a, sft:b"})
        base, _ = build_model(plain.model)
        base = apply_trainable(base, plain.model)
        orig = {k: v.numpy() for k, v in trainable_state(base).items()}
        model, _, spec = prepare_model(plain, node, orig, "")
        assert describe(model).num_experts == 4 and dict(spec.shapes) == {k: v.shape for k, v in orig.items()}
    finally:
        clear_cache()
