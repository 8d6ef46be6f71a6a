"""Dynamic expert expansion (model/expand.py): the surgery's shapes and copies, the function kept for tokens
that stay on the old experts, the sources from an anchor, the refusals, and the freezing masks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distmoe.config import ConfigError
from distmoe.model.build import ModelError, build_model, describe
from distmoe.model.expand import (
    base_experts,
    default_sources,
    expand_experts,
    experts_in,
    frozen_set,
    pad_anchor,
    resize_to,
    stages,
)
from distmoe.model.trainable import apply_trainable, spec_of, trainable_state
from distmoe.train.retention import ProtectedUpdate, frozen_masks


def _model(make_cfg, **kw):
    cfg = make_cfg(**kw)
    model, _ = build_model(cfg.model)
    return apply_trainable(model, cfg.model), cfg


def test_surgery_adds_copied_experts_and_router_rows_to_every_moe_layer(make_cfg):
    model, cfg = _model(make_cfg, **{"model.trainable": "router+experts"})
    before = {k: v.clone() for k, v in trainable_state(model).items()}
    ms = describe(model)
    assert ms.num_experts == 4
    sources = [[2, 0], [1, 3]]
    assert expand_experts(model, sources) == 6
    after = trainable_state(model)
    assert describe(model).num_experts == 6 and model.config.num_experts == 6 and base_experts(model) == 4
    assert model.num_experts == 6  # the causal LM's own count (transformers' aux loss reads it)
    ids = torch.randint(0, 100, (2, 5))
    assert model(input_ids=ids, output_router_logits=True).router_logits[0].shape == (10, 6)
    for li, layer in enumerate(ms.moe_layers):
        mlp = model.model.layers[layer].mlp
        assert mlp.gate.num_experts == 6 and mlp.experts.num_experts == 6
        for name in (f"model.layers.{layer}.mlp.experts.gate_up_proj", f"model.layers.{layer}.mlp.experts.down_proj",
                     f"model.layers.{layer}.mlp.gate.weight"):
            old, new = before[name], after[name]
            assert new.shape == (6, *old.shape[1:])
            assert torch.equal(new[:4], old)  # the earlier experts and router rows are untouched
            assert torch.equal(new[4:], old[sources[li]])  # the new ones copy their sources
    # the trainable spec follows the new shape, still exactly the trainable tensors
    spec = spec_of(model, "router+experts")
    assert experts_in(dict(spec.shapes)) == 6
    assert all(p.requires_grad for n, p in model.named_parameters() if ".experts." in n or ".gate." in n)


def test_expanded_block_keeps_the_output_of_tokens_routed_to_old_experts(make_cfg):
    torch.manual_seed(0)
    model, _ = _model(make_cfg, **{"model.trainable": "all"})
    block = model.model.layers[0].mlp
    h = 64
    v = torch.randn(h)
    x = (v + 0.01 * torch.randn(1, 10, h))  # [1, 10, H] tokens around one direction
    with torch.no_grad():
        old_out = block(x)  # [1, 10, H]
        old_logits, _, old_idx = block.gate(x.reshape(-1, h))
    expand_experts(model, [[0, 1], [0, 1]])
    with torch.no_grad():
        block.gate.weight[4:] = -50.0 * v / v.norm() ** 2  # new router rows: logits ~ -50 on these tokens
        logits, _, idx = block.gate(x.reshape(-1, h))
        new_out = block(x)
    assert logits.shape == (10, 6) and torch.equal(logits[:, :4], old_logits)
    assert (logits[:, 4:] < -40).all() and torch.equal(idx, old_idx)  # the new experts are never chosen
    assert torch.allclose(new_out, old_out, atol=1e-6)  # norm_topk_prob: the same weights, the same experts
    # with copied router rows (the surgery's own init) the copies tie with their sources and take traffic
    expand_experts(model, [[int(old_idx[0, 0])], [0]])
    with torch.no_grad():
        _, _, idx2 = block.gate(x.reshape(-1, h))
    assert (idx2 == 6).any()


def test_sources_are_the_experts_with_the_most_anchor_mass_and_old_anchors_pad_with_zeros():
    anchor = np.array([[0.1, 0.5, 0.1, 0.3], [0.4, 0.1, 0.4, 0.1]], np.float32)  # [L=2, E=4]
    assert default_sources(anchor, 2, 4, 2) == [[1, 3], [0, 2]]  # ties by lower index
    assert default_sources(None, 2, 4, 2) == [[0, 1], [0, 1]]
    padded = pad_anchor(anchor, 6)
    assert padded.shape == (2, 6) and np.array_equal(padded[:, :4], anchor) and not padded[:, 4:].any()
    assert default_sources(padded, 2, 4, 1) == [[1], [0]]  # a padded anchor: only the first 4 columns count
    with pytest.raises(ValueError, match="more than the model"):
        pad_anchor(padded, 4)
    # the anchor KL against a padded anchor stays finite (zero mass is clamped at 1e-8 in KL(a || p))
    from distmoe.routing.losses import anchor_kl

    logits = (torch.randn(5, 6), torch.randn(5, 6))
    for g in ("batch", "token"):
        assert torch.isfinite(anchor_kl(logits, None, torch.from_numpy(padded), g))


def test_resize_grows_to_a_declared_count_and_reports_a_larger_model(make_cfg):
    model, _ = _model(make_cfg, **{"model.trainable": "all"})
    assert resize_to(model, 4) and describe(model).num_experts == 4
    assert resize_to(model, 7) and describe(model).num_experts == 7
    assert not resize_to(model, 5)  # a cached base larger than the weights: the caller rebuilds it
    with pytest.raises(ModelError, match="disagree"):
        experts_in({"model.layers.0.mlp.gate.weight": (4, 64), "model.layers.0.mlp.experts.down_proj": (5, 64, 64)})


def test_expansion_is_refused_for_lora_and_a_routing_bias(make_cfg):
    with pytest.raises(ConfigError, match="retention.expand-experts"):
        make_cfg(**{"retention.expand-experts": 1, "model.trainable": "lora"})
    with pytest.raises(ConfigError, match="retention.expand-experts"):
        make_cfg(**{"retention.expand-experts": 1, "routing.balance": "bias"})
    model, _ = _model(make_cfg, **{"model.trainable": "lora"})
    with pytest.raises(ModelError, match="retention.expand-experts"):
        expand_experts(model, [[0], [0]])
    biased, _ = _model(make_cfg, **{"routing.balance": "bias"})
    with pytest.raises(ModelError, match="routing bias"):
        expand_experts(biased, [[0], [0]])


def test_frozen_masks_keep_the_earlier_experts_and_router_rows_through_an_optimizer_step(make_cfg):
    model, _ = _model(make_cfg, **{"model.trainable": "router+experts"})
    expand_experts(model, [[0, 1], [2, 3]])
    frozen = frozen_set(2, 6, 2)
    assert frozen.tolist() == [[True] * 4 + [False] * 2] * 2
    before = {k: v.clone() for k, v in trainable_state(model).items()}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.1)
    upd = ProtectedUpdate(frozen_masks(model, frozen))
    ids = torch.randint(0, 100, (2, 8))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    upd.before()
    opt.step()
    upd.after()
    after = trainable_state(model)
    moved = 0
    for name, old in before.items():
        if old.dim() >= 2 and old.shape[0] == 6:
            assert torch.equal(after[name][:4], old[:4]), name  # frozen: bit-for-bit
            moved += int(not torch.equal(after[name][4:], old[4:]))
    assert moved >= 4  # the new experts and router rows did train


def test_stages_follow_the_new_sft_tasks(make_cfg):
    cfg = make_cfg(**{"retention.expand-experts": 3, "schedule.phases": "sft:a, stats:a, sft:b, eval, sft:b, sft:c"})
    assert stages(cfg, 4) == [4, 7, 10]  # b and c are new tasks after the first; b again is not
    assert stages(make_cfg(**{"retention.expand-experts": 1, "schedule.phases": "sft:a, rl:b, sft:b, sft:c"}),
                  4) == [4, 5]  # b was trained (rl) before its sft: only c grows the model
    assert stages(make_cfg(**{"schedule.phases": "sft:a, sft:b"}), 4) == [4]  # off
    with pytest.raises(ConfigError, match="would never grow"):
        make_cfg(**{"retention.expand-experts": 1, "schedule.phases": "sft:a, eval, sft:a"})


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe", "flex_olmo", "mixtral", "gpt_oss"])
def test_other_families_expand_and_save_with_their_own_expert_count(family, tmp_path):
    from transformers import AutoModelForCausalLM

    from distmoe.model.fabricate import build_bpe_tokenizer, family_config

    tok = build_bpe_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(family, len(tok), None, tok)).eval()
    ms = describe(model)
    if family == "gpt_oss":  # its router has a bias: refused, naming the key
        with pytest.raises(ModelError, match="retention.expand-experts"):
            expand_experts(model, [[0] for _ in ms.moe_layers])
        return
    ids = torch.randint(3, len(tok), (2, 7))
    with torch.no_grad():
        before = model(input_ids=ids, output_router_logits=True).router_logits[0]
    expand_experts(model, [[1] for _ in ms.moe_layers])
    with torch.no_grad():
        after = model(input_ids=ids, output_router_logits=True).router_logits[0]
    assert after.shape == (14, ms.num_experts + 1)
    assert torch.allclose(after[:, :ms.num_experts], before, atol=1e-6)  # one matmul wider: equal to rounding
    assert torch.allclose(after[:, -1], before[:, 1], atol=1e-6)  # the copied router row
    model.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert describe(back).num_experts == ms.num_experts + 1
