"""Auxiliary-loss-free balancing (distmoe.model.balance): the routing bias chooses the experts and nothing
else, travels with the trainable tensors, gets no gradient, and moves by u * sign(mean load - load) per step."""

from __future__ import annotations

import pytest
import torch

from distmoe.config import ConfigError
from distmoe.data.template import encode_example
from distmoe.model import balance
from distmoe.model.build import build_model, describe, router_modules
from distmoe.model.router import RouterRecorder
from distmoe.model.trainable import apply_trainable, spec_of, trainable_names, trainable_state
from distmoe.train.sft import train_sft


def _model(make_cfg, mode="bias", **extra):
    cfg = make_cfg(**{"routing.balance": mode, **extra})
    model, tok = build_model(cfg.model)
    return cfg, apply_trainable(model, cfg.model), tok


def _ids(n=2, s=12):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(3, 60, (n, s), generator=g)
    return x, torch.ones_like(x)


def _one_step(model, x, m, tracker, step=True):
    """One forward counted by ``tracker`` (its counts kept as ``tracker.last``), then its bias step."""
    with tracker:
        tracker.start_forward()
        with torch.no_grad():
            model(input_ids=x, attention_mask=m)
        tracker.count(m)
        tracker.last = tracker.counts.clone()
        if step:
            tracker.step()
    return tracker


def test_bias_is_a_travelling_tensor_without_gradient(make_cfg):
    cfg, model, _ = _model(make_cfg)
    names = [n for n in trainable_names(model) if n.endswith(balance.BIAS_NAME)]
    assert len(names) == len(router_modules(model)) == 2
    assert all(trainable_state(model)[n].shape == (4,) for n in names)  # [E] per layer, in the wire spec
    assert set(names) <= set(spec_of(model, cfg.model.trainable).keys)
    x, m = _ids()
    model.train()
    out = model(input_ids=x, attention_mask=m, labels=x)
    out.loss.backward()
    assert all(b.grad is None for b in balance.biases(model))  # only the top-k choice uses it
    assert any(p.grad is not None for n, p in model.named_parameters() if n.endswith("gate.weight"))


def test_without_the_key_no_bias(make_cfg):
    _, model, _ = _model(make_cfg, mode="aux")
    assert not balance.has_bias(model)
    assert not [n for n in trainable_names(model) if balance.BIAS_NAME in n]


def test_zero_bias_routes_like_the_plain_router(make_cfg):
    _, biased, _ = _model(make_cfg)
    _, plain, _ = _model(make_cfg, mode="aux")
    x, m = _ids()
    with torch.no_grad():
        a = biased(input_ids=x, attention_mask=m).logits
        b = plain(input_ids=x, attention_mask=m).logits
    torch.testing.assert_close(a, b)


def test_bias_chooses_the_experts_but_not_the_weights(make_cfg):
    _, model, _ = _model(make_cfg)
    with torch.no_grad():
        for b in balance.biases(model):
            b.copy_(torch.tensor([0.0, 0.0, 0.0, 50.0]))  # expert 3 always chosen
    seen = []
    _, gate = router_modules(model)[0]
    h = gate.register_forward_hook(lambda _m, _i, out: seen.append(out))
    x, m = _ids()
    with torch.no_grad():
        model(input_ids=x, attention_mask=m)
    h.remove()
    logits, weights, idx = seen[0]  # [rows, E], [rows, k], [rows, k]
    assert (idx == 3).any(-1).all()  # every token routed to expert 3
    p = torch.softmax(logits.float(), -1).gather(-1, idx)  # the plain router's weights of those experts
    torch.testing.assert_close(weights.float(), p / p.sum(-1, keepdim=True))
    # the routing metrics see the same choice
    scores = balance.selection_scores(model, [logits, logits])  # one [rows, E] per layer (both layers biased alike)
    assert (torch.topk(scores[0], 2, -1).indices.sort(-1).values == idx.sort(-1).values).all()


