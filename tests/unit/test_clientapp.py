"""The ClientApp handlers on real Flower ``Message`` s: decode, run, encode; failures become error
replies that name what went wrong (file and line, config key), never a hang or a crash."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from clients.app import evaluate, sft, stats
from distmoe.model.build import build_model
from distmoe.model.trainable import apply_trainable, spec_of, trainable_state
from distmoe.wire import codec
from distmoe.wire.schema import EvalReply, ModelUpdate, RouterStats, SftInstruction, StatsInstruction

TINY = {"model.hidden-size": 64, "model.moe-intermediate-size": 64, "model.layers": 2, "model.heads": 2,
        "model.kv-heads": 1, "model.head-dim": 32, "model.experts": 4, "model.top-k": 2}


@pytest.fixture(autouse=True)
def task_identity():
    # Flower stamps run/node ids on every Message; outside a run we set them as the runtime does
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def _context(data_path: Path, run_config: dict) -> Context:
    return Context(run_id=7, node_id=1, node_config={"data-path": str(data_path), "party-name": "p0"},
                   state=RecordDict(), run_config=run_config)


def _global(cfg_over: dict):
    from distmoe.config import parse_run_config

    cfg = parse_run_config(cfg_over)
    model, _ = build_model(cfg.model)
    model = apply_trainable(model, cfg.model)
    spec = spec_of(model, cfg.model.trainable)
    return {k: v.numpy() for k, v in trainable_state(model).items()}, spec


def _instruction(payload) -> object:
    return codec.instruction(payload, node_id=1)


def test_sft_and_stats_round_trip_through_flower_messages(synth_dirs):
    run_config = {**TINY, "train.local-steps": 2}
    weights, spec = _global(run_config)
    ctx = _context(synth_dirs[0], run_config)
    out = sft(_instruction(SftInstruction(round=1, task="lookup", weights=weights, base_hash=spec.base_hash,
                                          seed=1, anchor=None, anchor_version=0)), ctx)
    assert not out.has_error(), out.error.reason if out.has_error() else ""
    upd = codec.decode(out.content, ModelUpdate)
    assert upd.party == "p0" and upd.num_examples > 0
    assert set(upd.delta) == set(weights)
    assert any(np.abs(d).max() > 0 for d in upd.delta.values())

    out = stats(_instruction(StatsInstruction(round=2, task="lookup", weights=weights, base_hash=spec.base_hash)),
                ctx)
    st = codec.decode(out.content, RouterStats)
    assert np.allclose(st.sums.sum(1), st.sums.sum(1)[0])  # every row sums to the sequence count


def test_corrupt_party_file_becomes_an_error_reply_naming_file_and_line(synth_dirs, tmp_path):
    bad = tmp_path / "p0"
    shutil.copytree(synth_dirs[0], bad)
    lines = (bad / "lookup.jsonl").read_text().splitlines()
    lines[4] = '{"instruction": "k1", "output": '
    (bad / "lookup.jsonl").write_text("\n".join(lines) + "\n")
    weights, spec = _global(TINY)
    out = sft(_instruction(SftInstruction(round=1, task="lookup", weights=weights, base_hash=spec.base_hash,
                                          seed=1, anchor=None, anchor_version=0)), _context(bad, TINY))
    assert out.has_error()
    assert "lookup.jsonl:5" in out.error.reason and "DataError" in out.error.reason


def test_base_model_mismatch_is_refused(synth_dirs):
    weights, spec = _global(TINY)
    other = {**TINY, "run.seed": 3, "model.trainable": "router+experts"}
    w2, spec2 = _global(other)
    out = evaluate(_instruction(codec.EvalInstruction(round=1, tasks=("lookup",), new_task="lookup", weights=w2,
                                                      base_hash=spec.base_hash, ref_weights=None, anchor=None,
                                                      anchor_version=0)), _context(synth_dirs[0], other))
    assert out.has_error() and "frozen base model differs" in out.error.reason
    assert spec2.base_hash != spec.base_hash


def test_bad_run_config_is_an_error_reply(synth_dirs):
    weights, spec = _global(TINY)
    out = stats(_instruction(StatsInstruction(round=1, task="", weights=weights, base_hash=spec.base_hash)),
                _context(synth_dirs[0], {**TINY, "train.batch-size": 0}))
    assert out.has_error() and "train.batch-size" in out.error.reason


def test_eval_reply_carries_only_aggregates(synth_dirs):
    weights, spec = _global(TINY)
    out = evaluate(_instruction(codec.EvalInstruction(round=1, tasks=("lookup", "arith"), new_task="arith",
                                                      weights=weights, base_hash=spec.base_hash, ref_weights=weights,
                                                      anchor=None, anchor_version=0)), _context(synth_dirs[0], TINY))
    rep = codec.decode(out.content, EvalReply)
    assert set(rep.metrics) == {"acc/lookup", "loss/lookup", "n/lookup", "acc/arith", "loss/arith", "n/arith",
                                "routing_kl", "load_cv", "top1_consistency"}
    assert rep.metrics["top1_consistency"] == 1.0
