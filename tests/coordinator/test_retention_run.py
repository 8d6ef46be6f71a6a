"""Retention on the coordinator: per-task anchors in the round state and its checkpoint, what an sft instruction
carries, and one whole in-process continual run with every retention switch on under secure aggregation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from distmoe.audit import audit_run
from distmoe.config import parse_schedule
from distmoe.coordinator.retention import earlier_anchors
from distmoe.coordinator.state import RoundState, StateError, from_checkpoint, to_checkpoint
from distmoe.model.build import build_model, hash_tensors
from distmoe.model.trainable import apply_trainable
from distmoe.routing.anchor import Anchor, AnchorVersion
from distmoe.routing.retention import protected_experts
from distmoe.train.retention import expert_slice_masks

PHASES = parse_schedule("sft:arith, stats:arith, sft:lookup, stats:lookup, sft:strings", 1)


def _anchor(version: int, task: str, p0: float) -> Anchor:
    meta = AnchorVersion(version=version, round=2 * version, source_checkpoint="h",
                         router_spec={"moe_layers": [0], "num_experts": 2}, num_sequences=10.0, task=task)
    return Anchor(np.array([[p0, 1 - p0]], np.float32), meta)


def test_per_task_anchors_survive_the_checkpoint_and_are_sent_oldest_first():
    s = RoundState(round=4, weights={"w": torch.zeros(2)}, anchor=_anchor(2, "lookup", 0.4), anchor_versions=2,
                   task_anchors={"lookup": _anchor(2, "lookup", 0.4), "arith": _anchor(1, "arith", 0.9)})
    state, tensors = to_checkpoint(s, PHASES, run_id="r", session="s", epoch=0)
    back = from_checkpoint(json.loads(json.dumps(state)), {"w": torch.zeros(2)}, tensors, run_id="r", where="c")
    assert set(back.task_anchors) == {"arith", "lookup"}
    assert back.task_anchors["arith"].meta == s.task_anchors["arith"].meta
    stack = earlier_anchors(back, "strings")
    assert stack.shape == (2, 1, 2) and np.allclose(stack[:, 0, 0], [0.9, 0.4])  # arith (v1) first
    assert np.allclose(earlier_anchors(back, "lookup")[:, 0, 0], [0.9])  # never the task now training
    assert earlier_anchors(RoundState(), "arith") is None
    with pytest.raises(StateError, match="anchor of task 'lookup'"):
        from_checkpoint(json.loads(json.dumps(state)), {}, {"anchor": tensors["anchor"]}, run_id="r", where="c")


ALL_ON = {"retention.task-anchors": "mean", "retention.protect-mass": 0.25, "retention.protect-lr-scale": 0.0,
          "retention.distill-weight": 1.0, "train.router-warmup-steps": 1, "train.expert-schedule": "cosine",
          "train.router-lr-scale": 0.5, "checkpoint.keep": 20}


@pytest.mark.integration
def test_continual_run_with_every_retention_switch_completes_under_secure_aggregation(tmp_path, make_run):
    schedule = "sft:arith, stats:arith, sft:strings, stats:strings, sft:lookup, eval"
    coord, _, run_dir, _, lines = make_run(tmp_path, {"schedule.phases": schedule, **ALL_ON})
    record = coord.run()
    assert record["status"] == "completed", lines[-5:]
    assert coord.cfg.privacy.mode == "secagg"
    assert audit_run(run_dir).verdict == "pass"
    # the coordinator kept one anchor per task, and the last sft instruction carried both earlier ones
    assert set(coord.s.task_anchors) == {"arith", "strings"}
    ledger = [json.loads(x) for x in (run_dir / "work" / "party-0" / "ledger" / "party-0.jsonl").read_text()
              .splitlines() if x]
    sft_in = [e for e in ledger if e.get("direction") == "in" and e.get("payload_type") == "sft-instruction"]
    assert len(sft_in) == 3
    L, E = coord.mspec.num_moe_layers, coord.mspec.num_experts
    assert "task_anchors.probs" not in sft_in[0]["shapes"]  # no earlier task yet
    assert sft_in[1]["shapes"]["task_anchors.probs"] == [1, L, E]
    assert sft_in[2]["shapes"]["task_anchors.probs"] == [2, L, E]
    # the rounds name the newest anchor they carry (0 = none yet)
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    assert sorted({(e["round"], e["anchor_version"]) for e in events if e.get("event") == "train"}) == \
        [(1, 0), (3, 1), (5, 2)]
    # every party kept the pre-task model of the last task: the global model after round 4
    ckpt = run_dir / "checkpoints"
    before, after = (load_file(str(ckpt / f"round-{r}" / "trainable.safetensors")) for r in (4, 5))
    for party in ("party-0", "party-1", "party-2"):
        (kept,) = (run_dir / "work" / party / "retention").glob("pretask-*.safetensors")
        assert hash_tensors(load_file(str(kept))) == hash_tensors(before)
    # expert protection with scale 0: the experts that carried an earlier task's mass did not move in round 5
    anchors = torch.from_numpy(earlier_anchors(coord.s, "lookup"))
    protected = protected_experts(anchors, 0.25)
    assert protected.any() and not protected.all()
    model = apply_trainable(build_model(coord.cfg.model)[0], coord.cfg.model)
    names = {id(p): n for n, p in model.named_parameters()}
    masks = expert_slice_masks(model, protected, 0.0)
    assert masks
    moved_free = 0
    for p, m in masks:
        n = names[id(p)]
        d = after[n] - before[n]
        assert torch.all(d[m == 0] == 0), n
        moved_free += int(d[m == 1].abs().sum() > 0)
    assert moved_free > 0  # the unprotected experts trained
