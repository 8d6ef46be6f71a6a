"""The warm-up base (distmoe.train.warmup): built once from public synthetic data, cached by (config, seed),
verified on reuse, rebuilt when broken, refused for a checkpoint model; and a run with model.warmup-steps
starts from it (weights of the base in its round-0 checkpoint)."""

from __future__ import annotations

import json
import uuid

import pytest
import torch
from safetensors.torch import load_file

from distmoe.checkpoint import verify_checkpoint
from distmoe.config import ConfigError, parse_node_config
from distmoe.data.synth import generate
from distmoe.model.build import build_model
from distmoe.model.trainable import apply_trainable, trainable_state
from distmoe.train.warmup import PUBLIC_SEED_OFFSET, BaseError, base_key, build_base, warmup_examples

FAST = {"train.batch-size": 4}


def test_build_caches_and_reuses(make_cfg, tmp_path):
    cfg = make_cfg(**FAST)
    logs: list[str] = []
    path = build_base(cfg, 3, tmp_path, log=logs.append)
    manifest = verify_checkpoint(path)
    assert path.parent.parent == tmp_path and path.name == "round-0"
    assert manifest["base"]["steps"] == 3 and manifest["base"]["data_seed"] == cfg.run.seed + PUBLIC_SEED_OFFSET
    assert manifest["base"]["key"] == base_key(cfg, 3)
    weights = load_file(str(path / "trainable.safetensors"))
    init = trainable_state(apply_trainable(build_model(cfg.model)[0], cfg.model))
    assert sorted(weights) == sorted(init)
    assert any(not torch.equal(weights[k], init[k]) for k in init)  # it trained
    # the model/ directory loads as model.path (trainable all)
    loaded, _ = build_model(make_cfg(**{"model.path": str(path / "model"), "model.trainable": "all"}).model)
    got = dict(loaded.named_parameters())
    assert all(torch.equal(got[k].detach().float(), weights[k]) for k in weights)
    # reused as it is
    mtime = (path / "trainable.safetensors").stat().st_mtime_ns
    assert build_base(cfg, 3, tmp_path, log=logs.append) == path
    assert (path / "trainable.safetensors").stat().st_mtime_ns == mtime and "using the cached" in logs[-1]
    # another seed, step count or model: another base; the cache path is not part of the key
    assert base_key(make_cfg(**{**FAST, "run.seed": 1}), 3) != base_key(cfg, 3) != base_key(cfg, 4)
    assert base_key(make_cfg(**{**FAST, "model.warmup-cache": "elsewhere"}), 3) == base_key(cfg, 3)
    assert base_key(make_cfg(**{**FAST, "model.experts": 8}), 3) != base_key(cfg, 3)
    # a broken cached base is rebuilt
    (path / "trainable.safetensors").write_bytes(b"broken")
    again = build_base(cfg, 3, tmp_path, log=logs.append)
    assert "unusable" in " ".join(logs) and verify_checkpoint(again)


def test_warmup_data_is_public_not_the_parties(make_cfg):
    cfg = make_cfg()
    tok = build_model(cfg.model)[1]
    enc = warmup_examples(0, 48, tok)
    assert len(enc) == 3 * 3 * 200
    assert enc == warmup_examples(0, 48, tok)  # deterministic
    party = {json.dumps(o, sort_keys=True) for o in generate("lookup", 0, 240, 0)}  # a party's data at seed 0
    public = {json.dumps(o, sort_keys=True) for o in generate("lookup", 0, 240, PUBLIC_SEED_OFFSET)}
    assert not party & public  # another fact table


def test_refused_for_checkpoints_and_lora(make_cfg, tmp_path):
    with pytest.raises(ConfigError, match="model.warmup-steps"):
        make_cfg(**{"model.warmup-steps": 5, "model.trainable": "lora"})
    with pytest.raises(BaseError, match="model.trainable"):
        build_base(make_cfg(**{"model.trainable": "lora"}), 5, tmp_path)
    with pytest.raises(BaseError, match=">= 1"):
        build_base(make_cfg(), 0, tmp_path)


def test_a_public_sourced_bias_warms_up_on_its_own_public_batches(make_cfg, tmp_path):
    """routing.balance-source = public names a party's public balance batch; the warm-up's batches are the public
    mix itself, so its bias counts them (the same base as balance-source party) instead of refusing to build."""
    bias = {**FAST, "routing.balance": "aux+bias", "routing.balance-count": "first"}
    pub = build_base(make_cfg(**bias, **{"routing.balance-source": "public", "routing.public-balance-coef": 1.0}), 2,
                     tmp_path / "a")
    party = build_base(make_cfg(**bias), 2, tmp_path / "b")
    got, want = (load_file(str(p / "trainable.safetensors")) for p in (pub, party))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert any(".bias" in k or "balance" in k for k in got), sorted(got)[:8]  # the bias is part of the base


@pytest.mark.integration
def test_run_starts_from_the_warm_base(synth_dirs, make_cfg, tmp_path):
    from distmoe.coordinator import Coordinator
    from distmoe.inprocess import LocalTransport

    cfg = make_cfg(**{**FAST, "model.warmup-steps": 3, "schedule.phases": "eval", "data.max-eval-examples": 2,
                      "eval.max-new-tokens": 2, "federation.min-available": 2, "federation.wait-timeout": 1.0,
                      "privacy.mode": "plaintext"})
    run_dir = tmp_path / "runs" / "r"
    run_id = f"warm-{uuid.uuid4().hex[:8]}"
    nodes = {100 + i: parse_node_config({"data-path": str(d)}, cfg.sim) for i, d in enumerate(synth_dirs)}
    lines: list[str] = []
    Coordinator(cfg, run_dir, LocalTransport(cfg, nodes, run_id), run_id=run_id, log=lines.append).run()
    base = tmp_path / "runs" / "base-cache" / f"base-{base_key(cfg, 3)[:20]}" / "round-0"  # beside the run dir
    assert verify_checkpoint(base)
    b = load_file(str(base / "trainable.safetensors"))
    r0 = load_file(str(run_dir / "checkpoints" / "round-0" / "trainable.safetensors"))
    assert all(torch.equal(b[k], r0[k]) for k in b)
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["started_from"]["base"]["steps"] == 3 and rec["status"] == "completed"
    assert any("warm-up base" in x for x in lines)
