"""Unit tests: the retention mechanisms inside the local SFT loop (per-task anchor KL, expert protection in
every trainable mode, the experts frozen after an expansion, output distillation, router-only warm-up) and the
per-group learning-rate schedules."""

from __future__ import annotations

import pytest
import torch

from distmoe.data.party import load_party
from distmoe.data.template import collate, encode_example
from distmoe.model.build import build_model, describe
from distmoe.model.router import forward_with_router
from distmoe.model.trainable import apply_trainable, trainable_state
from distmoe.routing.losses import anchor_kl
from distmoe.routing.retention import protected_experts, task_anchor_kl
from distmoe.train.optim import build_optimizer, lr_factor
from distmoe.train.retention import Retention, distill_loss, expert_slice_masks, reference_logits
from distmoe.train.sft import train_sft

TRAIN = {"train.local-steps": 4, "train.batch-size": 8, "train.lr": 5e-3, "train.lr-experts": 5e-3,
         "train.lr-router": 5e-3, "train.warmup-steps": 0}


@pytest.fixture(scope="module")
def party(synth_dirs, make_cfg):
    return load_party(synth_dirs[0], make_cfg().data)


def _setup(make_cfg, party, task="arith", **over):
    cfg = make_cfg(**{**TRAIN, **over})
    model, tok = build_model(cfg.model)
    model = apply_trainable(model, cfg.model)
    encoded = [encode_example(tok, ex, cfg.model.max_seq_len) for ex in party.train(task)]
    return cfg, model, tok, encoded


def _run(cfg, model, tok, encoded, retention=None, anchor=None):
    ms = describe(model)
    return train_sft(model, encoded, tok.pad_token_id, cfg.train, cfg.routing, ms.num_experts, ms.top_k,
                     anchor, seed=0, retention=retention)


def _batch(tok, encoded):
    return collate(encoded[:8], tok.pad_token_id)


# ------------------------------------------------------------------------------ per-task anchor KL
def test_task_anchor_kl_is_the_weighted_sum_of_per_task_kls():
    torch.manual_seed(0)
    logits = tuple(torch.randn(6, 4, requires_grad=True) for _ in range(2))  # L=2 layers, N=6 tokens, E=4
    anchors = torch.softmax(torch.randn(3, 2, 4), -1)  # T=3 tasks
    each = [anchor_kl(logits, None, anchors[j]) for j in range(3)]
    assert torch.allclose(task_anchor_kl(logits, None, anchors, reduce="sum"), sum(each))
    assert torch.allclose(task_anchor_kl(logits, None, anchors, reduce="mean"), sum(each) / 3)
    # one anchor per task is not the KL to the mixed anchor (a's routing is not averaged away)
    assert not torch.allclose(task_anchor_kl(logits, None, anchors, reduce="mean"),
                              anchor_kl(logits, None, anchors.mean(0)))
    with pytest.raises(ValueError, match="reduction"):
        task_anchor_kl(logits, None, anchors, reduce="max")


def test_per_task_anchors_pull_routing_towards_each_earlier_task(make_cfg, party):
    cfg, model, tok, encoded = _setup(make_cfg, party, **{"routing.anchor-kl-coef": 5.0})
    ms = describe(model)
    # two earlier tasks that each favour a different expert
    anchors = torch.full((2, len(ms.moe_layers), ms.num_experts), 0.1 / (ms.num_experts - 1))
    anchors[0, :, 0], anchors[1, :, 1] = 0.9, 0.9
    base = {k: v.clone() for k, v in trainable_state(model).items()}

    def kl_after(retention):
        from distmoe.model.trainable import load_trainable, spec_of
        load_trainable(model, base, spec_of(model, cfg.model.trainable))
        res = _run(cfg, model, tok, encoded, retention)
        with torch.no_grad():
            b = _batch(tok, encoded)
            out = forward_with_router(model, b["input_ids"], b["attention_mask"])
            return res, float(task_anchor_kl(out.router_logits, b["attention_mask"], anchors, reduce="mean"))

    res_off, kl_off = kl_after(None)
    res_on, kl_on = kl_after(Retention(task_anchors=anchors, task_anchor_reduce="mean"))
    assert res_off.anchor_kls == [] and len(res_on.anchor_kls) == res_on.steps
    assert kl_on < kl_off


