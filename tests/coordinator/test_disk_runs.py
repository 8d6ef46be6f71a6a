"""The default run's disk: its checkpoints keep three weight contents, each stored once.

The default schedule (``sft:lookup*5, eval, stats:lookup, sft:arith*5, eval``) with the default checkpoint keys
(``checkpoint.keep = 2``, ``checkpoint.every = 5``) and output distillation on keeps the initial model, the model
before task ``arith`` and the final model: three contents, whatever each checkpoint directory repeats (``model/``,
``ref.safetensors``, the rounds that change no weight) as hard links. At the default model's 28.5 MB of weights that
is 85.5 MB, under the 100 MB the quick start must stay below with Flower's own state (about 9 MB).
"""

from __future__ import annotations

import os

import pytest

from distmoe.checkpoint import disk_bytes
from distmoe.config import parse_run_config

pytestmark = pytest.mark.integration  # a whole in-process run of the default schedule


def test_the_default_schedule_keeps_three_weight_contents_each_stored_once(tmp_path, make_run):
    default = parse_run_config({})
    schedule = ", ".join(p.label() for p in default.schedule.phases)
    keys = {"checkpoint.every": default.checkpoint.every, "checkpoint.keep": default.checkpoint.keep}
    coord, _, run_dir, _, _ = make_run(tmp_path, {"schedule.phases": schedule, **keys})
    assert coord.cfg.checkpoint == default.checkpoint and coord.cfg.retention.distill_weight > 0
    assert coord.run()["status"] == "completed"
    ckpts = run_dir / "checkpoints"
    one = (ckpts / "round-0" / "trainable.safetensors").stat().st_size  # one content of the trainable weights
    weights = [f for f in ckpts.rglob("*.safetensors") if f.stat().st_size >= one // 2]
    contents = {(os.stat(f).st_dev, os.stat(f).st_ino) for f in weights}
    assert len(weights) > 3 * len(contents)  # each content is repeated (model/, ref, unchanged rounds) ...
    assert len(contents) == 3, sorted(str(f.relative_to(ckpts)) for f in weights)  # ... and stored once
    assert disk_bytes(ckpts) < 3.2 * one
