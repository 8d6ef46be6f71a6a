"""Tests for distmoe.rl.losses and distmoe.rl.advantages, always against the real functions (never a copy)."""

from __future__ import annotations

import math

import pytest
import torch

from distmoe.rl.advantages import group_advantages
from distmoe.rl.losses import (
    LOG_CLAMP,
    POLICY_LOSSES,
    get_policy_loss,
    masked_entropy,
    mismatch_weights,
)

LOW, HIGH = 0.5, 5.0


def _k_row(ks):
    """logp_train_old, logp_infer [1, T] with delta = log k exactly (logp_infer = 0), and the k the function sees."""
    d = torch.log(torch.tensor([ks], dtype=torch.float32))  # [1, T]
    return d.clone(), torch.zeros_like(d), torch.exp(d)  # [1, T] x3


def _bound_row():
    """k = 0.3 (below), exactly low, 1 (inside), exactly high, 7 (above), with the bounds set to the fp32 k values."""
    old, inf, k = _k_row([0.3, LOW, 1.0, HIGH, 7.0])  # [1, 5]
    return old, inf, k, float(k[0, 1]), float(k[0, 3])


# --------------------------------------------------------------------------------------------- bounds

def test_mask_mode_bounds_inclusive():
    old, inf, k, low, high = _bound_row()
    mask = torch.ones_like(old)  # [1, 5]
    w, stats = mismatch_weights(old, inf, mask, mode="mask", low=low, high=high)
    expected = torch.tensor([[0.0, k[0, 1], 1.0, k[0, 3], 0.0]])  # [1, 5]
    assert torch.equal(w, expected)
    assert stats["icepop/masked_frac_low"] == pytest.approx(1 / 5)
    assert stats["icepop/masked_frac_high"] == pytest.approx(1 / 5)
    assert stats["icepop/masked_frac"] == pytest.approx(2 / 5)
    assert stats["icepop/seq_with_masked_token_frac"] == 1.0


def test_mask_mode_bound_equal_low_high():
    # k = exp(0) = 1 exactly, low == high == 1: kept only because both bounds are inclusive
    z = torch.zeros(1, 3)  # [1, 3]
    w, stats = mismatch_weights(z, z, torch.ones_like(z), mode="mask", low=1.0, high=1.0)
    assert torch.equal(w, torch.ones(1, 3))
    assert stats["icepop/masked_frac"] == 0.0


def test_truncate_mode_keeps_low_k_and_caps_high():
    old, inf, k, low, high = _bound_row()
    w, stats = mismatch_weights(old, inf, torch.ones_like(old), mode="truncate", low=low, high=high)
    expected = torch.tensor([[k[0, 0], k[0, 1], 1.0, k[0, 3], k[0, 3]]])  # [1, 5]
    assert torch.equal(w, expected)
    assert w[0, 0] > 0  # TIS does not use `low`
    assert w[0, 4] == pytest.approx(high)
    # stats still report what IcePop would mask
    assert stats["icepop/masked_frac_low"] == pytest.approx(1 / 5)


def test_none_mode_is_ones_on_valid_tokens():
    old, inf, _, _, _ = _bound_row()
    mask = torch.tensor([[1, 1, 1, 0, 0]])  # [1, 5]
    w, _ = mismatch_weights(old, inf, mask, mode="none")
    assert torch.equal(w, torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]]))


def test_invalid_level_mode_and_bounds():
    z = torch.zeros(1, 2)  # [1, 2]
    with pytest.raises(ValueError):
        mismatch_weights(z, z, z, level="geometric")
    with pytest.raises(ValueError):
        mismatch_weights(z, z, z, mode="clip")
    with pytest.raises(ValueError):
        mismatch_weights(z, z, z, low=2.0, high=1.0)


# --------------------------------------------------------------------------------------------- gradients

def _batch():
    """Two sequences of 4 tokens; row 1 has one padded token. Token (0, 1) has k = 10 and (1, 0) has k = 0.1."""
    logp_infer = torch.tensor([[-1.0, -2.0, -0.5, -1.5], [-1.0, -0.7, -0.3, -9.0]])  # [2, 4]
    delta = torch.tensor([[0.1, math.log(10.0), -0.2, 0.0], [math.log(0.1), 0.3, 0.0, 0.0]])  # [2, 4]
    logp_train_old = logp_infer + delta  # [2, 4]
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])  # [2, 4]
    adv = torch.tensor([1.0, -0.5])  # [2]
    return logp_train_old, logp_infer, mask, adv