# ------------------------------------------------------------------------------ expert protection
def test_protected_experts_are_the_ones_above_the_mass_in_some_earlier_task():
    a = torch.tensor([[[0.7, 0.1, 0.1, 0.1]], [[0.1, 0.1, 0.5, 0.3]]])  # T=2, L=1, E=4
    assert protected_experts(a, 0.4).tolist() == [[True, False, True, False]]
    assert not protected_experts(a, 0.8).any()


@pytest.mark.parametrize("mode", ["all", "router+experts", "lora"])
def test_protected_expert_slices_are_frozen_or_scaled_in_every_trainable_mode(make_cfg, party, mode):
    over = {"model.trainable": mode, "train.local-steps": 1}
    cfg, model, tok, encoded = _setup(make_cfg, party, **over)
    ms = describe(model)
    protected = torch.zeros(len(ms.moe_layers), ms.num_experts, dtype=torch.bool)
    protected[0, 1] = True
    masks = expert_slice_masks(model, protected, 0.5)
    names = {id(p): n for n, p in model.named_parameters()}
    touched = sorted(names[id(p)] for p, _ in masks)
    assert touched and all(".layers.0." in n and ".experts" in n for n in touched)
    assert all(float((m != 1).float().mean()) == pytest.approx(1 / ms.num_experts) for _, m in masks)
    base = trainable_state(model)

    def delta(scale):
        from distmoe.model.trainable import load_trainable, spec_of
        load_trainable(model, base, spec_of(model, cfg.model.trainable))
        r = None if scale is None else Retention(protected=protected, protect_lr_scale=scale)
        _run(cfg, model, tok, encoded, r)
        after = trainable_state(model)
        return {k: after[k] - base[k] for k in base}

    free, frozen, half = delta(None), delta(0.0), delta(0.5)
    # the expert would have moved (in lora the first step moves lora_B only: lora_A's gradient is 0 while B = 0)
    assert sum(int(free[names[id(p)]][m != 1].abs().sum() > 0) for p, m in masks) >= len(masks) / 2
    for p, m in masks:
        n = names[id(p)]
        sel = (m != 1)
        assert torch.all(frozen[n][sel] == 0)  # frozen: not at all
        assert torch.allclose(half[n][sel], 0.5 * free[n][sel], atol=1e-7)  # first AdamW step: exactly half
        assert torch.allclose(frozen[n][~sel], free[n][~sel], atol=1e-7)  # the other experts train as before
    routers = [k for k in base if ".mlp.gate." in k]
    assert routers and any(frozen[k].abs().sum() > 0 for k in routers)  # the router is not protected


def test_after_an_expansion_the_local_loop_trains_only_the_newest_experts_and_router_rows(make_cfg, party):
    from distmoe.model.expand import expand_experts, frozen_set

    cfg, model, tok, encoded = _setup(make_cfg, party, **{"model.trainable": "all", "train.grad-clip": 1e-3})
    expand_experts(model, [[0, 1], [2, 3]])  # 4 -> 6 experts per MoE layer
    base = trainable_state(model)
    res = _run(cfg, model, tok, encoded, Retention(frozen=frozen_set(2, 6, 2)))
    assert res.steps == 4
    after = trainable_state(model)
    per_expert = [k for k in base if ".mlp.experts." in k or k.endswith(".mlp.gate.weight")]
    assert len(per_expert) == 6
    for k in per_expert:
        assert torch.equal(after[k][:4], base[k][:4]), k  # frozen: bit for bit, weight decay included
        assert not torch.equal(after[k][4:], base[k][4:]), k  # the two new experts / router rows train
    assert any(not torch.equal(after[k], base[k]) for k in base if k not in per_expert)  # `all`: the rest trains


