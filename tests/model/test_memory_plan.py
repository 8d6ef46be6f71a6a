"""Unit tests: the memory plan (``distmoe.model.memory_plan``) and ``distmoe plan``."""

from __future__ import annotations

from dataclasses import replace

import pytest

from distmoe.cli import main
from distmoe.config import parse_run_config
from distmoe.model import memory_plan as plan
from distmoe.model.build import build_model
from distmoe.model.fabricate import write_checkpoint
from distmoe.model.trainable import apply_trainable


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint("qwen2_moe", tmp_path_factory.mktemp("plan") / "q")


def test_counts_are_the_built_models(ckpt):
    a = plan.architecture(str(ckpt))
    cfg = parse_run_config({"model.path": str(ckpt), "model.trainable": "lora"}).model
    model = apply_trainable(build_model(cfg)[0], cfg)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert (a.params, a.trainable) == (frozen, trainable)
    assert (a.family, a.layers, a.moe_layers, a.experts, a.top_k, a.shared_width) == ("qwen2_moe", 2, 2, 4, 2, 32)


def test_terms_follow_the_settings(ckpt):
    a = plan.architecture(str(ckpt))
    s = plan.Settings(batch=8, seq=64, dtype_bytes=4, cpu=True)
    p = plan.predict(a, s)
    assert p["base"] == a.params * 4 and p["adapters"] == a.trainable * 16
    assert p["sft"] > p["stats"] > p["base"]
    assert plan.predict(a, replace(s, dtype_bytes=2))["base"] == a.params * 2
    assert plan.predict(a, replace(s, checkpointing=True))["sft"] < p["sft"]
    assert plan.predict(a, replace(s, batch=4))["sft"] < p["sft"]
    copy = plan.predict(a, replace(s, engine_copy=True))["rl"]
    assert copy == p["rl"] - plan.engine_bytes(a, s) + p["base"]  # the former engine's copy of the base
    assert 0 < plan.engine_bytes(a, s) < 0.5 * p["base"]  # a bf16 view over a float32 base: one unit cast at a time
    assert plan.engine_bytes(a, replace(s, dtype_bytes=2)) == 0  # over a bf16 base the cast is the tensor itself
    assert plan.engine_bytes(a, replace(s, engine="exact")) == 0
    nf4 = plan.predict(a, replace(s, nf4_experts=True))
    experts = a.moe_layers * a.experts * 3 * a.hidden * a.expert_width
    assert nf4["base"] == pytest.approx(p["base"] - experts * (4 - 0.5625))  # half a byte + an absmax per 64
    # on a GPU neither the mapped checkpoint nor the imports count
    gpu = plan.predict(a, replace(s, cpu=False))["sft"]
    assert gpu == pytest.approx(p["sft"] - p["base"] - plan.IMPORTS_GB * plan.GB)


def test_fit_finds_settings_under_the_device_or_says_none(ckpt):
    a = plan.architecture(str(ckpt))
    s = plan.Settings(batch=64, seq=512, dtype_bytes=4, cpu=False)
    big = plan.predict(a, s)
    device_gb = 0.5 * max(big["sft"], big["rl"]) / plan.GB
    t, q = plan.fit(a, s, device_gb)
    assert max(q["sft"], q["rl"]) <= 0.9 * device_gb * plan.GB and t.batch <= 64
    assert plan.fit(a, s, 1e-6) is None


def test_refused_family_and_bad_input_say_why(capsys, tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model("dots1").save_pretrained(tmp_path)
    with pytest.raises(plan.PlanError, match="dots1.*has not tested"):
        plan.architecture(str(tmp_path))
    with pytest.raises(plan.PlanError, match="neither a checkpoint directory"):
        plan.architecture("no-such-shape")
    with pytest.raises(plan.PlanError, match="a memory size in GB"):
        plan._device_gb("quantum")


def test_cli_prints_the_plan_and_the_fitting_settings(ckpt, capsys):
    assert main(["plan", "--model", str(ckpt), "--device", "h100", "--batch", "2", "--seq", "32"]) == 0
    out = capsys.readouterr().out
    assert "qwen2_moe" in out and "| party sft | party rl | party stats | server |" in out
    assert "fits one 80 GB device with: dtype = \"bfloat16\"" in out
    assert main(["plan", "--model", "moonlight-16b-a3b"]) == 0  # deepseek_v3: planned, at its real size
    assert "moonlight-16b-a3b: deepseek_v3, 15.96B parameters" in capsys.readouterr().out
    assert main(["plan", "--model", str(ckpt), "--device", "quantum"]) == 2