@pytest.mark.parametrize("name", ["grpo", "reinforce"])
def test_zero_gradient_on_masked_tokens(name):
    logp_train_old, logp_infer, mask, adv = _batch()
    w, _ = mismatch_weights(logp_train_old, logp_infer, mask, mode="mask")
    assert w[0, 1] == 0 and w[1, 0] == 0
    logp_new = (logp_train_old + 0.05).clone().requires_grad_(True)  # [2, 4], inside the clip range
    loss, _ = get_policy_loss(name)(logp_new, logp_train_old, adv, mask, w)
    loss.backward()
    g = logp_new.grad  # [2, 4]
    zero_at = (w == 0)  # [2, 4]: the two IcePop-masked tokens and the padded one
    assert torch.all(g[zero_at] == 0)
    assert torch.all(g[~zero_at] != 0)


def test_weights_are_detached():
    logp_train_old, logp_infer, mask, adv = _batch()
    logp_train_old.requires_grad_(True)
    logp_infer.requires_grad_(True)
    for level in ("token", "sequence"):
        for mode in ("mask", "truncate", "none"):
            w, _ = mismatch_weights(logp_train_old, logp_infer, mask, level=level, mode=mode)
            assert not w.requires_grad and w.grad_fn is None
    w, _ = mismatch_weights(logp_train_old, logp_infer, mask)
    logp_new = logp_train_old.detach().clone().requires_grad_(True)  # [2, 4]
    loss, _ = get_policy_loss("grpo")(logp_new, logp_train_old, adv, mask, w)
    loss.backward()
    assert logp_train_old.grad is None and logp_infer.grad is None
    assert logp_new.grad is not None


def test_padding_ignored():
    logp_train_old, logp_infer, mask, adv = _batch()
    logp_new = logp_train_old + 0.1  # [2, 4]
    pad = mask == 0  # [2, 4]
    results = []
    for fill in (0.0, 1e4, float("nan"), float("-inf")):
        tensors = [t.masked_fill(pad, fill) for t in (logp_train_old, logp_infer, logp_new)]  # [2, 4] x3
        old, inf, new = tensors
        new = new.clone().requires_grad_(True)
        w, stats = mismatch_weights(old, inf, mask, mode="mask")
        loss, metrics = get_policy_loss("grpo")(new, old, adv, mask, w, ref_logp=old, kl_coef=0.1)
        loss.backward()
        results.append((w, stats, loss.detach(), metrics, new.grad))
    w0, s0, l0, m0, g0 = results[0]
    assert s0["mismatch/num_valid_tokens"] == 7.0
    assert s0["icepop/masked_frac"] == pytest.approx(2 / 7)  # 2 masked of 7 valid, the padded token not counted
    assert w0[1, 3] == 0 and g0[1, 3] == 0
    for w, s, loss, m, g in results[1:]:
        assert torch.equal(w, w0) and s == s0 and torch.equal(loss, l0) and m == m0 and torch.equal(g, g0)


def test_stats_count_only_valid_tokens():
    # the padded token has a huge mismatch: it must not show in any statistic
    old = torch.tensor([[0.0, 0.0, 50.0]])  # [1, 3]
    inf = torch.zeros_like(old)  # [1, 3]
    mask = torch.tensor([[1, 1, 0]])  # [1, 3]
    _, stats = mismatch_weights(old, inf, mask)
    assert stats["icepop/masked_frac"] == 0.0
    assert stats["mismatch/logp_abs_diff_max"] == 0.0
    assert stats["mismatch/kl_k3"] == 0.0
    assert stats["icepop/seq_with_masked_token_frac"] == 0.0


def test_empty_mask_gives_zero_stats_and_loss():
    z = torch.zeros(2, 3)  # [2, 3]
    w, stats = mismatch_weights(z, z, torch.zeros(2, 3))
    assert torch.equal(w, z) and all(v == 0.0 for v in stats.values())
    loss, _ = get_policy_loss("grpo")(z.clone().requires_grad_(True), z, torch.ones(2), torch.zeros(2, 3), w)
    assert loss.item() == 0.0


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["mask", "truncate", "none"])
def test_finite_at_extreme_log_ratios(level, mode):
    old = torch.tensor([[1e4, -1e4, 0.0], [1e4, 1e4, 1e4]])  # [2, 3]
    inf = torch.zeros_like(old)  # [2, 3]
    mask = torch.ones_like(old)  # [2, 3]
    w, stats = mismatch_weights(old, inf, mask, level=level, mode=mode)
    assert torch.isfinite(w).all()
    assert all(math.isfinite(v) for v in stats.values())
    assert w.max() <= math.exp(LOG_CLAMP) * (1 + 1e-6)
    # extreme PPO ratios too
    logp_new = (old.flip(0) * -1).clone().requires_grad_(True)  # [2, 3]: log r = ±2e4
    loss, metrics = get_policy_loss("grpo")(logp_new, old, torch.tensor([1.0, -1.0]), mask, w)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp_new.grad).all()
    assert all(math.isfinite(v) for v in metrics.values())