# ------------------------------------------------------------------------------ output distillation
def test_distill_loss_is_zero_on_equal_logits_and_positive_otherwise():
    z = torch.randn(2, 5, 11)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert float(distill_loss(z, z.clone(), mask, 2.0)) == pytest.approx(0.0, abs=1e-6)
    w = z.clone()
    w[0, 4] += 5.0  # a padded position does not count
    assert float(distill_loss(w, z, mask, 2.0)) == pytest.approx(0.0, abs=1e-6)
    assert float(distill_loss(z + torch.randn_like(z), z, mask, 2.0)) > 0


def test_reference_logits_use_the_reference_tensors_without_touching_the_model(make_cfg, party):
    cfg, model, tok, encoded = _setup(make_cfg, party)
    b = _batch(tok, encoded)
    ref = {k: v.clone() for k, v in trainable_state(model).items()}
    with torch.no_grad():
        same = forward_with_router(model, b["input_ids"], b["attention_mask"]).logits
    assert torch.allclose(reference_logits(model, ref, b), same, atol=1e-5)
    _run(cfg, model, tok, encoded)
    now = trainable_state(model)
    with torch.no_grad():
        moved = forward_with_router(model, b["input_ids"], b["attention_mask"]).logits
    assert torch.allclose(reference_logits(model, ref, b), same, atol=1e-5)
    assert not torch.allclose(moved, same)
    assert all(torch.equal(now[k], v) for k, v in trainable_state(model).items())  # the model is unchanged


def test_distillation_keeps_the_outputs_closer_to_the_pre_task_model(make_cfg, party, synth_dirs):
    cfg, model, tok, encoded = _setup(make_cfg, party, task="strings", **{"train.local-steps": 6})
    old = [encode_example(tok, ex, cfg.model.max_seq_len) for ex in party.train("arith")]
    ref = {k: v.clone() for k, v in trainable_state(model).items()}
    b = _batch(tok, old)

    def drift(weight):
        from distmoe.model.trainable import load_trainable, spec_of
        load_trainable(model, ref, spec_of(model, cfg.model.trainable))
        res = _run(cfg, model, tok, encoded, Retention(ref_state=ref, distill_weight=weight, distill_temperature=2.0))
        with torch.no_grad():
            z = forward_with_router(model, b["input_ids"], b["attention_mask"]).logits
            return res, float(distill_loss(z, reference_logits(model, ref, b), b["attention_mask"], 1.0))

    res_off, d_off = drift(0.0)
    res_on, d_on = drift(20.0)
    assert res_off.distills == [] and len(res_on.distills) == res_on.steps
    assert res_on.distills[0] == pytest.approx(0.0, abs=1e-5)  # the first step starts at the reference
    assert d_on < d_off  # the old task's outputs moved less


# ------------------------------------------------------------------------------ warm-up and schedules
def test_router_only_warm_up_updates_only_the_router_for_the_first_steps_of_a_task(make_cfg, party):
    cfg, model, tok, encoded = _setup(make_cfg, party)
    before = trainable_state(model)
    res = _run(cfg, model, tok, encoded, Retention(router_warmup_steps=10))
    after = trainable_state(model)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert res.router_only_steps == cfg.train.local_steps
    assert changed and all(k.endswith("mlp.gate.weight") for k in changed)
    # a later round of the task (offset past the warm-up) trains everything
    res = _run(cfg, model, tok, encoded, Retention(router_warmup_steps=10, task_step_offset=10))
    assert res.router_only_steps == 0
    again = trainable_state(model)
    assert any(".experts." in k and not torch.equal(after[k], again[k]) for k in after)
    # the warm-up ends mid-round: 10 - 8 = 2 router-only steps
    res = _run(cfg, model, tok, encoded, Retention(router_warmup_steps=10, task_step_offset=8))
    assert res.router_only_steps == 2


