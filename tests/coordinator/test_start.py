"""Rollback and start points: the initial model and the model before each task are never
pruned; ``distmoe rollback`` names or copies a kept round, refusing a pruned or missing one; a new run with
``run.init-from`` starts from its weights and anchor; a bad start point stops the run with a clear error."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from distmoe.checkpoint import CheckpointError, kept_rounds, rollback_point, save_checkpoint
from distmoe.cli import main as cli_main
from distmoe.config import ConfigError, parse_node_config
from distmoe.coordinator import Coordinator
from distmoe.coordinator.context import RunContext
from distmoe.coordinator.errors import RunFailed
from distmoe.coordinator.start import load_start
from distmoe.coordinator.state import pinned
from distmoe.inprocess import LocalTransport
from distmoe.model.adapters import server_model

RUN = {"schedule.sft-rounds": 1, "train.local-steps": 2, "train.batch-size": 4, "data.max-eval-examples": 3,
       "eval.max-new-tokens": 2, "federation.min-available": 2, "federation.wait-timeout": 1.0,
       "privacy.mode": "plaintext", "checkpoint.keep": 1}
FIRST = "sft:arith, stats:arith, sft:strings*2, eval"  # rounds 1..5; pinned: 0 (initial), 2 (before strings)


def _run(cfg, dirs, run_dir):
    run_id = f"start-{uuid.uuid4().hex[:8]}"
    nodes = {100 + i: parse_node_config({"data-path": str(d)}, cfg.sim) for i, d in enumerate(dirs)}
    lines: list[str] = []
    coord = Coordinator(cfg, run_dir, LocalTransport(cfg, nodes, run_id), run_id=run_id, log=lines.append)
    return coord, lines


def test_pinned_rounds_of_a_schedule(make_cfg):
    phases = make_cfg(**{"schedule.phases": "sft:a*2, eval, stats:a, sft:b, eval, sft:b, rl:c",
                         "schedule.sft-rounds": 1}).schedule.phases
    # rounds: 1-2 sft:a, 3 eval, 4 stats, 5 sft:b, 6 eval, 7 sft:b (same task: not pinned), 8 rl:c
    got = {r: pinned(phases, r, task) for r, task in [(0, None), (1, "a"), (2, "a"), (3, "a"), (4, "a"), (5, "b"),
                                                      (6, "b"), (7, "b"), (8, "c")]}
    assert got[0] == {"kept": "initial model"} and got[4] == {"kept": "before task b"}
    assert got[7] == {"kept": "before task c"}
    assert all(got[r] == {} for r in (1, 2, 3, 5, 6, 8))


def test_prune_keeps_pinned_checkpoints(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    w = {"w": torch.zeros(2)}
    for r in range(6):
        save_checkpoint(root, r, w, "h", keep=2, meta={"kept": "before task x"} if r in (0, 3) else {})
    assert [(n, why) for n, _, why in kept_rounds(root)] == [(0, "before task x"), (3, "before task x"),
                                                              (4, None), (5, None)]
    with pytest.raises(CheckpointError, match=r"round 2 was pruned.*kept rounds: 0 \(before task x\), 3"):
        rollback_point(tmp_path / "run", 2)
    assert rollback_point(tmp_path / "run", 3) == root / "round-3"
    (root / "round-3" / "trainable.safetensors").write_bytes(b"corrupt")
    with pytest.raises(CheckpointError, match="does not match its hash"):
        rollback_point(tmp_path / "run", 3)
    with pytest.raises(CheckpointError, match="no checkpoints/"):
        rollback_point(tmp_path / "elsewhere", 0)


@pytest.mark.integration
def test_rollback_restores_weights_and_anchor(synth_dirs, make_cfg, tmp_path, capsys):
    cfg = make_cfg(**{**RUN, "schedule.phases": FIRST})
    first = tmp_path / "first"
    coord, _ = _run(cfg, synth_dirs, first)
    coord.run()
    rounds = [(n, why) for n, _, why in kept_rounds(first / "checkpoints")]
    assert rounds == [(0, "initial model"), (2, "before task strings"), (5, None)]  # keep = 1 pruned 1, 3, 4

    # missing and pruned rounds: clear errors naming the kept ones
    with pytest.raises(CheckpointError, match=r"round 3 was pruned.*kept rounds: 0 \(initial model\), 2 \(before "
                                              r"task strings\), 5"):
        rollback_point(first, 3)
    with pytest.raises(CheckpointError, match="round 9 has no checkpoint"):
        rollback_point(first, 9)
    assert cli_main(["rollback", str(first), "--round", "4"]) == 2
    assert "was pruned" in capsys.readouterr().err
    assert cli_main(["rollback", str(first)]) == 0
    assert "[before task strings]" in capsys.readouterr().out

    # copy round 2 out and start a new run from it
    start = tmp_path / "starts" / "before-strings"
    assert cli_main(["rollback", str(first), "--round", "2", "--out", str(start)]) == 0
    out = capsys.readouterr().out
    assert out.strip() == f"run.init-from={start.resolve()}"
    assert cli_main(["rollback", str(first), "--round", "2", "--out", str(start)]) == 2  # never overwrites
    capsys.readouterr()

    cfg2 = make_cfg(**{**RUN, "schedule.phases": "eval, sft:strings", "run.init-from": str(start)})
    second = tmp_path / "second"
    coord2, lines = _run(cfg2, synth_dirs, second)
    coord2.run()
    src = load_file(str(first / "checkpoints" / "round-2" / "trainable.safetensors"))
    got = load_file(str(second / "checkpoints" / "round-0" / "trainable.safetensors"))
    assert sorted(src) == sorted(got) and all(torch.equal(src[k], got[k]) for k in src)
    src_anchor = load_file(str(first / "checkpoints" / "round-2" / "anchor.safetensors"))["probs"]
    new_anchor = load_file(str(second / "checkpoints" / "round-0" / "anchor.safetensors"))["probs"]
    assert torch.equal(src_anchor, new_anchor)
    rec = json.loads((second / "run.json").read_text())
    assert rec["status"] == "completed"
    assert rec["started_from"]["round"] == 2 and rec["started_from"]["anchor_version"] == 1
    assert any("start: round 0 from run.init-from" in x for x in lines)
    state = json.loads((second / "checkpoints" / "round-0" / "state.json").read_text())
    assert state["anchor_versions"] == 1 and state["anchor"]["version"] == 1
    # the round trained from it (sft:strings, round 2 of the new run) moved the weights off the start point
    last = load_file(str(second / "checkpoints" / "round-2" / "trainable.safetensors"))
    assert any(not np.array_equal(last[k].numpy(), src[k].numpy()) for k in src)


def test_bad_start_points_stop_the_run(make_cfg, tmp_path):
    """``run.init-from`` a missing directory, or a checkpoint of another model shape: ``RunFailed`` naming it, before
    any round (``start.load_start``, which the loop calls first)."""
    missing = make_cfg(**{**RUN, "run.init-from": str(tmp_path / "nope")})
    model = server_model(missing.model)
    with pytest.raises(RunFailed, match="not a directory"):
        load_start(missing, tmp_path / "a", model, lambda _s: None)
    other = make_cfg(**{**RUN, "model.experts": 8})  # a checkpoint of another model shape, as a run writes it
    ctx = RunContext(other, tmp_path / "b", "other", log=lambda _s: None)
    ctx.model = server_model(other.model)
    ctx.s = replace(ctx.s, weights=dict(ctx.model.weights))
    ctx.checkpoint()
    wrong = make_cfg(**{**RUN, "run.init-from": str(tmp_path / "b" / "checkpoints" / "round-0")})
    with pytest.raises(RunFailed, match="does not fit this run's model"):
        load_start(wrong, tmp_path / "c", model, lambda _s: None)


def test_init_from_and_warmup_exclude_each_other(make_cfg):
    with pytest.raises(ConfigError, match="run.init-from"):
        make_cfg(**{"run.init-from": "x", "model.warmup-steps": 5})