def test_token_k_is_clamped():
    old = torch.tensor([[1e4, -1e4]])  # [1, 2]
    w, stats = mismatch_weights(old, torch.zeros_like(old), torch.ones_like(old), mode="truncate", high=1e12)
    assert torch.allclose(w, torch.tensor([[math.exp(LOG_CLAMP), math.exp(-LOG_CLAMP)]]))
    assert stats["mismatch/logp_abs_diff_max"] == 1e4  # |delta| itself is reported unclamped


# --------------------------------------------------------------------------------------------- reductions

@pytest.mark.parametrize("name", ["grpo", "reinforce"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_exact_reduction_to_grpo_when_k_is_one(name, level):
    logp_train_old, _, mask, adv = _batch()
    logp_infer = logp_train_old.clone()  # k == 1 exactly
    logp_new_a = (logp_train_old + torch.tensor([0.3, -0.1, 0.05, 0.0])).requires_grad_(True)  # [2, 4]
    logp_new_b = logp_new_a.detach().clone().requires_grad_(True)  # [2, 4]
    w_ice, _ = mismatch_weights(logp_train_old, logp_infer, mask, level=level, mode="mask")
    w_none, _ = mismatch_weights(logp_train_old, logp_infer, mask, level=level, mode="none")
    assert torch.equal(w_ice, w_none)
    fn = get_policy_loss(name)
    loss_ice, m_ice = fn(logp_new_a, logp_train_old, adv, mask, w_ice)
    loss_none, m_none = fn(logp_new_b, logp_train_old, adv, mask, w_none)
    loss_ice.backward()
    loss_none.backward()
    assert torch.equal(loss_ice, loss_none) and m_ice == m_none
    assert torch.equal(logp_new_a.grad, logp_new_b.grad)


def test_masked_tokens_stay_in_length_normaliser():
    # one sequence of 4 tokens, r == 1 and A == 1 so every per-token term is -w; IcePop masks tokens 2 and 3
    logp_infer = torch.zeros(1, 4)  # [1, 4]
    logp_train_old = torch.tensor([[0.0, 0.0, 3.0, -3.0]])  # [1, 4]: k = 1, 1, e^3 (> 5), e^-3 (< 0.5)
    mask = torch.ones(1, 4)  # [1, 4]
    adv = torch.ones(1)  # [1]
    w_mask, _ = mismatch_weights(logp_train_old, logp_infer, mask, mode="mask")
    w_none, _ = mismatch_weights(logp_train_old, logp_infer, mask, mode="none")
    assert torch.equal(w_mask, torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
    fn = get_policy_loss("grpo")
    loss_masked, _ = fn(logp_train_old.clone(), logp_train_old, adv, mask, w_mask)
    loss_full, _ = fn(logp_train_old.clone(), logp_train_old, adv, mask, w_none)
    assert loss_full.item() == -1.0
    assert loss_masked.item() == 0.5 * loss_full.item()  # not -1.0 (which dropping them from the count would give)


def test_sequence_mean_then_batch_mean():
    # seq 0: 1 valid token with term -2, seq 1: 3 valid tokens with term -1 -> (-2 + -1) / 2, not -5 / 4
    z = torch.zeros(2, 3)  # [2, 3]
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])  # [2, 3]
    loss, _ = get_policy_loss("reinforce")(z.clone(), z, torch.tensor([2.0, 1.0]), mask, mask.float())
    assert loss.item() == pytest.approx(-1.5)


def test_k3_formula_hand_values():
    old = torch.tensor([[math.log(2.0), -math.log(2.0), 0.0, 0.0]], dtype=torch.float64)  # [1, 4], k = 2, 1/2, 1
    inf = torch.zeros_like(old)  # [1, 4]
    mask = torch.tensor([[1, 1, 1, 0]])  # [1, 4]
    _, stats = mismatch_weights(old, inf, mask)
    ln2 = math.log(2.0)
    assert stats["mismatch/kl_k3"] == pytest.approx(((2 - 1 - ln2) + (0.5 - 1 + ln2) + 0.0) / 3, rel=1e-12)
    assert stats["mismatch/kl_k1"] == pytest.approx(0.0, abs=1e-12)
    assert stats["mismatch/logp_abs_diff_mean"] == pytest.approx(2 * ln2 / 3, rel=1e-12)
    assert stats["mismatch/logp_abs_diff_max"] == pytest.approx(ln2, rel=1e-12)
    assert stats["mismatch/k_mean"] == pytest.approx(3.5 / 3, rel=1e-12)


def test_sequence_level_geometric_weight_and_whole_sequence_masking():
    delta = torch.tensor([
        [math.log(8.0), math.log(0.5), 0.0, 0.0],  # token 0 alone would be masked (k=8); geo mean 2^(2/3) kept
        [math.log(4.0), math.log(4.0), math.log(4.0), math.log(16.0)],  # each token in bounds-ish; geo mean > 5
        [math.log(3.0), 99.0, 99.0, 99.0],  # one valid token, the rest padding
    ], dtype=torch.float64)  # [3, 4]
    inf = torch.zeros_like(delta)  # [3, 4]
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])  # [3, 4]
    w, stats = mismatch_weights(delta, inf, mask, level="sequence", mode="mask")
    geo0 = math.exp((math.log(8.0) + math.log(0.5)) / 3)
    geo1 = math.exp((3 * math.log(4.0) + math.log(16.0)) / 4)
    assert geo1 > HIGH
    assert torch.allclose(w[0, :3], torch.full((3,), geo0, dtype=torch.float64), rtol=1e-12) and w[0, 3] == 0
    assert torch.equal(w[1], torch.zeros(4, dtype=torch.float64))  # the whole sequence is masked
    assert w[2, 0] == pytest.approx(3.0, rel=1e-12) and torch.all(w[2, 1:] == 0)
    assert stats["icepop/masked_frac_high"] == pytest.approx(4 / 8)
    assert stats["icepop/seq_with_masked_token_frac"] == pytest.approx(1 / 3)
    # token level masks token (0, 0) and (1, 3) instead
    w_tok, _ = mismatch_weights(delta, inf, mask, level="token", mode="mask")
    assert w_tok[0, 0] == 0 and w_tok[1, 3] == 0 and w_tok[1, 0] == pytest.approx(4.0)
    # truncate at sequence level: min(geo, high) on every valid token
    w_tis, _ = mismatch_weights(delta, inf, mask, level="sequence", mode="truncate")
    assert torch.allclose(w_tis[1], torch.full((4,), HIGH, dtype=torch.float64))