def test_per_group_schedules_cosine_experts_and_a_low_constant_router(make_cfg):
    cfg = make_cfg(**{"train.local-steps": 10, "train.warmup-steps": 2, "train.expert-schedule": "cosine",
                      "train.router-lr-scale": 0.1, "train.lr-router": 1e-3})
    experts, router = lr_factor(cfg.train, "experts"), lr_factor(cfg.train, "router")
    assert [round(router(t), 6) for t in (0, 1, 2, 9)] == [round(1 / 3, 6), round(2 / 3, 6), 1.0, 1.0]
    assert experts(2) == pytest.approx(1.0) and experts(6) == pytest.approx(0.5) and experts(12) == pytest.approx(0)
    assert experts(9) < 0.05
    model = apply_trainable(build_model(cfg.model)[0], cfg.model)
    opt, sched = build_optimizer(model, cfg.train)
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs["router"] == pytest.approx(1e-4 / 3)  # 1e-3 * 0.1, warm-up step 0
    for _ in range(9):
        opt.step()
        sched.step()
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs["router"] == pytest.approx(1e-4) and lrs["experts"] < 0.05 * cfg.train.lr_experts
    const = make_cfg(**{"train.local-steps": 10, "train.warmup-steps": 2})
    assert lr_factor(const.train, "experts")(9) == 1.0  # the default: constant after the warm-up


def test_lora_protection_keeps_the_protected_experts_effective_weights(make_cfg, party):
    """peft's own per-expert delta (``ParamWrapper.get_delta_weight``: ``[E, ...]``) of a frozen expert does not
    change, the others' do: the lora_A / lora_B slices are the expert's."""
    cfg, model, tok, encoded = _setup(make_cfg, party, **{"model.trainable": "lora", "train.local-steps": 3})
    ms = describe(model)
    from peft.tuners.lora.layer import ParamWrapper  # the outer one runs the routed forward (model/expert_lora.py)

    wrappers = [mod for n, mod in model.named_modules()
                if isinstance(mod, ParamWrapper) and ".layers.0.mlp.experts" in n]
    assert len(wrappers) == 2
    with torch.no_grad():  # B != 0, so every step moves A and B and every expert's delta
        for w in wrappers:
            for p in w.lora_B.parameters():
                p.normal_(0, 0.02)
    protected = torch.zeros(len(ms.moe_layers), ms.num_experts, dtype=torch.bool)
    protected[0, 2] = True
    with torch.no_grad():
        before = [w.get_delta_weight("default").clone() for w in wrappers]  # [E, ...]
    _run(cfg, model, tok, encoded, Retention(protected=protected, protect_lr_scale=0.0))
    with torch.no_grad():
        after = [w.get_delta_weight("default") for w in wrappers]
    for b, a in zip(before, after, strict=True):
        assert torch.allclose(a[2], b[2], atol=0, rtol=0)
        assert all(not torch.allclose(a[e], b[e]) for e in (0, 1, 3))


def test_per_task_anchors_and_protection_need_a_stats_phase_with_a_task(make_cfg):
    from distmoe.config import ConfigError

    for key, value in (("retention.task-anchors", "mean"), ("retention.protect-mass", 0.3)):
        with pytest.raises(ConfigError, match=f"'{key}' is on, but schedule.phases has no `stats:<task>`"):
            make_cfg(**{key: value, "schedule.phases": "sft:arith, stats, sft:lookup"})
        assert make_cfg(**{key: value, "schedule.phases": "sft:arith, stats:arith, sft:lookup"})
    assert make_cfg(**{"retention.distill-weight": 1.0, "schedule.phases": "sft:arith, sft:lookup"})
    with pytest.raises(ConfigError, match="retention.protect-mass"):
        make_cfg(**{"retention.protect-mass": 1.5})
