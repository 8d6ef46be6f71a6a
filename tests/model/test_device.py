"""Device and precision at a party (``distmoe/model/device.py``, ``base.py``): resolution and refusals, the
owner's node-config settings, bf16 bases with float32 trainable tensors, the per-process cache, and the
checkpoint fingerprint.

What crosses the wire stays float32 on the CPU. CUDA itself cannot run here: the CUDA-only paths are
checked for their refusals; the dtype paths run for real on the CPU (bf16 autocast)."""

from __future__ import annotations

import dataclasses
import os
import stat

import pytest
import torch

from distmoe.config import ConfigError, SimConfig, parse_node_config
from distmoe.model import base as base_mod
from distmoe.model.base import SIDECAR, base_fingerprint, prepared_model
from distmoe.model.build import ModelError, build_model, router_modules
from distmoe.model.device import DeviceError, resolve_runtime
from distmoe.model.router import forward_with_router
from distmoe.model.tokenizer import build_default_tokenizer
from distmoe.model.trainable import trainable_state


def _train(make_cfg, **over):
    return make_cfg(**{f"train.{k}": v for k, v in over.items()}).train


# ------------------------------------------------------------------------------------------ resolution
def test_auto_and_cpu_resolve_here(make_cfg):
    rt = resolve_runtime(_train(make_cfg))
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert rt.device.type in (expected, "mps") and rt.dtype == torch.float32 and not rt.mixed
    rt = resolve_runtime(_train(make_cfg, device="cpu", dtype="bfloat16"))
    assert rt.device == torch.device("cpu") and rt.dtype == torch.bfloat16 and rt.mixed


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:3"])
def test_cuda_without_cuda_is_refused_naming_the_fix(make_cfg, device):
    with pytest.raises(DeviceError, match=rf"train.device = '{device}'.*no CUDA device.*node config"):
        resolve_runtime(_train(make_cfg, device=device))


@pytest.mark.parametrize(("over", "message"), [
    ({"device": "cpu", "quantize": "4bit"}, "bitsandbytes quantisation runs on CUDA only"),
    ({"device": "cpu", "dtype": "float16"}, "float16.*on the CPU"),
])
def test_what_cannot_run_here_is_refused(make_cfg, over, message):
    with pytest.raises(DeviceError, match=message):
        resolve_runtime(_train(make_cfg, **over))


@pytest.mark.parametrize("value", ["gpu", "cuda:x", "CUDA", "cuda:"])
def test_device_key_is_validated(make_cfg, value):
    with pytest.raises(ConfigError, match="train.device"):
        make_cfg(**{"train.device": value})


def test_node_config_sets_the_owners_hardware(tmp_path, make_cfg):
    (tmp_path / "p0").mkdir()
    node = parse_node_config({"data-path": str(tmp_path / "p0"), "device": "cpu", "dtype": "bfloat16",
                              "micro-batch-size": 2, "gradient-checkpointing": True}, SimConfig())
    train = node.train(make_cfg().train)
    assert (train.device, train.dtype, train.micro_batch_size, train.gradient_checkpointing) == \
        ("cpu", "bfloat16", 2, True)
    assert make_cfg().train.dtype == "float32"  # the run's own section is untouched
    with pytest.raises(ConfigError, match=r"node config key 'dtype' \(party 'p0'\).*float8"):
        parse_node_config({"data-path": str(tmp_path / "p0"), "dtype": "float8"}, SimConfig())


