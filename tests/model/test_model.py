"""Unit tests: tiny model build and determinism, router capture, trainable selection, checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from distmoe.config import replace
from distmoe.model.base import base_fingerprint
from distmoe.model.build import (
    ModelError,
    build_model,
    describe,
    hash_tensors,
    load_checkpoint,
    param_count,
    router_modules,
)
from distmoe.model.router import RouterRecorder, forward_with_router, topk_experts
from distmoe.model.trainable import (
    TrainableError,
    apply_trainable,
    grouped_parameters,
    load_trainable,
    param_group,
    spec_of,
    trainable_names,
    trainable_state,
)


def _ids(b=2, s=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, 100, (b, s), generator=g)


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _trainable(make_cfg, mode: str, seed: int = 0):
    cfg = make_cfg(**{"model.trainable": mode, "run.seed": seed})
    model, tok = build_model(cfg.model)
    return apply_trainable(model, cfg.model), cfg


# ------------------------------------------------------------------------------------------ build
def test_build_is_deterministic_per_seed(make_cfg, cfg):
    m1, _ = build_model(cfg.model)
    m2, _ = build_model(cfg.model)
    p1, p2 = _params(m1), _params(m2)
    assert p1.keys() == p2.keys()
    assert all(torch.equal(p1[k], p2[k]) for k in p1)
    assert hash_tensors(p1) == hash_tensors(p2)
    m3, _ = build_model(make_cfg(**{"run.seed": 1}).model)
    p3 = _params(m3)
    assert hash_tensors(p3) != hash_tensors(p1)
    assert not torch.equal(p3["model.layers.0.mlp.gate.weight"], p1["model.layers.0.mlp.gate.weight"])
    assert not m1.training  # eval mode
    assert all(p.dtype == torch.float32 for p in m1.parameters())


def test_hash_tensors_sensitive_to_values_and_names():
    a = {"x": torch.zeros(3), "y": torch.ones(2)}
    assert hash_tensors(a) == hash_tensors({"y": torch.ones(2), "x": torch.zeros(3)})
    assert hash_tensors(a) != hash_tensors({"x": torch.zeros(3), "y": torch.tensor([1.0, 1.5])})
    assert hash_tensors(a) != hash_tensors({"z": torch.zeros(3), "y": torch.ones(2)})
    assert hash_tensors(a) != hash_tensors({"x": torch.zeros(1, 3), "y": torch.ones(2)})


def test_describe_matches_config(cfg):
    model, tok = build_model(cfg.model)
    spec = describe(model)
    assert spec.family == "qwen3_moe"
    assert spec.moe_layers == (0, 1) and spec.num_moe_layers == cfg.model.layers
    assert spec.num_experts == cfg.model.experts == 4
    assert spec.top_k == cfg.model.top_k == 2
    assert spec.hidden_size == 64
    assert spec.vocab_size >= len(tok)
    assert spec.router_spec() == {"family": "qwen3_moe", "moe_layers": [0, 1], "num_experts": 4, "top_k": 2}


# ------------------------------------------------------------------------------------------ router capture
def test_forward_with_router_shapes_and_topk_match_router(cfg):
    model, _ = build_model(cfg.model)
    ids = _ids(2, 6)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    captured = []
    routers = router_modules(model)
    assert len(routers) == 2
    handles = [m.register_forward_hook(lambda _m, _i, out: captured.append(out)) for _, m in routers]
    try:
        with torch.no_grad():
            out = forward_with_router(model, ids, mask)
    finally:
        for h in handles:
            h.remove()
    assert out.logits.shape == (2, 6, model.config.vocab_size)
    assert len(out.router_logits) == 2
    assert all(z.shape == (12, 4) for z in out.router_logits)
    assert out.stacked().shape == (2, 12, 4)
    assert len(captured) == 2
    for z, (r_logits, _scores, r_idx) in zip(out.router_logits, captured, strict=True):
        torch.testing.assert_close(z, r_logits)
        mine = topk_experts(z, 2)
        assert mine.shape == (12, 2)
        assert torch.equal(mine.sort(-1).values, r_idx.sort(-1).values)


def test_router_recorder_forward_and_generate(cfg):
    model, tok = build_model(cfg.model)
    ids = _ids(2, 5)
    with torch.no_grad(), RouterRecorder(model) as rec:
        out = forward_with_router(model, ids, torch.ones_like(ids))
    assert sorted(rec.calls) == [0, 1]
    for li in range(2):
        assert len(rec.calls[li]) == 1
        torch.testing.assert_close(rec.calls[li][0], out.router_logits[li])
    new = 4
    with torch.no_grad(), RouterRecorder(model) as rec:
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape == (2, 5 + new)
    for li in range(2):
        shapes = [tuple(t.shape) for t in rec.calls[li]]
        assert shapes == [(10, 4)] + [(2, 4)] * (new - 1)  # prefill, then one call per decode step
    # hooks are removed on exit
    with torch.no_grad():
        forward_with_router(model, ids, torch.ones_like(ids))
    assert len(rec.calls[0]) == new


# ------------------------------------------------------------------------------------------ trainable
def test_trainable_all(make_cfg):
    model, cfg = _trainable(make_cfg, "all")
    names = trainable_names(model)
    assert names == sorted(n for n, _ in model.named_parameters())
    spec = spec_of(model, "all")
    assert spec.numel == param_count(model)
    assert spec.keys == tuple(names)


def test_trainable_router_experts_selection(make_cfg):
    model, cfg = _trainable(make_cfg, "router+experts")
    names = trainable_names(model)
    expected = sorted(n for n, _ in model.named_parameters()
                      if ".experts." in n or n.endswith("mlp.gate.weight"))
    assert names == expected
    assert len(names) == 3 * cfg.model.layers  # gate_up_proj, down_proj, router per layer
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert any("self_attn" in n for n in frozen) and any("embed_tokens" in n for n in frozen)
    spec = spec_of(model, "router+experts")
    params = dict(model.named_parameters())
    assert spec.shapes == tuple((n, tuple(params[n].shape)) for n in expected)
    assert set(trainable_state(model)) == set(expected)


def test_load_trainable_roundtrip_and_rejections(make_cfg):
    model, _ = _trainable(make_cfg, "router+experts")
    other, _ = _trainable(make_cfg, "router+experts")
    spec = spec_of(model, "router+experts")
    state = {k: v + 0.5 for k, v in trainable_state(model).items()}
    load_trainable(other, state, spec)
    got = trainable_state(other)
    assert all(torch.equal(got[k], state[k]) for k in state)
    key = spec.keys[0]
    missing = {k: v for k, v in state.items() if k != key}
    with pytest.raises(TrainableError, match="missing"):
        load_trainable(other, missing, spec)
    with pytest.raises(TrainableError, match="unexpected"):
        load_trainable(other, {**state, "model.extra.weight": torch.zeros(1)}, spec)
    with pytest.raises(TrainableError, match="shape") as ei:
        load_trainable(other, {**state, key: torch.zeros(3)}, spec)
    assert key in str(ei.value)
    bad = state[key].clone()
    bad.view(-1)[0] = float("nan")
    with pytest.raises(TrainableError, match="NaN") as ei:
        load_trainable(other, {**state, key: bad}, spec)
    assert key in str(ei.value)
    inf = state[key].clone()
    inf.view(-1)[1] = float("inf")
    with pytest.raises(TrainableError):
        load_trainable(other, {**state, key: inf}, spec)


def test_tiny_fingerprint_depends_on_seed_and_shape_only(make_cfg):
    a, b = make_cfg().model, make_cfg().model
    assert base_fingerprint(a) == base_fingerprint(b)
    assert base_fingerprint(make_cfg(**{"run.seed": 1}).model) != base_fingerprint(a)
    assert base_fingerprint(make_cfg(**{"model.lora-r": 4}).model) == base_fingerprint(a)  # not the base


def test_lora_trainable_adapters(make_cfg):
    cfg = make_cfg(**{"model.trainable": "lora"})
    base, _ = build_model(cfg.model)
    ids = _ids(2, 5)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref = forward_with_router(base, ids, mask)
    model = apply_trainable(base, cfg.model)
    names = trainable_names(model)
    assert names and all("lora_" in n for n in names)
    assert any("experts" in n for n in names), names
    assert any("mlp.gate" in n for n in names), names  # model.lora-router defaults to true
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    with torch.no_grad():
        out = forward_with_router(model, ids, mask)
    assert len(out.router_logits) == 2 and all(z.shape == (10, 4) for z in out.router_logits)
    # peft's default init makes the adapters a no-op: same outputs as the base model
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
    for z, r in zip(out.router_logits, ref.router_logits, strict=True):
        torch.testing.assert_close(z, r, atol=1e-5, rtol=1e-5)
    # every node starts from the same adapter (deterministic initialisation)
    again, _ = _trainable(make_cfg, "lora")
    s1, s2 = trainable_state(model), trainable_state(again)
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)


def test_router_recorder_on_lora_model(make_cfg):
    cfg = make_cfg(**{"model.trainable": "lora"})
    model = apply_trainable(build_model(cfg.model)[0], cfg.model)
    assert describe(model).moe_layers == (0, 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    ids = _ids(2, 5)
    with torch.no_grad(), RouterRecorder(model) as rec:
        out = forward_with_router(model, ids, torch.ones_like(ids))
    with torch.no_grad():
        base = forward_with_router(build_model(cfg.model)[0], ids, torch.ones_like(ids))
    for li in range(2):
        assert len(rec.calls[li]) == 1
        torch.testing.assert_close(rec.calls[li][0], out.router_logits[li])
        # the adapter on the router changes the routing (the hook sees adapted logits)
        assert not torch.allclose(out.router_logits[li], base.router_logits[li], atol=1e-4)


def test_lora_without_router_adapter(make_cfg):
    cfg = make_cfg(**{"model.trainable": "lora", "model.lora-router": False})
    model = apply_trainable(build_model(cfg.model)[0], cfg.model)
    names = trainable_names(model)
    assert not any("mlp.gate" in n for n in names)
    assert any("experts" in n for n in names)


def test_param_group_names():
    pre = ("model.layers.0.mlp.gate", "model.layers.1.mlp.gate")
    assert param_group("model.layers.0.mlp.experts.gate_up_proj", pre) == "experts"
    assert param_group("model.layers.1.mlp.experts.down_proj", pre) == "experts"
    assert param_group("model.layers.0.mlp.gate.weight", pre) == "router"
    assert param_group("base_model.model.model.layers.1.mlp.gate.weight", pre) == "router"
    assert param_group("model.layers.0.self_attn.q_proj.weight", pre) == "rest"
    assert param_group("model.embed_tokens.weight", pre) == "rest"
    assert param_group("model.layers.0.mlp.gate_proj.weight", pre) == "rest"  # not the router


def test_grouped_parameters_all_mode(make_cfg):
    model, _ = _trainable(make_cfg, "all")
    groups = grouped_parameters(model)
    by_id = {id(p): n for n, p in model.named_parameters()}
    names = {g: sorted(by_id[id(p)] for p in ps) for g, ps in groups.items()}
    assert names["router"] == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    assert names["experts"] == sorted(n for n in by_id.values() if ".mlp.experts." in n)
    assert len(names["experts"]) == 4
    assert "model.layers.0.self_attn.q_proj.weight" in names["rest"]
    assert "model.embed_tokens.weight" in names["rest"]
    assert sum(len(v) for v in names.values()) == len(by_id)


def test_grouped_parameters_lora_mode(make_cfg):
    """LoRA adapters on the router train with the router learning rate, expert adapters with experts'."""
    model, _ = _trainable(make_cfg, "lora")
    groups = grouped_parameters(model)
    by_id = {id(p): n for n, p in model.named_parameters()}
    names = {g: sorted(by_id[id(p)] for p in ps) for g, ps in groups.items()}
    gate_adapters = sorted(n for n in trainable_names(model) if ".mlp.gate." in n)
    assert len(gate_adapters) == 4  # lora_A and lora_B on each of the 2 routers
    misplaced = {g: [n for n in gate_adapters if n in names[g]] for g in ("experts", "rest")}
    assert names["router"] == gate_adapters, f"router LoRA adapters not in the router group: {misplaced}"
    assert names["experts"] and all(".experts." in n for n in names["experts"])
    assert all("self_attn" in n for n in names["rest"]), names["rest"]


