"""Local DPO (``distmoe.rl.dpo``): the loss against a hand computation, its gradient at policy = reference, the
IcePop pair mask, the reference from a mismatched engine, and the held-out margin rising over a few local steps on
the synthetic preference task (the phase end to end: tests/coordinator/test_dpo_phase.py)."""

from __future__ import annotations

import math

import pytest
import torch

from distmoe.config import parse_run_config
from distmoe.data.party import load_party
from distmoe.data.synth import write_synthetic
from distmoe.data.template import encode_example
from distmoe.model.build import build_model, describe
from distmoe.model.trainable import apply_trainable, trainable_state
from distmoe.rl.dpo import dpo_loss, pair_keep, preference_margins, reference_logps, token_logps, train_dpo

TINY = {"model.hidden-size": 64, "model.moe-intermediate-size": 64, "model.layers": 2, "model.heads": 2,
        "model.kv-heads": 1, "model.head-dim": 32, "model.experts": 4, "model.top-k": 2}
FAST = {"train.lr": 5e-3, "train.lr-experts": 5e-3, "train.lr-router": 5e-3, "train.warmup-steps": 0,
        "dpo.pairs-per-step": 8}


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_dpo_loss_matches_a_hand_computation():
    pol_w, pol_l = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.5])
    ref_w, ref_l = torch.tensor([-1.5, -2.0]), torch.tensor([-2.5, -1.0])
    loss, st = dpo_loss(pol_w, pol_l, ref_w, ref_l, beta=0.5)
    # h = beta * ((pol_w - ref_w) - (pol_l - ref_l)) = 0.5 * (0.5 + 0.5), 0.5 * (0 + 0.5)
    assert float(loss) == pytest.approx(-(_logsig(0.5) + _logsig(0.25)) / 2, rel=1e-6)
    assert st["margin"] == pytest.approx((1.0 + 0.5) / 2) and st["pref_acc"] == 1.0
    assert st["reward_chosen"] == pytest.approx(0.5 * (0.5 + 0.0) / 2)
    assert st["reward_rejected"] == pytest.approx(0.5 * (-0.5 - 0.5) / 2)


def test_policy_equal_to_reference_gives_log_two_and_gradient_only_to_the_policy():
    beta, b = 0.1, 3
    pol_w = torch.tensor([-2.0, -1.0, -4.0], requires_grad=True)
    pol_l = torch.tensor([-3.0, -0.5, -1.0], requires_grad=True)
    ref_w, ref_l = pol_w.detach().clone().requires_grad_(True), pol_l.detach().clone().requires_grad_(True)
    loss, st = dpo_loss(pol_w, pol_l, ref_w, ref_l, beta)
    assert float(loss.detach()) == pytest.approx(math.log(2), abs=1e-7)  # -log sigmoid(0)
    assert st["margin"] == 0.0 and st["pref_acc"] == 0.0
    loss.backward()
    # d/d s_w of -log sigmoid(h) / B = -sigmoid(-h) * beta / B = -beta / (2B) at h = 0; opposite for s_l
    assert torch.allclose(pol_w.grad, torch.full((b,), -beta / (2 * b)))
    assert torch.allclose(pol_l.grad, torch.full((b,), beta / (2 * b)))
    assert ref_w.grad is None and ref_l.grad is None  # the reference is a constant


def test_masked_pairs_contribute_nothing_but_count_in_the_mean():
    pol_w = torch.tensor([-1.0, -1.0], requires_grad=True)
    pol_l = torch.tensor([-2.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.5])
    loss, st = dpo_loss(pol_w, pol_l, ref, ref, beta=1.0, keep=torch.tensor([True, False]))
    assert float(loss) == pytest.approx(-_logsig(1.0) / 2, rel=1e-6)  # one pair's loss over both pairs
    loss.backward()
    assert pol_w.grad[1] == 0 and pol_l.grad[1] == 0 and pol_w.grad[0] < 0 < pol_l.grad[0]
    assert st["kept_frac"] == 0.5 and st["margin"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(pol_w, pol_l, ref, ref, beta=0.0)


def test_token_logps_score_the_completion_tokens_only():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)  # [B, S, V]
    labels = torch.tensor([[-100, -100, 3, 4, -100], [-100, 2, 6, 1, 5]])  # [B, S]
    lp, mask = token_logps(logits, labels)
    ls = torch.log_softmax(logits, -1)
    assert mask.tolist() == [[False, True, True, False, False], [True, True, True, True, False]]
    assert lp[0, 1] == pytest.approx(float(ls[0, 1, 3])) and lp[0, 2] == pytest.approx(float(ls[0, 2, 4]))
    assert lp[1, 3] == pytest.approx(float(ls[1, 3, 5])) and lp[0, 0] == 0 and lp[1, 4] == 0


