"""Example-level DP-SGD support probe: which trainable parameters opacus can sample per example, and the refusal."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from distmoe.model.build import build_model
from distmoe.model.trainable import apply_trainable, trainable_names
from distmoe.privacy.dpsgd import (
    DPSGDUnsupported,
    check_dp_sgd_support,
    diagnose_dp_sgd_support,
    require_dp_sgd_support,
)


def _model(make_cfg, trainable: str):
    mc = dataclasses.replace(make_cfg().model, trainable=trainable)
    model, _ = build_model(mc)
    return apply_trainable(model, mc)


def _moe_names(model) -> set[str]:
    return {n for n in trainable_names(model) if ".mlp." in n}


def test_default_all_is_refused_naming_the_experts_and_router(make_cfg):
    model = _model(make_cfg, "all")
    with pytest.raises(DPSGDUnsupported) as ei:
        require_dp_sgd_support(model, "party p3 local training")
    bad = ei.value.unsupported
    assert set(bad) == _moe_names(model)  # exactly the MoE block: experts (3-D fused) and router
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in bad)
    assert any(n.endswith("mlp.gate.weight") for n in bad)
    msg = str(ei.value)
    assert msg.startswith("party p3 local training:")
    assert f"{len(bad)} of {len(trainable_names(model))} trainable parameters" in msg
    assert "mlp.experts.gate_up_proj" in msg and "Qwen3MoeExperts" in msg and "Qwen3MoeTopKRouter" in msg
    assert "privacy.update-noise-multiplier" in msg
    assert check_dp_sgd_support(model) == bad


def test_non_moe_parameters_of_the_model_are_supported(make_cfg):
    # embedding (tied lm_head), attention projections and RMSNorms: opacus samples them correctly per example
    model = _model(make_cfg, "all")
    for n, p in model.named_parameters():
        p.requires_grad_(".mlp." not in n)
    assert check_dp_sgd_support(model) == []
    require_dp_sgd_support(model, "x")  # no raise


def test_router_plus_experts_is_entirely_unsupported(make_cfg):
    model = _model(make_cfg, "router+experts")
    assert set(check_dp_sgd_support(model)) == set(trainable_names(model))


def test_lora_refused_for_expert_and_router_adapters_only(make_cfg):
    model = _model(make_cfg, "lora")
    report = diagnose_dp_sgd_support(model)
    bad = set(report.unsupported)
    assert bad == _moe_names(model) and bad  # peft target_parameters adapters on experts/router
    attn = [n for n in trainable_names(model) if "self_attn" in n and "lora_" in n]
    assert attn and not bad & set(attn)  # attention adapters are fine
    assert "outside its module's forward" in report.reasons[sorted(bad)[0]]
    with pytest.raises(DPSGDUnsupported, match="lora_A"):
        require_dp_sgd_support(model, "p0")


def test_plain_mlp_is_supported_and_left_untouched():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    assert check_dp_sgd_support(model) == []
    assert torch.equal(torch.get_rng_state(), rng)
    assert not model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    for p in model.parameters():
        assert p.grad is None and not hasattr(p, "grad_sample")
    assert not model._forward_hooks and not model[0]._forward_hooks and not model[0]._backward_hooks


def test_batchnorm_is_reported():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    report = diagnose_dp_sgd_support(model)
    assert set(report.unsupported) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert "BatchNorm1d" in report.reasons["1.weight"]
    model[1].requires_grad_(False)  # frozen, but its batch statistics still mix examples
    assert set(check_dp_sgd_support(model)) == {"0.weight", "0.bias"}


class _Tokens(nn.Module):
    """Flattens [B, T, D] to tokens before a Linear: opacus would give per-token gradients."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x.reshape(-1, 3)).reshape(x.shape[0], x.shape[1], 2)


class _Functional(nn.Module):
    """Reads a child's weight outside the child's forward: opacus' hooks never see it."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 3)
        self.side = nn.Linear(3, 3, bias=False)

    def forward(self, x):
        return self.head(x) + nn.functional.linear(x, self.side.weight)


class _Center(nn.Module):
    def forward(self, x):
        return x - x.mean(dim=0, keepdim=True)  # mixes examples


def test_per_token_gradients_are_rejected():
    report = diagnose_dp_sgd_support(_Tokens(), batch=torch.randn(2, 4, 3))
    assert set(report.unsupported) == {"lin.weight", "lin.bias"}
    assert "expected (2, 2, 3)" in report.reasons["lin.weight"]


def test_parameter_used_outside_its_module_is_rejected():
    model = _Functional()
    assert check_dp_sgd_support(model, batch=torch.randn(3, 3)) == ["side.weight"]
    model.side.requires_grad_(False)  # frozen parameters are not reported
    assert check_dp_sgd_support(model, batch=torch.randn(3, 3)) == []


def test_batch_mixing_is_rejected():
    model = nn.Sequential(_Center(), nn.Linear(3, 2))
    report = diagnose_dp_sgd_support(model, batch=torch.randn(3, 3))
    assert set(report.unsupported) == {"1.weight", "1.bias"}
    assert "computed alone" in report.reasons["1.weight"]


def test_probe_needs_two_examples():
    with pytest.raises(ValueError, match="two examples"):
        check_dp_sgd_support(nn.Linear(2, 2), batch=torch.randn(1, 2))