# ------------------------------------------------------------------------------------------ checkpoints
def test_load_checkpoint_saved_with_save_pretrained(cfg, tmp_path):
    model, tok = build_model(cfg.model)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, ltok = load_checkpoint(tmp_path)
    assert describe(loaded) == describe(model)
    p1, p2 = _params(model), _params(loaded)
    assert p1.keys() == p2.keys() and all(torch.equal(p1[k], p2[k]) for k in p1)
    assert ltok.encode("Compute 7+5") == tok.encode("Compute 7+5")
    assert ltok.pad_token_id == tok.pad_token_id
    via_build, _ = build_model(cfg.model, model_path=str(tmp_path))
    assert hash_tensors(_params(via_build)) == hash_tensors(p1)
    assert not via_build.training


def test_load_checkpoint_rejects_non_moe_and_missing(make_cfg, tmp_path):
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 64}))
    with pytest.raises(ModelError) as ei:
        load_checkpoint(d)
    assert "llama" in str(ei.value) and "architecture" in str(ei.value)
    with pytest.raises(ModelError, match="not a directory"):
        load_checkpoint(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError, match="config.json"):
        load_checkpoint(empty)
    with pytest.raises(ModelError):
        build_model(replace(make_cfg().model, path=str(d)))


def test_hash_tensors_hashes_exactly_the_float32_bytes_in_name_order():
    """The digest (manifests' ``trainable_hash``, the probe's model key) is SHA-256 over each name, its shape and
    the float32 bytes, whatever the tensor's layout or dtype: hashed in place, it must equal the copied bytes'."""
    import hashlib

    g = torch.Generator().manual_seed(3)
    ts = {"b.w": torch.randn(5, 3, generator=g).t(), "a.b": torch.randn(4, generator=g).to(torch.bfloat16),
          "c.s": torch.tensor(2.5), "d.e": torch.zeros(0, 2), "e.g": torch.randn(2, 2, generator=g, requires_grad=True)}
    h = hashlib.sha256()
    for name in sorted(ts):
        t = ts[name].detach().to(torch.float32)
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.contiguous().numpy().tobytes())
    assert hash_tensors(ts) == h.hexdigest()
    ts["b.w"] = ts["b.w"].contiguous()
    assert hash_tensors(ts) == h.hexdigest()  # the layout is not hashed, the values are
