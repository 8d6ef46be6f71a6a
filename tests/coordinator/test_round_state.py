"""The coordinator's round state and its round trip through a checkpoint's state.json."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from distmoe.config import UPDATE_KINDS, parse_schedule
from distmoe.coordinator.state import RoundState, StateError, from_checkpoint, pinned, position, to_checkpoint
from distmoe.routing.anchor import Anchor, AnchorVersion

PHASES = parse_schedule("sft:arith*2, eval, stats:arith, sft:lookup", 1)


def test_position_names_phase_and_round_within_it():
    assert position(PHASES, 0) is None
    assert position(PHASES, 2) == {"phase": 0, "label": "sft:arith", "round_in_phase": 2}
    assert position(PHASES, 4) == {"phase": 2, "label": "stats:arith", "round_in_phase": 1}
    assert position(PHASES, 6)["label"] == "end"


@pytest.mark.parametrize("kind", UPDATE_KINDS)
def test_the_model_before_a_new_task_of_every_update_kind_is_pinned(kind):
    phases = parse_schedule(f"sft:arith*2, eval, {kind}:lookup*2", 1)
    assert pinned(phases, 0, None) == {"kept": "initial model"}
    assert pinned(phases, 3, "arith") == {"kept": "before task lookup"}  # round 4 starts the new task
    assert pinned(phases, 1, "arith") == {} and pinned(phases, 4, "lookup") == {}


def test_begin_task_keeps_the_model_and_evaluation_before_it():
    old = RoundState(weights={"w": torch.ones(2)}, last_eval={"all": {"acc/arith": 0.5}})
    s = old.begin_task("lookup")
    assert old.current_task is None and old.ref_weights is None and old.trained_tasks == []  # a new state
    s = s.with_weights({"w": s.weights["w"] + 1})
    assert torch.equal(s.ref_weights["w"], torch.ones(2)) and s.baseline == {"all": {"acc/arith": 0.5}}
    assert s.mark_trained("lookup") is s and s.trained_tasks == ["lookup"] and s.current_task == "lookup"
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.round = 3  # type: ignore[misc]


def test_checkpoint_round_trip_is_exact_and_refuses_another_run():
    meta = AnchorVersion(version=1, round=4, source_checkpoint="h", router_spec={"moe_layers": [0], "num_experts": 2},
                         num_sequences=10.0, task="arith")
    s = RoundState(round=4, weights={"w": torch.arange(3.0)}, anchor=Anchor(np.array([[0.25, 0.75]], np.float32), meta),
                   anchor_versions=1, current_task="arith", trained_tasks=["arith"],
                   ref_weights={"w": torch.zeros(3)}, last_eval={"all": {"acc/arith": math.nan, "n/arith": 3.0}},
                   anomaly_history={"train/loss": [1.0, 0.5]})
    state, tensors = to_checkpoint(s, PHASES, run_id="r1", session="s1", epoch=0)
    state = json.loads(json.dumps(state))  # as state.json stores it (NaN as null)
    back = from_checkpoint(state, {"w": torch.arange(3.0)}, tensors, run_id="r1", where="ckpt")
    assert back.round == 4 and back.anchor.meta == meta and np.array_equal(back.anchor.probs, s.anchor.probs)
    assert torch.equal(back.ref_weights["w"], torch.zeros(3)) and back.trained_tasks == ["arith"]
    assert math.isnan(back.last_eval["all"]["acc/arith"]) and back.anomaly_history == {"train/loss": [1.0, 0.5]}
    with pytest.raises(StateError, match="not a state of run r2"):
        from_checkpoint(state, {}, tensors, run_id="r2", where="ckpt")
    with pytest.raises(StateError, match="anchor.safetensors is missing"):
        from_checkpoint(state, {}, {"ref": tensors["ref"]}, run_id="r1", where="ckpt")


def test_resume_reads_a_run_recorded_before_the_key_renames():
    from distmoe.config import DEFAULTS
    from distmoe.coordinator import config_differences

    old = {("federation.min-parties" if k == "federation.min-available" else
            "privacy.canaries" if k == "privacy.noise-canaries" else k): v for k, v in DEFAULTS.items()}
    old["privacy.dp-sgd"] = False
    assert config_differences(old, dict(DEFAULTS)) == {}
    old["privacy.canaries"] = 64
    want = {"privacy.noise-canaries": (64, DEFAULTS["privacy.noise-canaries"])}
    assert config_differences(old, dict(DEFAULTS)) == want