def test_update_moves_the_bias_by_the_sign_rule(make_cfg):
    cfg, model, tok = _model(make_cfg, **{"routing.balance-rate": 0.01})
    x, m = _ids(4, 10)
    with RouterRecorder(model) as rec, torch.no_grad():
        model(input_ids=x, attention_mask=m)
    counts = torch.stack([torch.bincount(torch.topk(torch.softmax(z[0], -1), 2, -1).indices.reshape(-1),
                                         minlength=4) for _, z in sorted(rec.calls.items())]).double()  # [L, E]
    tracker = _one_step(model, x, m, balance.BalanceTracker(model, 0.01))
    torch.testing.assert_close(tracker.last, counts)
    want = torch.sign(counts.mean(-1, keepdim=True) - counts) * 0.01  # [L, E]
    torch.testing.assert_close(torch.stack([b.detach().double() for b in balance.biases(model)]), want)
    # padding tokens are not counted
    pad = m.clone()
    pad[:, 5:] = 0
    tracker2 = _one_step(model, x, pad, balance.BalanceTracker(model, 0.01), step=False)
    assert tracker2.last.sum(-1).tolist() == [4 * 5 * 2] * 2  # valid tokens x k, per layer


def test_first_choice_count_balances_the_top1_load(make_cfg):
    """``routing.balance-count = "first"``: the tracker counts each valid token's first choice only (argmax of
    z + b, the probe's top-1), one per token, and the sign rule moves the bias against that load."""
    _, model, _ = _model(make_cfg)
    with torch.no_grad():
        for b in balance.biases(model):
            b.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))  # expert 2 first for most tokens, not for all
    x, m = _ids(4, 10)
    with RouterRecorder(model) as rec, torch.no_grad():
        model(input_ids=x, attention_mask=m)
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])
    first = torch.stack([torch.bincount((z[0].float() + bias).argmax(-1), minlength=4)
                         for _, z in sorted(rec.calls.items())]).double()  # [L, E]
    tracker = _one_step(model, x, m, balance.BalanceTracker(model, 0.01, "first"))
    torch.testing.assert_close(tracker.last, first)
    assert tracker.last.sum(-1).tolist() == [4 * 10] * 2  # one choice per valid token
    want = bias + torch.sign(first.mean(-1, keepdim=True) - first) * 0.01  # [L, E]
    torch.testing.assert_close(torch.stack([b.detach().double() for b in balance.biases(model)]), want.double())
    with pytest.raises(ValueError, match="balance-count"):
        balance.BalanceTracker(model, 0.01, "top1")
    with pytest.raises(ConfigError, match="balance-count"):
        make_cfg(**{"routing.balance": "bias", "routing.balance-count": "top1"})


def test_train_sft_moves_the_bias_and_skips_the_aux_loss(make_cfg, synth_dirs, monkeypatch):
    from distmoe.data.formats import read_jsonl

    cfg, model, tok = _model(make_cfg, **{"routing.balance-rate": 0.01, "train.local-steps": 3,
                                          "train.batch-size": 4})
    ms = describe(model)
    enc = [encode_example(tok, ex, 48) for ex in read_jsonl(synth_dirs[0] / "arith.jsonl")]
    res = train_sft(model, enc, tok.pad_token_id, cfg.train, cfg.routing, ms.num_experts, ms.top_k, None, 0)
    assert res.steps == 3 and not res.aux_losses  # "bias": no aux loss
    for b in balance.biases(model):  # 3 steps of +-u each: a multiple of u, at most 3u
        assert b.abs().max() <= 0.03 + 1e-6 and b.abs().max() > 0
        assert torch.allclose(b / 0.01, (b / 0.01).round(), atol=1e-4)
    made = []  # the balance-count key reaches the tracker the loop uses

    class Spy(balance.BalanceTracker):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self.first_only)

    cfg1, model1, _ = _model(make_cfg, **{"routing.balance-count": "first", "train.local-steps": 1,
                                          "train.batch-size": 4})
    monkeypatch.setattr("distmoe.train.sft.BalanceTracker", Spy)
    train_sft(model1, enc, tok.pad_token_id, cfg1.train, cfg1.routing, ms.num_experts, ms.top_k, None, 0)
    monkeypatch.undo()
    assert made == [True]
    cfg2, model2, _ = _model(make_cfg, mode="aux+bias", **{"train.local-steps": 2, "train.batch-size": 4})
    res2 = train_sft(model2, enc, tok.pad_token_id, cfg2.train, cfg2.routing, ms.num_experts, ms.top_k, None, 0)
    assert len(res2.aux_losses) == 2