# --------------------------------------------------------------------------------------------- advantages

def test_group_advantages_hand_example():
    eps = 1e-6
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])  # [B*G] = [2*4]
    adv = group_advantages(r, group_size=4, eps=eps)  # [8]
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (0.5 + eps)  # population std of {1,0,0,1} is 0.5
    assert torch.allclose(adv[:4], expected)
    assert torch.equal(adv[4:], torch.zeros(4))
    assert torch.equal(group_advantages(r.view(2, 4), group_size=4, eps=eps), adv)  # [B, G] input
    assert torch.equal(group_advantages(r, 4, std_normalise=False)[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    r2 = torch.tensor([3.0, 1.0, 2.0])  # [3], G = 3: mean 2, std sqrt(2/3)
    assert torch.allclose(group_advantages(r2, 3, eps=0.0), torch.tensor([1.0, -1.0, 0.0]) / math.sqrt(2 / 3))


def test_group_advantages_constant_groups_exactly_zero():
    r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7])  # [6]: mean of 0.1s is not exactly 0.1 in floating point
    assert torch.equal(group_advantages(r, 3), torch.zeros(6))
    assert torch.equal(group_advantages(torch.tensor([1, 1]), 1), torch.zeros(2))  # int rewards, G = 1
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 3), 2)


# --------------------------------------------------------------------------------------------- registry, clip

def test_registry_and_unknown_name():
    assert {"grpo", "reinforce"} <= set(POLICY_LOSSES)
    assert get_policy_loss("grpo") is POLICY_LOSSES["grpo"]
    with pytest.raises(ValueError) as err:
        get_policy_loss("ppo-typo")
    msg = str(err.value)
    assert "ppo-typo" in msg and "grpo" in msg and "reinforce" in msg


def _clip_case():
    ratios = torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.5, 1.1]])  # [2, 3]
    logp_old = torch.zeros(2, 3)  # [2, 3]
    logp_new = torch.log(ratios)  # [2, 3]
    adv = torch.tensor([1.0, -1.0])  # [2]
    return logp_new, logp_old, adv, torch.ones(2, 3)