def test_pair_keep_masks_pairs_with_a_token_outside_the_bounds():
    t = torch.tensor
    train = [(t([-1.0, -2.0]), t([-0.5])), (t([-1.0]), t([-1.0, -1.0])), (t([-3.0]), t([-2.0]))]
    infer = [(t([-1.0, -2.0]), t([-0.5])),  # identical: kept
             (t([-1.0]), t([-1.0, -1.0 - math.log(6.0)])),  # one rejected token with k = 6 > 5: masked
             (t([-3.0 + math.log(2.0)]), t([-2.0 - math.log(5.0)]))]  # k = 0.5 and k = 5: both bounds inclusive
    keep, st = pair_keep(train, infer, low=0.5, high=5.0)
    assert keep.tolist() == [True, False, True]
    assert st["ref_masked_frac"] == pytest.approx(1 / 3)
    keep, _ = pair_keep(train, infer, low=0.6, high=5.0)
    assert keep.tolist() == [True, False, False]
    with pytest.raises(ValueError, match="tokens"):
        pair_keep([(t([-1.0]), t([-1.0]))], [(t([-1.0, -1.0]), t([-1.0]))], 0.5, 5.0)


@pytest.fixture(scope="module")
def pref(tmp_path_factory):
    d = write_synthetic(tmp_path_factory.mktemp("pref"), parties=1, examples_per_task=120, seed=0, tasks=("pref",))[0]
    return load_party(d, parse_run_config(TINY).data)


def _tiny(seed: int, pref, **over):
    cfg = parse_run_config({**TINY, **FAST, "run.seed": seed, **over})
    model, tok = build_model(cfg.model)
    model = apply_trainable(model, cfg.model)

    def enc(exs):
        return [(encode_example(tok, e, cfg.model.max_seq_len), encode_example(tok, e.rejected_example(),
                                                                                cfg.model.max_seq_len)) for e in exs]
    return cfg, model, tok, enc(pref.train("pref")), enc(pref.heldout("pref"))


def test_reference_from_a_pruned_engine_differs_and_tight_bounds_mask_pairs(pref):
    _, model, tok, pairs, _ = _tiny(0, pref)
    exact = reference_logps(model, pairs, tok.pad_token_id, 8)
    assert exact.keep.all() and exact.stats["ref_masked_frac"] == 0.0
    wide = reference_logps(model, pairs, tok.pad_token_id, 8, engine="prune-1", low=0.0, high=1e6)
    assert wide.keep.all() and wide.stats["ref_logp_diff_mean"] > 0  # a genuine mismatch
    assert not torch.allclose(wide.chosen, exact.chosen)
    tight = reference_logps(model, pairs, tok.pad_token_id, 8, engine="prune-1", low=0.999, high=1.001)
    assert 0 < tight.stats["ref_masked_frac"] <= 1 and (~tight.keep).sum() > 0
    same = reference_logps(model, pairs, tok.pad_token_id, 8, engine="exact", low=0.999, high=1.001)
    assert same.keep.all()  # the exact engine agrees with the trainer to ~1e-6


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dpo_raises_the_held_out_margin_on_the_synthetic_preference_task(pref, seed):
    cfg, model, tok, pairs, held = _tiny(seed, pref, **{"dpo.steps": 12})
    ms = describe(model)
    before_w = trainable_state(model)
    m0 = preference_margins(model, held, tok.pad_token_id, 16)
    ref = reference_logps(model, pairs, tok.pad_token_id, 16)
    res = train_dpo(model, pairs, ref, tok.pad_token_id, cfg.train, cfg.dpo, cfg.routing, ms.num_experts, ms.top_k,
                    None, seed)
    m1 = preference_margins(model, held, tok.pad_token_id, 16)
    assert res.steps == 12 and res.skipped_steps == 0
    assert res.dpo_losses[0] == pytest.approx(math.log(2), abs=1e-5)  # policy = reference at the first step
    # the held-out pairs: the correct answer gained on the wrong one (measured over seeds 0-4: +2.7 to +3.4 nats)
    assert float(m1.mean()) > float(m0.mean()) + 1.0
    s = res.summary()
    assert s["loss_last"] < s["loss_first"] and s["dpo_margin_first"] == pytest.approx(0.0, abs=1e-5)
    after_w = trainable_state(model)
    assert any(not torch.equal(before_w[k], after_w[k]) for k in before_w)


def test_a_nan_gradient_skips_the_dpo_step_and_names_the_tensor(pref):
    """The SFT loop's guard in the DPO loop: a poisoned parameter's NaN gradient skips that step only, named."""
    cfg, model, tok, pairs, _ = _tiny(0, pref, **{"dpo.steps": 3})
    ms = describe(model)
    ref = reference_logps(model, pairs, tok.pad_token_id, 16)
    name, param = next((n, p) for n, p in model.named_parameters() if p.requires_grad and "gate" in n)
    fired = {"n": 0}

    def poison(g):
        fired["n"] += 1
        return g * float("nan") if fired["n"] == 1 else g

    param.register_hook(poison)
    res = train_dpo(model, pairs, ref, tok.pad_token_id, cfg.train, cfg.dpo, cfg.routing, ms.num_experts, ms.top_k,
                    None, seed=0)
    assert res.skipped_steps == 1 and res.steps == 2
    assert res.nonfinite.skipped == 1 and res.nonfinite.params == {name: 1}
    assert all(torch.isfinite(p).all() for p in model.parameters())
