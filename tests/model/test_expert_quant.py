"""Unit tests: 4-bit (NF4) expert stacks (``distmoe.model.expert_quant``) dequantised for the routed experts only
inside the routed expert LoRA, on a fabricated checkpoint of every supported family."""

from __future__ import annotations

import pytest
import torch

from distmoe.config import ConfigError, parse_run_config
from distmoe.model import expert_lora
from distmoe.model.build import SUPPORTED_FAMILIES, build_model
from distmoe.model.expert_quant import BLOCK, PROJECTIONS, NF4Stack, QuantError, quantize_experts
from distmoe.model.fabricate import write_checkpoint
from distmoe.model.trainable import apply_trainable


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("expert-quant")
    return {f: write_checkpoint(f, base / f, seed=4) for f in SUPPORTED_FAMILIES}


def _adapted(path, quant):
    cfg = parse_run_config({"model.path": str(path), "model.trainable": "lora", "model.quantize-experts": quant})
    model = apply_trainable(build_model(cfg.model)[0], cfg.model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every adapter away from its no-op start
        for _, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_nf4_experts_compute_what_their_dequantised_weights_do(family, checkpoints):
    quant, ref = _adapted(checkpoints[family], "nf4"), _adapted(checkpoints[family], "none")
    stacks = [(n, m) for n, m in quant.named_modules() if isinstance(m, NF4Stack)]
    params = dict(ref.named_parameters())
    assert stacks and not any(n.removesuffix("_nf4") in dict(quant.named_parameters()) for n, _ in stacks)
    with torch.no_grad():
        for name, stack in stacks:
            w = params[name.removesuffix("_nf4")]
            err = float((stack.dequantize() - w).abs().mean() / w.abs().mean())
            assert 0 < err < 0.5  # NF4 really rounds (0.13-0.28 of the mean |w| on these random weights)
            w.copy_(stack.dequantize())
    ids = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    (lq, gq), (lr, gr) = _step(quant, ids), _step(ref, ids)
    torch.testing.assert_close(lq, lr, rtol=1e-5, atol=1e-5)
    assert gq.keys() == gr.keys()
    for n in gq:
        torch.testing.assert_close(gq[n], gr[n], rtol=1e-4, atol=1e-6)


def test_nf4_storage_is_half_a_byte_per_weight_and_dequantises_the_routed_experts_only(checkpoints):
    model = _adapted(checkpoints["qwen3_moe"], "nf4")
    stack = next(m for m in model.modules() if isinstance(m, NF4Stack))
    e, a, b = stack.shape
    assert stack.packed.dtype == torch.uint8 and stack.packed.numel() == e * a * b // 2
    assert stack.absmax.numel() == e * a * b // BLOCK
    seen: list[int] = []
    for m in model.modules():
        if isinstance(m, NF4Stack):
            orig = m.dequantize
            m.dequantize = lambda experts=None, orig=orig: (seen.append(experts.numel()), orig(experts))[1]
    with torch.no_grad():
        model(input_ids=torch.tensor([[7]]), use_cache=False)  # one token: top_k experts per layer
    k = int(model.config.num_experts_per_tok)
    assert seen and all(n == k for n in seen) and k < e


def test_nf4_is_refused_where_nothing_dequantises(checkpoints):
    path = str(checkpoints["qwen3_moe"])
    with pytest.raises(ConfigError, match="model.quantize-experts.*lora-experts"):
        parse_run_config({"model.path": path, "model.trainable": "lora", "model.lora-experts": False,
                          "model.quantize-experts": "nf4"})
    with pytest.raises(ConfigError, match="model.quantize-experts"):
        parse_run_config({"model.path": path, "model.trainable": "all", "model.quantize-experts": "nf4"})
    model = _adapted(checkpoints["qwen3_moe"], "none")
    expert_lora.install(model, routed=False)  # peft's own forward would read the removed weights
    with pytest.raises(QuantError, match="routed expert LoRA"):
        quantize_experts(model)


def test_disabled_adapters_run_the_nf4_base(checkpoints):
    model = _adapted(checkpoints["mixtral"], "nf4")
    ids = torch.tensor([[5, 9, 11]])
    with torch.no_grad():
        on = model(input_ids=ids, use_cache=False).logits
        with model.disable_adapter():
            off = model(input_ids=ids, use_cache=False).logits
    assert torch.isfinite(off).all() and not torch.equal(on, off)


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_experts_loaded_straight_into_4_bits_equal_quantising_after_the_load(family, checkpoints):
    path = str(checkpoints[family])
    nf4 = parse_run_config({"model.path": path, "model.trainable": "lora", "model.quantize-experts": "nf4"}).model
    full = parse_run_config({"model.path": path, "model.trainable": "lora"}).model
    loaded = build_model(nf4)[0]
    stacks = [m for m in loaded.modules() if hasattr(m, "has_gate")]
    # while loading, every stack's weight became its 4-bit form and a one-element placeholder of the same shape
    assert stacks and all(p.stride() == (0, 0, 0) for m in stacks for n, p in m.named_parameters(recurse=False)
                          if n in PROJECTIONS)
    streamed = apply_trainable(loaded, nf4)
    after = apply_trainable(build_model(full)[0], nf4)  # the full-precision load, quantised afterwards
    s, a = streamed.state_dict(), after.state_dict()
    assert s.keys() == a.keys() and any(k.endswith("_nf4.packed") for k in s)
    for k in s:
        assert torch.equal(s[k], a[k]), k
    ids = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ls, la = streamed(input_ids=ids, use_cache=False).logits, after(input_ids=ids, use_cache=False).logits
    assert torch.equal(ls, la)


def test_a_stack_loaded_in_4_bits_refuses_to_run_until_the_routed_expert_lora_installs_it(checkpoints):
    path = str(checkpoints["olmoe"])
    cfg = parse_run_config({"model.path": path, "model.trainable": "lora", "model.quantize-experts": "nf4"}).model
    model = build_model(cfg)[0]  # the placeholders are not the weights: no silent zero experts
    with pytest.raises(QuantError, match="quantised to 4 bits while loading"), torch.no_grad():
        model(input_ids=torch.tensor([[5, 9]]), use_cache=False)


def test_a_4bit_training_step_keeps_no_dequantised_expert_weights_for_the_backward(checkpoints):
    model = _adapted(checkpoints["qwen3_moe"], "nf4")
    stacks = {m.shape[1:] for m in model.modules() if isinstance(m, NF4Stack)}
    stacks |= {s[::-1] for s in stacks}
    saved: list[tuple[int, ...]] = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    ids = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids, use_cache=False)
    assert saved and not [s for s in saved if len(s) == 3 and s[1:] in stacks]  # dequantised again in the backward
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