def test_clip_fraction_hand_example():
    logp_new, logp_old, adv, mask = _clip_case()
    # A > 0: clip active for r = 1.5 (> 1.2) only; A < 0: active for r = 0.5 (< 0.8) only
    _, m = get_policy_loss("grpo")(logp_new, logp_old, adv, mask, mask, clip_eps=0.2)
    assert m["ppo/clipfrac"] == pytest.approx(2 / 6)
    assert m["ppo/ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.0 + 1.5 + 0.5 + 1.1) / 6, rel=1e-6)
    assert m["ppo/adv_abs_mean"] == pytest.approx(1.0)
    # asymmetric (clip-higher): 1 + 0.6 = 1.6 no longer clips r = 1.5
    _, m = get_policy_loss("grpo")(logp_new, logp_old, adv, mask, mask, clip_eps=0.2, clip_eps_high=0.6)
    assert m["ppo/clipfrac"] == pytest.approx(1 / 6)
    # padding does not count in the fraction
    pad = torch.tensor([[1, 1, 1], [1, 0, 1]])  # [2, 3]
    _, m = get_policy_loss("grpo")(logp_new, logp_old, adv, pad, pad.float())
    assert m["ppo/clipfrac"] == pytest.approx(1 / 5)


def test_reinforce_differs_from_grpo_only_outside_clip_range():
    logp_old = torch.zeros(2, 3)  # [2, 3]
    adv = torch.tensor([1.0, -1.0])  # [2]
    mask = torch.ones(2, 3)  # [2, 3]
    inside = torch.log(torch.tensor([[0.9, 1.0, 1.15], [0.85, 1.1, 1.0]]))  # [2, 3], all in [0.8, 1.2]
    losses, grads = [], []
    for name in ("grpo", "reinforce"):
        lp = inside.clone().requires_grad_(True)
        loss, _ = get_policy_loss(name)(lp, logp_old, adv, mask, mask)
        loss.backward()
        losses.append(loss.detach())
        grads.append(lp.grad)
    assert torch.allclose(losses[0], losses[1], rtol=0, atol=1e-7)
    assert torch.allclose(grads[0], grads[1], rtol=0, atol=1e-7)
    logp_new, _, _, _ = _clip_case()
    lg, mg = get_policy_loss("grpo")(logp_new, logp_old, adv, mask, mask)
    lr, mr = get_policy_loss("reinforce")(logp_new, logp_old, adv, mask, mask)
    assert not torch.allclose(lg, lr)
    assert mr["ppo/clipfrac"] == 0.0 and mg["ppo/clipfrac"] > 0


def test_kl_to_reference():
    logp_new = torch.tensor([[-1.0, -2.0]]).requires_grad_(True)  # [1, 2]
    logp_old = logp_new.detach().clone()  # [1, 2]
    ref = torch.tensor([[-1.0, -2.0 + math.log(2.0)]])  # [1, 2]: pi_ref / pi = 1, 2
    mask = torch.ones(1, 2)  # [1, 2]
    adv = torch.zeros(1)  # [1]: only the KL term remains
    fn = get_policy_loss("grpo")
    loss, m = fn(logp_new, logp_old, adv, mask, mask, ref_logp=ref, kl_coef=0.5)
    k3 = (2.0 - 1.0 - math.log(2.0)) / 2  # mean over both tokens
    assert m["ppo/kl_ref"] == pytest.approx(k3, rel=1e-6)
    assert loss.item() == pytest.approx(0.5 * k3, rel=1e-6)
    loss0, m0 = fn(logp_new, logp_old, adv, mask, mask)
    assert loss0.item() == 0.0 and "ppo/kl_ref" not in m0


def test_masked_entropy():
    logits = torch.zeros(2, 3, 8)  # [2, 3, 8]: uniform -> entropy log 8
    logits[1, 2] = torch.tensor([100.0] + [-100.0] * 7)  # [8]: nearly one-hot -> entropy ~ 0
    sel = torch.tensor([[1, 0, 0], [0, 0, 0]])  # [2, 3]
    assert masked_entropy(logits, sel) == pytest.approx(math.log(8.0), rel=1e-6)
    sel2 = torch.tensor([[1, 0, 0], [0, 0, 1]])  # [2, 3]
    assert masked_entropy(logits, sel2) == pytest.approx(math.log(8.0) / 2, rel=1e-5)
    assert math.isnan(masked_entropy(logits, torch.zeros(2, 3)))
    logits[0, 0, 0] = -float("inf")  # a zero-probability token must not produce NaN
    assert math.isfinite(masked_entropy(logits, sel))
