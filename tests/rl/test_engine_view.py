"""The inference engine as a view over the policy's own weights (``distmoe.rl.engine_view``): the same token ids
and log-probs as the deep-copy engine for every profile, on plain and peft models of several families; no tensor
of its own beyond the dynamically quantised linears; the policy untouched; ``int8-dynamic`` on a peft model; the
GRPO reference sharing the frozen base."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distmoe.config import parse_run_config
from distmoe.model.build import build_model, num_experts, router_modules
from distmoe.model.fabricate import write_checkpoint
from distmoe.model.trainable import apply_trainable
from distmoe.rl.engine_view import share_copy
from distmoe.rl.engines import InferenceEngine
from distmoe.rl.rollout import generate_rollouts, train_logprobs
from distmoe.rl.simulator import InferenceSimulator

PROFILES = ("exact", "bf16", "int8-dynamic", "int8-weight-only", "prune-1", "bf16+prune-1",
            "int8-weight-only+bf16", "int8-dynamic+int8-weight-only", "int4-experts", "int2g16-experts+prune-1")
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Fabricated checkpoints: a peft LoRA model (routed expert adapters, router and attention LoRA) of three
    families, and a plain (no peft) Qwen3-MoE, each with its usage table for ``prune-k``."""
    base = tmp_path_factory.mktemp("engine-view")
    out = {}
    for name, family, lora in (("qwen3_moe", "qwen3_moe", True), ("gpt_oss", "gpt_oss", True),
                               ("mixtral", "mixtral", True), ("qwen3_moe-plain", "qwen3_moe", False)):
        path = write_checkpoint(family, base / name, seed=4)
        cfg = parse_run_config({"model.path": str(path), "model.trainable": "lora" if lora else "all"})
        model, tok = build_model(cfg.model)
        if lora:
            model = apply_trainable(model, cfg.model)
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():  # adapters away from their no-op start, so a dropped adapter would show
                for _, p in model.named_parameters():
                    if p.requires_grad:
                        p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        usage = torch.rand(len(router_modules(model)), num_experts(model), generator=torch.Generator().manual_seed(1))
        out[name] = (model, tok, usage)
    return out


def _rollouts(model, tok, usage, profile, share):
    eng = InferenceEngine(model, profile, usage=usage, share_weights=share)
    return eng, generate_rollouts(eng, tok, PROMPTS, 3, 6, 1.0, seed=0)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "mixtral", "qwen3_moe-plain"])
def test_view_gives_the_deep_copy_rollouts_for_every_profile(models, name):
    model, tok, usage = models[name]
    before = {n: t.clone() for n, t in model.state_dict().items()}
    logps = {}
    for profile in PROFILES:
        _, view = _rollouts(model, tok, usage, profile, True)
        _, copy = _rollouts(model, tok, usage, profile, False)
        assert torch.equal(view.sequences, copy.sequences), profile
        assert torch.equal(view.logp_infer, copy.logp_infer), profile
        logps[profile] = view.logp_infer
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())  # the policy untouched
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for profile in ("bf16", "int8-weight-only"):  # the profiles really change the numbers (not the policy's own)
        assert not torch.equal(logps[profile], logps["exact"]), profile


@pytest.mark.parametrize("profile", ["exact", "bf16", "int8-weight-only+bf16", "prune-1", "int8-dynamic"])
def test_view_holds_no_float_tensor_of_its_own(models, profile):
    model, tok, usage = models["qwen3_moe"]
    eng = InferenceEngine(model, profile, usage=usage)
    policy = {t.data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    own = [n for n, t in list(eng.model.named_parameters()) + list(eng.model.named_buffers())
           if t.is_floating_point() and t.data_ptr() not in policy]
    assert own == []
    generate_rollouts(eng, tok, PROMPTS, 2, 3, 1.0, seed=0)
    assert all(t.data_ptr() in policy for t in eng.model.parameters())  # every on-the-fly swap was put back
    quantised = [m for m in eng.model.modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
    assert bool(quantised) == (profile == "int8-dynamic")


def test_view_forward_builds_no_graph_over_the_policy(models):
    model, tok, usage = models["qwen3_moe"]
    eng = InferenceEngine(model, "bf16")
    ids = torch.tensor([PROMPTS[0]])
    with torch.enable_grad():
        out = eng.model(input_ids=ids, use_cache=False)
    assert not out.logits.requires_grad and torch.is_grad_enabled() is True


def test_int8_dynamic_engine_runs_on_a_peft_model(models):
    model, tok, usage = models["qwen3_moe"]
    eng = InferenceEngine(model, "int8-dynamic")
    ro = generate_rollouts(eng, tok, PROMPTS, 3, 6, 1.0, seed=0)
    delta = (train_logprobs(model, ro) - ro.logp_infer)[ro.response_mask]
    assert 0 < float(delta.abs().max()) < 0.5  # genuine, small mismatch: int8 attention, float32 adapters
    factors = [m for n, m in eng.model.named_modules() if n.split(".")[-2:-1] in (["lora_A"], ["lora_B"])]
    assert factors and all(type(m) is nn.Linear and m.weight.dtype == torch.float32 for m in factors)
    bases = [m for n, m in eng.model.named_modules() if n.endswith("q_proj.base_layer")]
    assert bases and all(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in bases)  # attention: int8


def test_simulator_calibrates_alike_on_view_and_copy(models):
    model, tok, usage = models["qwen3_moe"]
    fits = []
    for share in (True, False):
        eng, ro = _rollouts(model, tok, usage, "bf16+prune-1", share)
        sim = InferenceSimulator.for_model(model, seed=0)
        fits.append(sim.calibrate(model, eng, ro))
    assert fits[0] == fits[1]


def test_reference_copy_shares_the_frozen_base_only(models):
    model, _, _ = models["qwen3_moe"]
    ref = share_copy(model, share=lambda t: not t.requires_grad)
    pol = dict(model.named_parameters())
    for n, t in ref.named_parameters():
        assert (t.data_ptr() == pol[n].data_ptr()) == (not pol[n].requires_grad), n
    name = next(n for n, p in pol.items() if p.requires_grad)
    with torch.no_grad():
        pol[name].add_(1.0)
    assert not torch.equal(dict(ref.named_parameters())[name], pol[name])  # the reference keeps the round's start
    with torch.no_grad():
        pol[name].sub_(1.0)


def test_view_over_nf4_experts_gives_the_deep_copy_rollouts(tmp_path):
    path = write_checkpoint("qwen3_moe", tmp_path / "q", seed=4)
    cfg = parse_run_config({"model.path": str(path), "model.trainable": "lora", "model.quantize-experts": "nf4"})
    model, tok = build_model(cfg.model)
    model = apply_trainable(model, cfg.model)
    for profile in ("exact", "bf16"):
        _, view = _rollouts(model, tok, None, profile, True)
        _, copy = _rollouts(model, tok, None, profile, False)
        assert torch.equal(view.sequences, copy.sequences) and torch.equal(view.logp_infer, copy.logp_infer)