def test_lora_is_refused(make_cfg):
    with pytest.raises(ConfigError, match="routing.balance"):
        make_cfg(**{"routing.balance": "bias", "model.trainable": "lora"})


def test_settle_rates_constant_and_linear_and_their_sum_bounds_the_move():
    """``settle_rates``: ``constant`` u at each of K updates; ``linear`` u (1 - i/K), from u down to u/K; the sum
    (the most a settle moves a bias entry, the coordinator's bound) is K u and u (K + 1) / 2."""
    from distmoe.model.balance import settle_rates

    assert settle_rates(4, 0.01, "constant") == [0.01] * 4
    lin = settle_rates(4, 0.02, "linear")
    assert lin == pytest.approx([0.02, 0.015, 0.01, 0.005])
    assert sum(settle_rates(100, 0.02, "linear")) == pytest.approx(0.02 * 101 / 2)
    assert settle_rates(0, 0.02, "linear") == []
    with pytest.raises(ValueError, match="balance-settle-schedule"):
        settle_rates(4, 0.01, "cosine")


# ------------------------------------------------------------------ a sigmoid router's own correction bias
@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    from distmoe.model.fabricate import write_checkpoint

    return write_checkpoint("deepseek_v3", tmp_path_factory.mktemp("v3") / "ckpt", seed=5)


def _sigmoid_model(path, **extra):
    from distmoe.config import parse_run_config

    cfg = parse_run_config({"model.path": str(path), "model.trainable": "all", **extra})
    model, _ = build_model(cfg.model)
    return cfg, apply_trainable(model, cfg.model)


def test_a_sigmoid_routers_bias_is_its_own_correction_bias(v3):
    from distmoe.model.router_rule import CORRECTION_BIAS, routing_of

    _, plain = _sigmoid_model(v3, **{"routing.balance": "aux"})
    cfg, model = _sigmoid_model(v3, **{"routing.balance": "bias"})
    (name, router), = router_modules(model)
    (_, plain_router), = router_modules(plain)
    key = f"{name}.{CORRECTION_BIAS}"
    assert balance.has_bias(model) and not balance.has_bias(plain)
    assert CORRECTION_BIAS in plain_router._buffers and key not in trainable_names(plain)  # frozen without the key
    assert key in spec_of(model, cfg.model.trainable).keys and not [n for n in trainable_names(model)
                                                                     if n.endswith(balance.BIAS_NAME)]
    own = plain_router.e_score_correction_bias
    assert own.abs().sum() > 0 and torch.equal(balance.biases(model)[0].detach(), own)  # the checkpoint's value
    assert not router._forward_hooks  # the router's own forward chooses with it: no hook
    h = torch.randn(40, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, w0, i0 = plain_router(h)
        _, w1, i1 = router(h)
    assert torch.equal(i0, i1) and torch.equal(w0, w1)  # installing it changes nothing

    x, m = _ids()
    model.train()
    model(input_ids=x, attention_mask=m, labels=x).loss.backward()
    assert balance.biases(model)[0].grad is None and router.weight.grad is not None

    # the sign rule moves it, and the router's own choice follows: expert 5 raised wins every token's choice
    tracker = balance.BalanceTracker(model, rate=0.01)
    _one_step(model, x, m, tracker)
    c = tracker.last[0]  # [E]
    torch.testing.assert_close(balance.biases(model)[0].detach(), own + 0.01 * torch.sign(c.mean() - c).float())
    with torch.no_grad():
        balance.biases(model)[0][5] += 10.0
        _, _, i2 = router(h)
    assert (i2 == 5).any(-1).all()
    # the first-choice count takes the argmax of the choice scores (the router returns its top-k unsorted)
    first = balance.BalanceTracker(model, rate=0.01, count="first")
    _one_step(model, x, m, first, step=False)
    assert first.last[0][5] == m.sum() and first.last[0].sum() == m.sum()
    rule = routing_of(model)
    assert rule.choose(torch.zeros(1, 8), balance.biases(model)[0])[0, 0] == 5
