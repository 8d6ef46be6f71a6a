"""Unit tests: the local SFT loop (learning, anchor KL, NaN guards), optimizer groups, evaluation."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import distmoe.train.sft as sft_mod
from distmoe.config import replace
from distmoe.data.party import load_party
from distmoe.data.template import encode_example
from distmoe.model.build import build_model, describe
from distmoe.model.trainable import apply_trainable, trainable_state
from distmoe.train.evaluate import evaluate_party, routing_on, routing_set
from distmoe.train.optim import adamw, build_optimizer
from distmoe.train.sft import train_sft

TRAIN = {"train.local-steps": 8, "train.batch-size": 8, "train.lr": 5e-3, "train.lr-experts": 5e-3,
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


def _run(cfg, model, tok, encoded, anchor=None, seed=0):
    ms = describe(model)
    return train_sft(model, encoded, tok.pad_token_id, cfg.train, cfg.routing, ms.num_experts, ms.top_k,
                     anchor, seed=seed)


def test_train_sft_lowers_task_loss_and_changes_parameters(make_cfg, party):
    cfg, model, tok, encoded = _setup(make_cfg, party)
    before = trainable_state(model)
    res = _run(cfg, model, tok, encoded)
    assert res.steps == cfg.train.local_steps and res.skipped_steps == 0
    assert res.num_examples == len(encoded)
    assert len(res.task_losses) == res.steps == len(res.losses)
    assert len(res.aux_losses) == res.steps  # routing.aux-loss-coef > 0 by default
    assert res.anchor_kls == []  # no anchor given
    assert sum(res.task_losses[-3:]) / 3 < res.task_losses[0]
    after = trainable_state(model)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert "model.layers.0.mlp.gate.weight" in changed and len(changed) > len(before) // 2
    assert all(torch.isfinite(v).all() for v in after.values())
    s = res.summary()
    assert s["loss_first"] == res.task_losses[0] and s["loss_last"] == res.task_losses[-1]
    assert math.isnan(s["anchor_kl"]) and s["steps"] == cfg.train.local_steps
    assert not model.training


def test_train_sft_is_deterministic_for_a_seed(make_cfg, party):
    over = {"train.local-steps": 3}
    cfg, m1, tok, enc = _setup(make_cfg, party, **over)
    _, m2, _, _ = _setup(make_cfg, party, **over)
    r1, r2 = _run(cfg, m1, tok, enc, seed=5), _run(cfg, m2, tok, enc, seed=5)
    assert r1.task_losses == r2.task_losses
    s1, s2 = trainable_state(m1), trainable_state(m2)
    assert all(torch.equal(s1[k], s2[k]) for k in s1)


def test_train_sft_records_anchor_kl(make_cfg, party):
    cfg, model, tok, encoded = _setup(make_cfg, party, **{"train.local-steps": 3,
                                                          "routing.anchor-kl-coef": 0.5})
    anchor = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7]])
    res = _run(cfg, model, tok, encoded, anchor=anchor)
    assert len(res.anchor_kls) == res.steps == 3
    assert all(math.isfinite(v) and v > 0 for v in res.anchor_kls)
    # total loss includes the anchor term
    for tot, task, aux, kl in zip(res.losses, res.task_losses, res.aux_losses, res.anchor_kls, strict=True):
        assert tot == pytest.approx(task + cfg.routing.aux_loss_coef * aux + 0.5 * kl, rel=1e-4)
    # coefficient 0: the anchor is not used
    cfg0, m0, tok0, enc0 = _setup(make_cfg, party, **{"train.local-steps": 2, "routing.anchor-kl-coef": 0.0})
    assert _run(cfg0, m0, tok0, enc0, anchor=anchor).anchor_kls == []


def test_train_sft_skips_nan_loss_step(make_cfg, party, monkeypatch):
    cfg, model, tok, encoded = _setup(make_cfg, party, **{"train.local-steps": 4})
    real = sft_mod.sft_loss
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        loss, parts = real(*args, **kwargs)
        if calls["n"] == 2:
            loss = loss * float("nan")
        return loss, parts

    monkeypatch.setattr(sft_mod, "sft_loss", flaky)
    res = _run(cfg, model, tok, encoded)
    assert calls["n"] == 4
    assert res.skipped_steps == 1 and res.steps == cfg.train.local_steps - 1
    assert len(res.task_losses) == res.steps
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(math.isfinite(v) for v in res.losses)


def test_train_sft_skips_nan_gradient_step(make_cfg, party, monkeypatch):
    cfg, model, tok, encoded = _setup(make_cfg, party, **{"train.local-steps": 3})
    real = sft_mod.sft_loss
    calls = {"n": 0}
    gate = model.model.layers[0].mlp.gate.weight

    def nan_grad(*args, **kwargs):
        calls["n"] += 1
        loss, parts = real(*args, **kwargs)
        if calls["n"] == 1:
            loss = loss + 0.0 * torch.sqrt(gate.sum() * 0.0)  # finite value, NaN gradient
        return loss, parts

    monkeypatch.setattr(sft_mod, "sft_loss", nan_grad)
    res = _run(cfg, model, tok, encoded)
    assert res.skipped_steps == 1 and res.steps == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_build_optimizer_groups_and_warmup(make_cfg):
    cfg = make_cfg(**{"train.lr": 1e-3, "train.lr-experts": 2e-3, "train.lr-router": 3e-3,
                      "train.warmup-steps": 0, "train.weight-decay": 0.01})
    model, _ = build_model(cfg.model)
    opt, sched = build_optimizer(model, cfg.train)
    groups = {g["name"]: g for g in opt.param_groups}
    assert set(groups) == {"experts", "router", "rest"}
    assert groups["experts"]["lr"] == pytest.approx(2e-3)
    assert groups["router"]["lr"] == pytest.approx(3e-3)
    assert groups["rest"]["lr"] == pytest.approx(1e-3)
    assert all(g["weight_decay"] == 0.01 for g in opt.param_groups)
    ids = {n: id(p) for n, p in model.named_parameters()}
    assert {id(p) for p in groups["router"]["params"]} == {ids["model.layers.0.mlp.gate.weight"],
                                                           ids["model.layers.1.mlp.gate.weight"]}
    assert ids["model.layers.0.mlp.experts.down_proj"] in {id(p) for p in groups["experts"]["params"]}
    assert ids["model.embed_tokens.weight"] in {id(p) for p in groups["rest"]["params"]}
    n_opt = sum(len(g["params"]) for g in opt.param_groups)
    assert n_opt == len(list(model.parameters()))
    # warm-up: linear from 1/(w+1) of the base rate to the base rate after w steps
    wcfg = replace(cfg.train, warmup_steps=3)
    opt, sched = build_optimizer(model, wcfg)
    router = next(g for g in opt.param_groups if g["name"] == "router")
    assert router["lr"] == pytest.approx(3e-3 / 4)
    for _ in range(3):
        opt.step()
        sched.step()
    assert router["lr"] == pytest.approx(3e-3)


def test_adamw_is_fused_on_the_cpu_and_makes_torchs_default_update():
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(300, 7, generator=g), torch.randn(5, generator=g)]
    grads = [[torch.randn(t.shape, generator=g) for t in start] for _ in range(3)]
    runs = {}
    for name, make in {"distmoe": adamw, "torch": torch.optim.AdamW}.items():
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = make([{"params": params[:1], "lr": 1e-2}, {"params": params[1:], "lr": 3e-3}], weight_decay=0.01)
        for step in grads:
            for p, gr in zip(params, step, strict=True):
                p.grad = gr.clone()
            opt.step()
        runs[name] = (opt, params)
    assert runs["distmoe"][0].defaults["fused"] and not runs["torch"][0].defaults["fused"]
    for got, want in zip(runs["distmoe"][1], runs["torch"][1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        assert (got - start[0 if got.dim() == 2 else 1]).abs().max() > 1e-3  # the parameters moved
    assert not adamw([torch.nn.Parameter(torch.zeros(2, device="meta"))]).defaults["fused"]


def test_build_optimizer_router_experts_mode_has_no_rest(make_cfg):
    cfg = make_cfg(**{"model.trainable": "router+experts"})
    model = apply_trainable(build_model(cfg.model)[0], cfg.model)
    opt, _ = build_optimizer(model, cfg.train)
    assert {g["name"] for g in opt.param_groups} == {"experts", "router"}


def test_evaluate_party_metrics(make_cfg, party):
    cfg = make_cfg(**{"eval.max-new-tokens": 3, "eval.batch-size": 8})
    model, tok = build_model(cfg.model)
    heldout = {"arith": party.heldout("arith")[:4], "strings": []}
    ecfg = cfg.eval
    out = evaluate_party(model, tok, heldout, cfg.model.max_seq_len, ecfg, 4, None, None)
    assert out["n/arith"] == 4.0
    assert 0.0 <= out["acc/arith"] <= 1.0
    assert math.isfinite(out["loss/arith"]) and out["loss/arith"] > 0
    assert out["n/strings"] == 0.0
    assert math.isnan(out["acc/strings"]) and math.isnan(out["loss/strings"])
    assert math.isnan(out["routing_kl"]) and math.isnan(out["top1_consistency"])
    assert math.isfinite(out["load_cv"]) and out["load_cv"] >= 0
    ref = copy.deepcopy(model)
    _, ref_valid = routing_on(ref, tok, routing_set(heldout), cfg.model.max_seq_len, ecfg.batch_size)
    anchor = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7]])
    out2 = evaluate_party(model, tok, heldout, cfg.model.max_seq_len, ecfg, 4, anchor, ref_valid)
    assert out2["top1_consistency"] == 1.0
    assert math.isfinite(out2["routing_kl"]) and out2["routing_kl"] > 0
    assert out2["loss/arith"] == pytest.approx(out["loss/arith"])
    # a different reference model disagrees somewhere
    other, _ = build_model(make_cfg(**{"run.seed": 3}).model)
    _, other_valid = routing_on(other, tok, routing_set(heldout), cfg.model.max_seq_len, ecfg.batch_size)
    out3 = evaluate_party(model, tok, heldout, cfg.model.max_seq_len, ecfg, 4, None, other_valid)
    assert 0.0 <= out3["top1_consistency"] < 1.0


def test_evaluate_party_nothing_held_out(make_cfg):
    cfg = make_cfg()
    model, tok = build_model(cfg.model)
    out = evaluate_party(model, tok, {"arith": []}, cfg.model.max_seq_len, cfg.eval, 4, None, None)
    assert out["n/arith"] == 0.0
    assert all(math.isnan(out[k]) for k in ("acc/arith", "loss/arith", "routing_kl", "load_cv",
                                            "top1_consistency"))


def test_generation_and_loss_do_not_depend_on_batching(make_cfg, party):
    """Left-padded batched generation and right-padded loss give the same results as one by one."""
    from distmoe.train.evaluate import answer_loss, generate_answers

    cfg = make_cfg(**{"eval.max-new-tokens": 5, "eval.batch-size": 8})
    model, tok = build_model(cfg.model)
    with torch.no_grad():  # sharpen the random model so that its greedy outputs vary per prompt
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(50)
    exs = party.train("arith")[:3] + party.train("strings")[:3]
    max_len = cfg.model.max_seq_len
    batched = generate_answers(model, tok, exs, max_len, cfg.eval)
    single = [generate_answers(model, tok, [e], max_len, cfg.eval)[0] for e in exs]
    assert batched == single
    assert len(set(batched)) > 1
    losses = [answer_loss(model, tok, [e], max_len, 8) for e in exs]
    counts = [sum(1 for x in encode_example(tok, e, max_len)[1][1:] if x != -100) for e in exs]
    expected = sum(v * n for v, n in zip(losses, counts, strict=True)) / sum(counts)
    assert answer_loss(model, tok, exs, max_len, 8) == pytest.approx(expected, rel=1e-4)
    # the per-example losses of the secure evaluation sum are each example's own answer loss, batched or not
    from distmoe.train.evaluate import example_losses, example_scores

    assert example_losses(model, tok, exs, max_len, 8) == pytest.approx(losses, rel=1e-4)
    scores = example_scores(model, tok, "arith", exs[:3], max_len, cfg.eval)
    assert [x for _, x in scores] == pytest.approx(losses[:3], rel=1e-4) and all(isinstance(ok, bool)
                                                                                for ok, _ in scores)


def test_causal_lm_loss_scores_each_position_on_the_next_label():
    # reference: slice the logits (what causal_lm_loss did before it shifted the labels instead)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=g, requires_grad=True)  # [B, S, V]
    labels = torch.randint(0, 11, (3, 7), generator=g)  # [B, S]
    labels[:, :2] = -100
    labels[1, 4:] = -100
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1),
                                            ignore_index=-100)
    got = sft_mod.causal_lm_loss(logits, labels)
    assert torch.allclose(got, ref, rtol=1e-6, atol=0)
    (g_ref,) = torch.autograd.grad(ref, logits)
    (g_got,) = torch.autograd.grad(got, logits)
    assert torch.allclose(g_got, g_ref, rtol=1e-6, atol=1e-9)
    assert torch.all(g_got[:, -1] == 0)  # the last position has no next token