# ------------------------------------------------------------------------------------------ precision
def test_bf16_base_with_float32_trainable_tensors_trains_on_cpu(make_cfg, synth_dirs):
    from distmoe.data.party import load_party
    from distmoe.data.template import encode_example
    from distmoe.model.build import describe
    from distmoe.train.sft import train_sft

    cfg = make_cfg(**{"model.trainable": "lora", "train.dtype": "bfloat16", "train.device": "cpu",
                      "train.local-steps": 4, "train.batch-size": 4})
    base_mod.clear_cache()
    model, tok = prepared_model(cfg.model, "", resolve_runtime(cfg.train, "lora"))
    frozen = [p for p in model.parameters() if not p.requires_grad]
    trained = [p for p in model.parameters() if p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen if p.is_floating_point())
    assert trained and all(p.dtype == torch.float32 for p in trained)
    ids = torch.randint(0, 50, (2, 7))
    out = forward_with_router(model, ids, torch.ones_like(ids))
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits.float()).all()
    before = trainable_state(model)
    data = load_party(synth_dirs[0], cfg.data)
    encoded = [encode_example(tok, ex, cfg.model.max_seq_len) for ex in data.train("arith")]
    ms = describe(model)
    res = train_sft(model, encoded, tok.pad_token_id, cfg.train, cfg.routing, ms.num_experts, ms.top_k, None, 0)
    assert res.steps == 4 and res.skipped_steps == 0
    after = trainable_state(model)
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in after.values())  # the wire's form
    assert any(not torch.equal(before[k], after[k]) for k in before)
    base_mod.clear_cache()


def _one_step(make_cfg, synth_dirs, **over):
    from distmoe.data.party import load_party
    from distmoe.data.template import encode_example
    from distmoe.model.build import describe
    from distmoe.model.trainable import apply_trainable
    from distmoe.train.sft import train_sft

    cfg = make_cfg(**{"train.local-steps": 1, "train.batch-size": 6, "train.warmup-steps": 0, **over})
    model, tok = build_model(cfg.model)
    model = apply_trainable(model, cfg.model)
    data = load_party(synth_dirs[0], cfg.data)
    encoded = [encode_example(tok, ex, cfg.model.max_seq_len) for ex in data.train("arith")]
    ms = describe(model)
    calls = []
    router = router_modules(model)[0][1]
    handle = router.register_forward_hook(lambda *_: calls.append(1))
    res = train_sft(model, encoded, tok.pad_token_id, cfg.train, cfg.routing, ms.num_experts, ms.top_k, None, 0)
    handle.remove()
    res.router_calls = len(calls)
    return trainable_state(model), res


def test_micro_batches_give_the_whole_batch_step(make_cfg, synth_dirs):
    """Token-weighted accumulation: with the task loss alone, 3 micro-batches of 2 = one batch of 6."""
    whole, r1 = _one_step(make_cfg, synth_dirs, **{"routing.aux-loss-coef": 0.0})
    parts, r2 = _one_step(make_cfg, synth_dirs, **{"routing.aux-loss-coef": 0.0, "train.micro-batch-size": 2})
    assert r1.task_losses[0] == pytest.approx(r2.task_losses[0], rel=1e-5)
    for k in whole:
        torch.testing.assert_close(parts[k], whole[k], atol=2e-6, rtol=1e-4)
    # with the aux loss on the step differs (it is averaged over micro-batches), but only slightly
    _, r3 = _one_step(make_cfg, synth_dirs, **{"train.micro-batch-size": 2})
    assert r3.steps == 1 and r3.aux_losses


