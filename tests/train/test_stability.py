"""Unit tests: the gradient guards of a local step (``distmoe.train.stability``): a non-finite gradient is
named and its step skipped, winsorisation bounds each element by k RMS of its tensor, and both reach the SFT
and GRPO loops."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import distmoe.train.sft as sft_mod
from distmoe.config import ConfigError
from distmoe.data.party import load_party
from distmoe.data.template import encode_example
from distmoe.model.build import build_model, describe
from distmoe.model.trainable import apply_trainable, trainable_state
from distmoe.train.sft import train_sft
from distmoe.train.stability import NonFinite, guard_gradients, winsorize_

GATE = "model.layers.0.mlp.gate.weight"


def _net_with_grads(poison: str | None = None) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    if poison is not None:  # a poisoned parameter: its gradient comes out NaN, the loss stays finite
        dict(net.named_parameters())[poison].register_hook(lambda g: g * float("nan"))
    net(torch.randn(5, 4)).pow(2).mean().backward()
    return net


def test_a_poisoned_parameter_is_named_and_nothing_is_clipped():
    net = _net_with_grads(poison="2.weight")
    named = list(net.named_parameters())
    before = {n: p.grad.clone() for n, p in named}
    norm, bad = guard_gradients(named, grad_clip=1e-3)
    assert not math.isfinite(float(norm)) and bad == ["2.weight"]
    # the caller discards the step: the finite gradients were not scaled by the NaN norm
    for n, p in named:
        if n != "2.weight":
            assert torch.equal(p.grad, before[n])


def test_finite_gradients_pass_and_are_clipped():
    net = _net_with_grads()
    named = list(net.named_parameters())
    norm, bad = guard_gradients(named, grad_clip=1e-3)
    assert bad is None and float(norm) > 1e-3
    after = torch.sqrt(sum(p.grad.pow(2).sum() for _, p in named))
    assert float(after) == pytest.approx(1e-3, rel=1e-4)


def test_nonfinite_tally_names_the_first_few_and_counts_all():
    tally = NonFinite()
    tally.add([f"p{i}" for i in range(7)])
    tally.add(["p0"])
    assert tally.skipped == 2 and tally.params["p0"] == 2
    assert tally.facts() == {"nonfinite_params": ["p0", "p1", "p2", "p3", "p4"], "nonfinite_tensors": 7}
    assert tally.summary() == "2 steps; 7 tensors: p0 (2), p1 (1), p2 (1), p3 (1), p4 (1), +2 more"


def test_winsorize_bounds_each_element_by_k_rms_of_its_tensor():
    g = torch.full((100,), 0.01)
    g[3] = 50.0  # one outlier
    h = torch.tensor([1.0, -1.0, 1.0, -1.0])  # no outlier: untouched
    k = 3.0
    rms = float(g.pow(2).mean().sqrt())
    winsorize_([g, h], k)
    assert float(g[3]) == pytest.approx(k * rms, rel=1e-6) and float(g.abs().max()) <= k * rms * (1 + 1e-6)
    assert torch.all(g[torch.arange(100) != 3] == 0.01)  # elements within the bound are unchanged
    assert torch.equal(h, torch.tensor([1.0, -1.0, 1.0, -1.0]))
    g[5] = 99.0
    winsorize_([g], 0.0)  # off
    assert float(g[5]) == 99.0


def test_winsorize_runs_before_the_norm_clip():
    torch.manual_seed(0)
    lin = nn.Linear(64, 64)  # 4096 weight elements: one outlier moves the RMS by at most 1e3 / 64
    lin(torch.randn(8, 64)).pow(2).mean().backward()
    named = list(lin.named_parameters())
    w = lin.weight.grad
    w[0, 0] = 1e3  # an outlier element
    bound = 2.0 * float(w.pow(2).mean().sqrt())
    norm, bad = guard_gradients(named, grad_clip=1e6, winsorize=2.0)  # the norm clip does not bind
    assert bad is None
    assert float(w[0, 0]) == pytest.approx(bound, rel=1e-5)  # cut to 2 RMS of its tensor
    assert bound < 1e3 / 10 and float(norm) < 1e3 / 10


def test_winsorize_key_is_off_by_default_and_validated(make_cfg):
    assert make_cfg().train.winsorize == 0.0
    assert make_cfg(**{"train.winsorize": 5.0}).train.winsorize == 5.0
    with pytest.raises(ConfigError, match="train.winsorize"):
        make_cfg(**{"train.winsorize": 0.5})


# --------------------------------------------------------------------------------------- in the SFT loop
@pytest.fixture(scope="module")
def party(synth_dirs, make_cfg):
    return load_party(synth_dirs[0], make_cfg().data)


def _sft(make_cfg, party, monkeypatch=None, poison_calls=(), **over):
    cfg = make_cfg(**{"train.local-steps": 3, "train.batch-size": 8, "train.warmup-steps": 0, **over})
    model, tok = build_model(cfg.model)
    model = apply_trainable(model, cfg.model)
    encoded = [encode_example(tok, ex, cfg.model.max_seq_len) for ex in party.train("arith")]
    if monkeypatch is not None:
        real, calls = sft_mod.sft_loss, {"n": 0}

        def poisoned(model_, *args, **kwargs):
            calls["n"] += 1
            loss, parts = real(model_, *args, **kwargs)
            if calls["n"] in poison_calls:  # finite loss, NaN gradient of the gate only
                gate = dict(model_.named_parameters())[GATE]
                loss = loss + 0.0 * torch.sqrt(gate.sum() * 0.0)
            return loss, parts

        monkeypatch.setattr(sft_mod, "sft_loss", poisoned)
    ms = describe(model)
    res = train_sft(model, encoded, tok.pad_token_id, cfg.train, cfg.routing, ms.num_experts, ms.top_k, None, seed=0)
    return res, model


def test_sft_skips_a_nan_gradient_step_and_names_the_parameter(make_cfg, party, monkeypatch):
    res, model = _sft(make_cfg, party, monkeypatch, poison_calls=(1, 3))
    assert res.skipped_steps == 2 and res.steps == 1
    assert res.nonfinite.skipped == 2 and res.nonfinite.params == {GATE: 2}
    assert res.nonfinite.facts() == {"nonfinite_params": [GATE], "nonfinite_tensors": 1}
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_sft_winsorize_changes_the_update_and_keeps_it_finite(make_cfg, party):
    off, m_off = _sft(make_cfg, party)
    on, m_on = _sft(make_cfg, party, **{"train.winsorize": 1.5})
    assert off.nonfinite.skipped == on.nonfinite.skipped == 0 and on.steps == off.steps
    a, b = trainable_state(m_off), trainable_state(m_on)
    assert any(not torch.equal(a[k], b[k]) for k in a)  # the clamp took effect
    assert all(torch.isfinite(v).all() for v in b.values())

