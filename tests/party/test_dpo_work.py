"""A party's dpo round (distmoe.party.dpo_work): a pair whose answer does not fit ``model.max-seq-len`` is left out,
never refused, whatever the length of the party's longest answer."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from distmoe.config import NodeConfig, parse_run_config
from distmoe.data.synth import write_synthetic
from distmoe.model.base import base_fingerprint
from distmoe.model.build import build_model
from distmoe.model.trainable import apply_trainable, spec_of, trainable_state
from distmoe.party.dpo_work import run_dpo
from distmoe.party.work import PartyError
from distmoe.wire.schema import SftInstruction


def _round(tiny, data, work, ref_shift: float | None = None, task: str = "pref"):
    """One party's dpo round on the tiny model; ``ref_shift``: send a reference this far from the global weights
    (None: no reference, the model as received is the reference, as with ``dpo.reference = round``)."""
    cfg = parse_run_config({**tiny, "dpo.steps": 1, "dpo.pairs-per-step": 2, "dpo.beta": 1.0})
    model = apply_trainable(build_model(cfg.model)[0], cfg.model)
    weights = {k: v.numpy() for k, v in trainable_state(model).items()}
    spec = spec_of(model, cfg.model.trainable, base_fingerprint(cfg.model))
    ref = None if ref_shift is None else {k: v + np.float32(ref_shift) for k, v in weights.items()}
    instr = SftInstruction(round=1, task=task, weights=weights, base_hash=spec.base_hash, seed=1, anchor=None,
                           anchor_version=0, objective="dpo", ref_weights=ref)
    return run_dpo(cfg, NodeConfig(party="p0", data_path=data, work_dir=work, model_path=""), instr)


def test_a_pair_that_does_not_fit_is_left_out_and_none_left_means_weight_zero(tiny, tmp_path):
    (src,) = write_synthetic(tmp_path / "s", parties=1, examples_per_task=8, seed=0, tasks=("pref",))
    sizes = {}
    for name, rows in (("short", set()), ("one-long", {0, 1, 2}), ("all-long", set(range(8)))):
        data = tmp_path / name
        shutil.copytree(src, data)
        lines = [json.loads(x) for x in (data / "pref.jsonl").read_text().splitlines()]
        for k in rows:
            lines[k]["rejected"] = "y" * 200  # above the default model.max-seq-len = 96
        (data / "pref.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        upd, _ = _round(tiny, data, tmp_path / f"w-{name}")
        sizes[name] = upd.num_examples
        if name == "all-long":
            assert all(not np.any(d) for d in upd.delta.values())  # a non-contributor, as without data
    assert sizes["all-long"] == 0 and 0 < sizes["one-long"] < sizes["short"], sizes


def test_without_a_reference_the_model_received_is_the_reference(tiny, tmp_path):
    """``dpo.reference = round`` sends no reference: the policy starts equal to its reference, so the first DPO loss
    is ``log 2``; a reference that differs from the global weights (``dpo.reference = phase`` after the phase's first
    round) moves it off ``log 2``."""
    (data,) = write_synthetic(tmp_path / "s", parties=1, examples_per_task=8, seed=0, tasks=("pref", "arith"))
    upd, _ = _round(tiny, data, tmp_path / "w0")
    assert upd.num_examples > 0 and upd.metrics["loss_first"] == pytest.approx(math.log(2), abs=1e-5)
    moved, _ = _round(tiny, data, tmp_path / "w1", ref_shift=0.05)
    assert abs(moved.metrics["loss_first"] - math.log(2)) > 1e-3
    with pytest.raises(PartyError, match="task 'arith' holds no preference pairs"):  # an instruction task
        _round(tiny, data, tmp_path / "w2", task="arith")
