"""``bench/device_check.py`` at its tiny shape on the CPU: the same code the accelerator runs (meta-device build,
``to_empty``, random init on the device, routed-expert LoRA and attention-only LoRA steps with gradient
checkpointing, one GRPO step on rollouts from a bf16 inference engine that is a view over the policy)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

_PATH = Path(__file__).resolve().parents[2] / "bench" / "device_check.py"
_spec = importlib.util.spec_from_file_location("device_check_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_built_on_the_device_like_a_constructed_model():
    from transformers import AutoModelForCausalLM

    model = bench.build_on_device(bench.TINY, torch.device("cpu"), torch.float32)
    ref = AutoModelForCausalLM.from_config(bench.hf_config(bench.TINY))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)  # not garbage
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(bool((p == 1).all()) for p in norms)
    w = model.model.layers[0].mlp.experts.gate_up_proj
    assert 0.015 < float(w.std()) < 0.025  # drawn, not left as to_empty's uninitialised memory


def test_tiny_device_check_runs_every_step(tmp_path):
    out = tmp_path / "check.json"
    res = bench.main(["--tiny", "--device", "cpu", "--batch", "2", "--seq", "16", "--steps", "1", "--warmup", "0",
                      "--rl-prompts", "2", "--rl-group", "2", "--rl-new-tokens", "4", "--rl-prompt-len", "4",
                      "--out", str(out)])
    assert out.exists() and res["shape"] == "tiny" and res["dtype"] == "float32"
    lo = res["lora"]
    assert lo["tokens"] == 32 and lo["routed"]["tok_s"] > 0 and lo["attention"]["tok_s"] > 0 and lo["ratio"] > 0
    rl = res["rl"]
    assert rl["engine"] == "bf16" and rl["rollouts"] == 4 and rl["generated_tokens"] > 0
    assert rl["finite"] and math.isfinite(rl["loss"])
    q = res["nf4"]  # the 4-bit path: every expert weight of the 2 layers in NF4
    assert q["stacks"] == 4 and q["held_gb_after"] < 0.8 * q["held_gb_before"] and q["finite"] and q["tok_s"] > 0
