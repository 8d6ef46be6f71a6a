"""Unit tests: the public balance (router-only first-choice balance loss on public prompts, train/public_balance.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from distmoe.data.party import load_party
from distmoe.data.template import encode_example
from distmoe.model.build import build_model, describe, router_modules
from distmoe.model.trainable import apply_trainable, grouped_parameters, trainable_state
from distmoe.routing import metrics as rm
from distmoe.routing.probe import (
    BALANCE_GENERATOR_INDEX,
    PROBE_GENERATOR_INDEX,
    default_probe_prompts,
    family_probe_prompts,
    probe_routing,
)
from distmoe.train.public_balance import PublicBalance, PublicBalanceError, balance_prompts
from distmoe.train.sft import train_sft

TRAIN = {"train.local-steps": 30, "train.batch-size": 8, "train.lr": 5e-3, "train.lr-experts": 5e-3,
         "train.lr-router": 5e-3, "train.warmup-steps": 0, "routing.aux-loss-coef": 0.0}


def _skewed_model(cfg):
    """The tiny model with every router pushed towards expert 0 (a load CV far above the uniform one)."""
    torch.manual_seed(0)
    model, tok = build_model(cfg.model)
    model = apply_trainable(model, cfg.model)
    with torch.no_grad():
        for _, r in router_modules(model):
            r.weight[0] += 0.5 * r.weight.abs().mean() * torch.sign(r.weight[0]) + 0.05
    return model, tok


def _probe_cv(model, tok, cfg) -> float:
    _, top1 = probe_routing(model, tok, default_probe_prompts(cfg.run.seed, 64), cfg.model.max_seq_len, 16)
    e = describe(model).num_experts
    return rm.load_cv(torch.from_numpy(np.stack([np.bincount(t, minlength=e) for t in top1])))


def test_balance_prompts_are_public_synthetic_prompts_drawn_apart_from_the_probe(tmp_path):
    pool = balance_prompts(0)  # the default: 12 styles (generator indices) of 96 prompts
    assert len(pool) == 96 * 12 and pool == balance_prompts(0) and pool != balance_prompts(1)
    assert balance_prompts(0, "", 1) == default_probe_prompts(0, 96, BALANCE_GENERATOR_INDEX)  # the one style of before
    styles = range(BALANCE_GENERATOR_INDEX, BALANCE_GENERATOR_INDEX + 12)
    assert PROBE_GENERATOR_INDEX not in styles and min(styles) > 10_000  # neither the probe's index nor a party's
    for index in styles:  # every style is in the set, whole
        for fam in ("arith", "strings", "lookup"):
            assert set(family_probe_prompts(fam, 0, 32, index)) <= set(pool)
    # every string operation the generators know (the style varies them: party % 4) is asked for
    ops = {p.split("\n")[0] for p in pool[1::3]}
    assert len(ops) == 4 and len({p.split("\n")[0] for p in balance_prompts(0, "", 1)[1::3]}) == 2, ops
    # any 16 consecutive prompts mix the three families and several styles
    assert {p.split("\n")[0][:4] for p in pool[:16]} >= {"Calc", "Look"} and len(set(pool[:16])) >= 14
    # a different draw than the probe's (short arith prompts such as "Calculate\n4-2" coincide by chance)
    same = sum(a == b for a, b in zip(pool, default_probe_prompts(0, 256), strict=False))
    assert same <= 256 // 10, same
    f = tmp_path / "public.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": p}) for p in ("one", "two")) + "\n")
    assert balance_prompts(0, str(f)) == ("one", "two")
    f.write_text('{"text": "x"}\n')
    with pytest.raises(PublicBalanceError, match=r"public-balance-path.*public.jsonl:1"):
        balance_prompts(0, str(f))


def test_public_balance_gradient_reaches_the_router_weights_only(make_cfg):
    cfg = make_cfg(**TRAIN)
    model, tok = _skewed_model(cfg)
    pb = PublicBalance(model, tok, balance_prompts(0), 1.0, 8, cfg.model.max_seq_len)
    loss = pb.add_grads()
    assert loss > 1.0  # the first-choice Switch loss is 1 when balanced, more when skewed
    routers = {id(p) for p in grouped_parameters(model)["router"]}
    got = {n for n, p in model.named_parameters() if p.grad is not None}
    assert got and all(id(p) in routers for n, p in model.named_parameters() if n in got)
    assert all(float(p.grad.abs().sum()) > 0 for n, p in model.named_parameters() if n in got)
    # a second call adds to the gradient already there (it joins the step's gradient, before clipping)
    first = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    pb.next = 0
    pb.add_grads()
    assert all(torch.allclose(p.grad, 2 * first[n]) for n, p in model.named_parameters() if n in first)


def test_public_balance_lowers_the_probe_load_cv_while_the_party_trains(make_cfg, synth_dirs):
    """The same local training of a skewed model, with and without the public balance: only the public balance
    brings the probe's first-choice load CV down (the probe prompts are not the balance set's)."""
    cfg = make_cfg(**TRAIN)
    party = load_party(synth_dirs[0], cfg.data)
    out = {}
    for coef in (0.0, 1.0):
        model, tok = _skewed_model(cfg)
        start = _probe_cv(model, tok, cfg)
        ms = describe(model)
        enc = [encode_example(tok, ex, cfg.model.max_seq_len) for ex in party.train("arith")]
        pub = PublicBalance(model, tok, balance_prompts(0), coef, 16, cfg.model.max_seq_len) if coef else None
        res = train_sft(model, enc, tok.pad_token_id, cfg.train, cfg.routing, ms.num_experts, ms.top_k, None, 0,
                        public=pub)
        out[coef] = (start, _probe_cv(model, tok, cfg), res)
    (s0, e0, r0), (s1, e1, r1) = out[0.0], out[1.0]
    assert s0 == pytest.approx(s1) and s0 > 0.6, s0
    assert len(r1.public_balances) == r1.steps and not r0.public_balances
    k = max(1, len(r1.public_balances) // 4)  # batches differ (families and styles): compare quarters
    assert np.mean(r1.public_balances[-k:]) < np.mean(r1.public_balances[:k]), r1.public_balances
    assert e1 < 0.7 * e0, (e0, e1)  # measured 0.99 against 1.58 with the one-style set
    assert r1.task_losses[-1] < r1.task_losses[0]  # the party still learns its task


def test_public_balance_refuses_a_model_whose_routers_are_frozen(make_cfg):
    cfg = make_cfg(**TRAIN)
    model, tok = _skewed_model(cfg)
    for p in grouped_parameters(model)["router"]:
        p.requires_grad_(False)
    with pytest.raises(PublicBalanceError, match="trainable router"):
        PublicBalance(model, tok, balance_prompts(0), 1.0, 8, cfg.model.max_seq_len)
    with pytest.raises(PublicBalanceError, match=">= 0"):
        PublicBalance(model, tok, balance_prompts(0), -1.0, 8, cfg.model.max_seq_len)
    PublicBalance(model, tok, balance_prompts(0), 0.0, 8, cfg.model.max_seq_len)  # routing only: no gradient
    assert trainable_state(model)  # nothing else changed


def test_a_bias_with_balance_source_public_counts_the_public_batch_not_the_party_batch(make_cfg, synth_dirs):
    """One local step with routing.balance-source = "public": the bias moves by u * sign(mean - c) of the public
    batch's first choices (computed here independently), not of the party's batch."""
    from distmoe.model.balance import biases, selection_scores
    from distmoe.model.router import forward_with_router

    cfg = make_cfg(**{**TRAIN, "train.local-steps": 1, "routing.balance": "bias", "routing.balance-count": "first",
                      "routing.balance-source": "public", "routing.balance-rate": 0.1})
    party = load_party(synth_dirs[0], cfg.data)
    model, tok = _skewed_model(cfg)
    ms = describe(model)
    pub = PublicBalance(model, tok, balance_prompts(0), 0.0, 16, cfg.model.max_seq_len)
    b = pub.batches[0]
    with torch.no_grad():
        out = forward_with_router(model, b["input_ids"], b["attention_mask"])
        chosen = selection_scores(model, rm.select_valid(out.router_logits, b["attention_mask"]))
    c = torch.stack([torch.bincount(z.argmax(-1), minlength=ms.num_experts) for z in chosen]).double()  # [L, E]
    want = 0.1 * torch.sign(c.mean(-1, keepdim=True) - c)
    # a party batch whose own first choices differ from the public batch's (under the keyed-hash split of the
    # synthetic data, the arith training examples happened to skew the tiny model the same way)
    enc = [encode_example(tok, ex, cfg.model.max_seq_len) for ex in party.train("strings")]
    train_sft(model, enc, tok.pad_token_id, cfg.train, cfg.routing, ms.num_experts, ms.top_k, None, 0, public=pub)
    got = torch.stack([x.detach().double() for x in biases(model)])
    assert torch.allclose(got, want), (got, want)
    # the party-sourced bias (the default) moves differently on the same step
    cfg2 = make_cfg(**{**TRAIN, "train.local-steps": 1, "routing.balance": "bias", "routing.balance-count": "first",
                       "routing.balance-rate": 0.1})
    model2, _ = _skewed_model(cfg2)
    train_sft(model2, enc, tok.pad_token_id, cfg2.train, cfg2.routing, ms.num_experts, ms.top_k, None, 0)
    assert not torch.allclose(torch.stack([x.detach().double() for x in biases(model2)]), want)
    with pytest.raises(ValueError, match="balance-source"):
        train_sft(model2, enc, tok.pad_token_id, cfg.train, cfg.routing, ms.num_experts, ms.top_k, None, 0)


def test_balance_source_public_without_a_routing_bias_is_a_config_error(make_cfg):
    from distmoe.config import ConfigError

    with pytest.raises(ConfigError, match="routing.balance-source"):
        make_cfg(**{"routing.balance-source": "public"})
    assert make_cfg(**{"routing.balance-source": "public", "routing.balance": "aux+bias"}).routing.balance_source \
        == "public"


def test_settle_updates_move_only_the_bias_by_the_sign_rule_on_the_next_public_batches(make_cfg):
    """``settle_bias``: update ``i`` is ``u_i * sign(mean - c)`` of the next public batch's first choices under the
    current bias, ``u_i`` the linear schedule's ``u_s (1 - i/K)`` (recomputed here independently, batch after
    batch); no weight moves."""
    from distmoe.model.balance import BalanceTracker, biases, settle_rates
    from distmoe.model.router import forward_with_router
    from distmoe.train.public_balance import settle_bias

    cfg = make_cfg(**{**TRAIN, "routing.balance": "bias", "routing.balance-count": "first",
                      "routing.balance-source": "public"})
    model, tok = _skewed_model(cfg)
    e = describe(model).num_experts
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if "balance_bias" not in n}
    pub = PublicBalance(model, tok, balance_prompts(0), 0.0, 16, cfg.model.max_seq_len)
    want = torch.stack([b.detach().double().clone() for b in biases(model)])  # [L, E]
    for i in range(3):
        b = pub.batches[i]
        with torch.no_grad():
            out = forward_with_router(model.eval(), b["input_ids"], b["attention_mask"])
            z = rm.select_valid(out.router_logits, b["attention_mask"])
            chosen = [x.float() + bb.to(torch.float32) for x, bb in zip(z, want.unbind(0), strict=True)]
        c = torch.stack([torch.bincount(x.argmax(-1), minlength=e) for x in chosen]).double()
        want = want + 0.03 * (3 - i) / 3 * torch.sign(c.mean(-1, keepdim=True) - c)  # u_i = 0.03, 0.02, 0.01
    assert not torch.equal(want, torch.zeros_like(want))
    model.train()
    with BalanceTracker(model, 0.5, "first") as tracker:  # the schedule's rates replace the tracker's
        settle_bias(model, pub, tracker, settle_rates(3, 0.03, "linear"))
    assert model.training  # the mode is restored
    got = torch.stack([x.detach().double() for x in biases(model)])
    assert torch.allclose(got, want, atol=1e-6), (got, want)
    for n, p in model.named_parameters():
        if n in weights:
            assert torch.equal(p.detach(), weights[n]), n


def test_settling_lowers_the_held_out_probe_load_cv_of_a_skewed_router(make_cfg):
    """The weights held still, settle updates alone balance a skewed router on public prompts the probe never
    saw (the probe's own generator index, 64 prompts)."""
    from distmoe.model.balance import BalanceTracker, settle_rates
    from distmoe.train.public_balance import settle_bias

    cfg = make_cfg(**{**TRAIN, "routing.balance": "bias", "routing.balance-count": "first",
                      "routing.balance-source": "public"})
    model, tok = _skewed_model(cfg)
    before = _probe_cv(model, tok, cfg)
    pub = PublicBalance(model, tok, balance_prompts(0), 0.0, 16, cfg.model.max_seq_len)
    with BalanceTracker(model, 0.05, "first") as tracker:
        settle_bias(model, pub, tracker, settle_rates(150, 0.1, "linear"))
    after = _probe_cv(model, tok, cfg)
    assert after < 0.5 * before, (before, after)  # measured 0.76 -> 0.11


def test_settle_steps_without_the_public_bias_is_a_config_error(make_cfg):
    from distmoe.config import ConfigError

    with pytest.raises(ConfigError, match="routing.balance-settle-steps"):
        make_cfg(**{"routing.balance": "aux+bias", "routing.balance-settle-steps": 10})
    c = make_cfg(**{"routing.balance": "aux+bias", "routing.balance-source": "public",
                    "routing.balance-settle-steps": 10})
    r = c.routing
    assert (r.balance_settle_steps, r.balance_settle_rate, r.balance_settle_schedule) == (10, 0.02, "linear")