def test_gradient_checkpointing_changes_memory_not_results(make_cfg, synth_dirs):
    plain, r0 = _one_step(make_cfg, synth_dirs)
    ckpt, res = _one_step(make_cfg, synth_dirs, **{"train.gradient-checkpointing": True})
    assert res.steps == 1
    assert (r0.router_calls, res.router_calls) == (1, 2)  # the layer's forward is recomputed in the backward
    for k in plain:
        torch.testing.assert_close(ckpt[k], plain[k], atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------ cache
def test_the_base_is_loaded_once_per_process(make_cfg, tmp_path):
    cfg = make_cfg(**{"model.trainable": "lora"})
    model, _ = build_model(cfg.model)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    build_default_tokenizer().save_pretrained(ckpt)
    base_mod.clear_cache()
    first, _ = prepared_model(cfg.model, str(ckpt))
    p0 = next(p for p in first.parameters() if p.requires_grad)
    p0.grad = torch.ones_like(p0)
    again, _ = prepared_model(cfg.model, str(ckpt))
    assert again is first and all(p.grad is None for p in again.parameters())
    weights = next(ckpt.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # the checkpoint was replaced
    assert prepared_model(cfg.model, str(ckpt))[0] is not first
    other = dataclasses.replace(cfg.model, lora_r=4)
    assert prepared_model(other, str(ckpt))[0] is not first
    base_mod.clear_cache()


# ------------------------------------------------------------------------------------------ fingerprint
def test_checkpoint_fingerprint_is_cached_and_follows_the_weights(make_cfg, tmp_path):
    cfg = make_cfg()
    model, _ = build_model(cfg.model)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    build_default_tokenizer().save_pretrained(ckpt)
    fp = base_fingerprint(cfg.model, str(ckpt))
    assert (ckpt / SIDECAR).is_file() and base_fingerprint(cfg.model, str(ckpt)) == fp
    # same size, different bytes (a fine-tuned base with the same shapes): a different fingerprint
    weights = next(ckpt.glob("*.safetensors"))
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    assert base_fingerprint(cfg.model, str(ckpt)) != fp
    # the tokenizer is part of the base: a different vocabulary would silently change every token id
    weights.write_bytes(bytes(raw[:-1]) + bytes([raw[-1] ^ 0xFF]))
    assert base_fingerprint(cfg.model, str(ckpt)) == fp
    cfgfile = ckpt / "tokenizer_config.json"
    cfgfile.write_text(cfgfile.read_text().replace("{", "{ ", 1))
    assert base_fingerprint(cfg.model, str(ckpt)) != fp


def test_fingerprint_of_a_read_only_checkpoint(make_cfg, tmp_path):
    cfg = make_cfg()
    model, _ = build_model(cfg.model)
    ckpt = tmp_path / "ro"
    model.save_pretrained(ckpt)
    fp = base_fingerprint(cfg.model, str(ckpt))
    (ckpt / SIDECAR).unlink()
    ckpt.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        assert base_fingerprint(cfg.model, str(ckpt)) == fp
        assert not (ckpt / SIDECAR).exists()
    finally:
        ckpt.chmod(stat.S_IRWXU)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError, match="no weight files"):
        base_fingerprint(cfg.model, str(empty))


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "deepseek_v2", "deepseek_v3", "glm4_moe"])
def test_a_real_family_checkpoint_trains_with_a_bf16_base(family, make_cfg, tmp_path):
    """A checkpoint loaded directly in bfloat16 (no float32 copy): the frozen base stays bf16, the adapters
    train in float32 under autocast, and what would travel is float32 on the CPU."""
    from distmoe.model.build import describe
    from distmoe.model.fabricate import write_checkpoint
    from distmoe.train.sft import train_sft

    ckpt = write_checkpoint(family, tmp_path / family)
    cfg = make_cfg(**{"model.path": str(ckpt), "model.trainable": "lora", "train.dtype": "bfloat16",
                      "train.device": "cpu", "train.local-steps": 2, "train.batch-size": 2})
    base_mod.clear_cache()
    model, tok = prepared_model(cfg.model, "", resolve_runtime(cfg.train, "lora"))
    frozen = {n: p.dtype for n, p in model.named_parameters() if not p.requires_grad}
    # a family may keep its router in float32 (transformers' _keep_in_fp32_modules: DeepSeek's gate)
    assert all(d == torch.bfloat16 or ".mlp.gate." in n for n, d in frozen.items()), frozen
    ms = describe(model)
    encoded = [(ids, ids) for ids in ([5, 6, 7, 8, 9], [9, 8, 7, 6], [4, 4, 5, 6, 7, 8])]
    before = trainable_state(model)
    res = train_sft(model, encoded, tok.pad_token_id, cfg.train, cfg.routing, ms.num_experts, ms.top_k,
                    torch.full((ms.num_moe_layers, ms.num_experts), 1.0 / ms.num_experts), 0)
    assert res.steps == 2 and res.skipped_steps == 0 and res.anchor_kls
    after = trainable_state(model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    base_mod.clear_cache()


@pytest.mark.slow  # a real subprocess (imports torch, transformers and distmoe afresh)
def test_a_message_maps_the_base_kept_by_the_first_one(make_cfg, tmp_path):
    """Deployment: every message is a new process. The first keeps the loaded base (fused layout, its dtype) as
    one file; the next maps it (no load, no copy) and computes exactly what a fresh load computes."""
    import subprocess
    import sys

    from distmoe.model.base import mapped_base, write_mapped_base
    from distmoe.model.fabricate import write_checkpoint

    ckpt = write_checkpoint("qwen3_moe", tmp_path / "ckpt")
    cache = tmp_path / "cache"
    cfg = make_cfg(**{"model.path": str(ckpt), "model.trainable": "lora", "train.dtype": "bfloat16",
                      "train.device": "cpu"})
    rt = resolve_runtime(cfg.train, "lora")
    fp = base_fingerprint(cfg.model)
    assert mapped_base(ckpt, cache, fp, rt) is None  # nothing kept yet
    base_mod.clear_cache()
    first, tok = prepared_model(cfg.model, "", rt, cache)
    files = list(cache.glob("base-*.pt"))
    assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
    mapped, tok2 = mapped_base(ckpt, cache, fp, rt)
    assert tok2.chat_template == tok.chat_template
    assert all(p.dtype == torch.bfloat16 for p in mapped.parameters())
    ids = torch.randint(3, 200, (2, 9))
    with torch.no_grad():
        ref = forward_with_router(build_model(cfg.model, "", rt)[0], ids, torch.ones_like(ids))
        got = forward_with_router(mapped, ids, torch.ones_like(ids))
    torch.testing.assert_close(got.logits, ref.logits, rtol=0, atol=0)
    # a file of another base (a different fingerprint) is not used
    assert mapped_base(ckpt, cache, "0" * 64, rt) is None
    write_mapped_base(mapped, cache, "f" * 64, rt)  # one base per party: the other file goes
    assert [f.name[:25] for f in cache.glob("base-*.pt")] == ["base-ffffffffffffffffffff"]
    # and in a fresh process (as a deployed message): mapped, not loaded from the checkpoint
    write_mapped_base(mapped, cache, fp, rt)  # (a new file replaces the old by rename: live mappings stay valid)
    code = ("import sys, torch; from distmoe.config import parse_run_config; "
            "from distmoe.model.base import prepared_model; from distmoe.model.device import resolve_runtime; "
            "from transformers import AutoModelForCausalLM as A; "
            "A.from_pretrained = classmethod(lambda *a, **k: sys.exit('loaded the checkpoint')); "
            f"c = parse_run_config({{'model.path': {str(ckpt)!r}, 'model.trainable': 'lora', "
            "'train.dtype': 'bfloat16', 'train.device': 'cpu'}); "
            "from pathlib import Path; "
            f"m, _ = prepared_model(c.model, '', resolve_runtime(c.train, 'lora'), Path({str(cache)!r})); "
            "print('MAPPED', sum(p.numel() for p in m.parameters()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "MAPPED" in out.stdout, out.stderr[-2000:]
    # a truncated file is ignored and rewritten by the next load (no mapping of it is used after this)
    del mapped, got
    files = list(cache.glob("base-*.pt"))
    files[0].write_bytes(files[0].read_bytes()[:1000])
    assert mapped_base(ckpt, cache, fp, rt) is None
    base_mod.clear_cache()
    prepared_model(cfg.model, "", rt, cache)
    assert mapped_base(ckpt, cache, fp, rt) is not None
    base_mod.clear_cache()
