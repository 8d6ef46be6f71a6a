"""The local GRPO loop (distmoe.rl.grpo) on a briefly SFT-trained tiny MoE: exact vs pruned inference engines,
IcePop mask vs no correction, the update direction, config validation and NaN-step skipping."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from distmoe.config import ConfigError, RLConfig
from distmoe.rl.grpo import _encode, build_engine, logprobs_and_logits, minibatch_loss, reuse_valid, run_grpo
from distmoe.rl.losses import POLICY_LOSSES, get_policy_loss, mismatch_weights
from distmoe.rl.rollout import generate_rollouts, train_logprobs

BASE = {"prompts_per_step": 8, "group_size": 4, "max_new_tokens": 6, "lr": 1e-3, "reward": "task"}
KEYS = ("reward", "masked_frac_low", "masked_frac_high", "seq_masked_frac", "logp_diff_mean", "logp_diff_max",
        "k3", "clip_frac", "masked_entropy", "route_disagree_l0", "route_disagree_l1", "skipped_steps", "time_s")


@pytest.fixture(scope="module")
def trained(train_small_lookup):
    """The small model after 150 SFT steps on synthetic lookup data (~3-5 s) and 32 prompts (Examples)."""
    t = train_small_lookup()
    model, tok, examples = t["model"], t["tok"], t["examples"]
    return {"model": model, "tok": tok, "prompts": examples[:32]}


def _run(trained, reference_model=None, **kw):
    model = copy.deepcopy(trained["model"])
    cfg = RLConfig(**{"engine": "exact", **BASE, **kw})
    return model, run_grpo(model, trained["tok"], trained["prompts"], "lookup", cfg, reference_model)


def test_exact_engine_grpo_updates_and_metrics(trained):
    before = {n: p.detach().clone() for n, p in trained["model"].named_parameters()}
    model, res = _run(trained, steps=3, engine="exact", correction="icepop")
    assert len(res.steps) == 3 and res.updates == 6 and res.skipped_steps == 0
    after = dict(model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)  # the policy was updated
    assert all(torch.equal(before[n], p) for n, p in trained["model"].named_parameters())  # the input copy untouched
    assert not model.training  # left in eval mode
    for m in res.steps:
        assert set(KEYS) <= set(m)
        assert all(math.isfinite(v) for k, v in m.items() if k != "masked_entropy"), m
        assert math.isnan(m["masked_entropy"])  # no masked token: undefined, not 0
        assert m["masked_frac_low"] == m["masked_frac_high"] == m["seq_masked_frac"] == 0.0
        assert m["logp_diff_max"] < 1e-3 and m["k3"] < 1e-6
        assert m["route_disagree_l0"] == m["route_disagree_l1"] == 0.0
        assert 0.0 <= m["reward"] <= 1.0 and 0.0 <= m["clip_frac"] <= 1.0
    s = res.summary()
    assert s["steps"] == 3 and s["skipped_steps"] == 0 and s["logp_diff_max"] < 1e-3 and s["time_per_step_s"] > 0
    assert math.isnan(s["masked_entropy"])


def test_prune_engine_masks_tokens_and_mode_none_keeps_weights_one(trained):
    big = {"steps": 1, "engine": "prune-1", "prompts_per_step": 32, "max_new_tokens": 8}  # ~1000 tokens: 1-2 % masked
    _, masked = _run(trained, correction="icepop", **big)
    _, plain = _run(trained, correction="none", **big)
    m, p = masked.steps[0], plain.steps[0]
    assert m["masked_frac_low"] + m["masked_frac_high"] > 0.0 and m["seq_masked_frac"] > 0.0
    assert m["logp_diff_mean"] > 1e-3 and max(m["route_disagree_l0"], m["route_disagree_l1"]) > 0.0
    assert math.isfinite(m["masked_entropy"]) and m["masked_entropy"] >= 0.0
    bm, bp = masked.last_batch, plain.last_batch
    assert torch.equal(bm.rollouts.sequences, bp.rollouts.sequences)  # same seed: the same rollouts
    assert torch.equal(bm.logp_old, bp.logp_old)
    for k in ("masked_frac_low", "masked_frac_high", "seq_masked_frac", "logp_diff_mean", "k3", "masked_entropy"):
        assert p[k] == m[k], k  # mode none still reports what IcePop would mask
    valid = bp.rollouts.response_mask
    assert p["weights_all_one"] == 1.0 and (bp.weights[valid] == 1).all() and (bp.weights[~valid] == 0).all()
    assert m["weights_all_one"] == 0.0 and (bm.weights[valid] == 0).any()
    w, stats = mismatch_weights(bm.logp_old, bm.rollouts.logp_infer, valid, "token", "mask", 0.5, 5.0)
    assert torch.equal(w, bm.weights) and stats["icepop/masked_frac"] == m["masked_frac"]


def test_one_update_moves_towards_high_reward_samples(trained):
    """Deterministic property of the update direction: on the fixed batch, the surrogate loss goes down and the
    advantage-weighted change of the sequence log-probs is positive (high-reward samples gain probability)."""
    model, res = _run(trained, steps=1, engine="exact", correction="icepop", ppo_epochs=1, minibatches=1, lr=1e-4)
    b = res.last_batch
    assert res.updates == 1 and (b.advantages != 0).any()
    mask = b.rollouts.response_mask
    logp_new = train_logprobs(model, b.rollouts)  # [N, T]
    loss_fn = get_policy_loss("grpo")
    loss_before, _ = loss_fn(b.logp_old, b.logp_old, b.advantages, mask, b.weights)
    loss_after, _ = loss_fn(logp_new, b.logp_old, b.advantages, mask, b.weights)
    assert float(loss_after) < float(loss_before)
    d_seq = ((logp_new - b.logp_old) * mask).sum(1)  # [N] change of each sequence's log-prob
    assert float((b.advantages * d_seq).sum()) > 0.0
    assert float(d_seq[b.advantages > 0].mean()) > float(d_seq[b.advantages < 0].mean())


def test_kl_to_reference_is_reported(trained):
    _, res = _run(trained, steps=2, kl_coef=0.1, minibatches=1)
    assert "kl_ref" in res.steps[-1] and math.isfinite(res.steps[-1]["kl_ref"]) and res.steps[-1]["kl_ref"] >= 0


def test_config_validation_names_the_key(trained):
    """GRPO takes the run's rl section; constructing it validates it with the run config's own messages."""
    for field, value in (("steps", 0), ("group_size", 1), ("temperature", 0.0), ("lr", -1.0), ("ppo_epochs", 0),
                         ("minibatches", 0), ("clip_eps", 0.0), ("kl_coef", -1.0), ("correction_level", "batch"),
                         ("correction", "clip"), ("icepop_low", 2.0), ("icepop_high", 0.5), ("max_new_tokens", 0),
                         ("prompts_per_step", 0)):
        with pytest.raises(ConfigError, match=f"'rl.{field.replace('_', '-')}'"):
            RLConfig(**{field: value})
    with pytest.raises(ConfigError, match="rl.minibatches"):
        RLConfig(prompts_per_step=1, group_size=2, minibatches=3)
    with pytest.raises(ConfigError, match="rl.policy-loss.*grpo, reinforce"):
        RLConfig(policy_loss="ppo")
    with pytest.raises(ConfigError, match="rl.reward.*exact_match, numeric, format, task"):
        RLConfig(reward="bleu")
    with pytest.raises(ConfigError, match="rl.engine.*exact, bf16, int8-dynamic"):
        RLConfig(engine="fp8")
    # more prompts per step than prompts: drawn with replacement, never refused (a refusal told the count)
    import torch

    from distmoe.rl.grpo import _draw

    picks = _draw(2, 4, torch.Generator().manual_seed(0))
    assert len(picks) == 4 and set(picks) <= {0, 1}
    assert sorted(_draw(5, 5, torch.Generator().manual_seed(0))) == [0, 1, 2, 3, 4]  # enough: no repeats


def test_nan_loss_step_is_skipped_and_counted(trained, monkeypatch):
    real = POLICY_LOSSES["grpo"]
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan"), metrics) if calls["n"] == 1 else (loss, metrics)

    monkeypatch.setitem(POLICY_LOSSES, "grpo", flaky)
    model, res = _run(trained, steps=2, minibatches=2)
    assert calls["n"] == 4 and res.skipped_steps == 1 and res.updates == 3
    assert res.steps[0]["skipped_steps"] == 1.0 and res.steps[1]["skipped_steps"] == 0.0
    assert res.summary()["skipped_steps"] == 1.0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_nan_gradient_update_names_the_parameter_and_winsorize_reaches_the_updates(trained):
    """A poisoned parameter (NaN gradient, finite loss) skips that update and is named (``GRPOResult.nonfinite``);
    ``winsorize`` changes the applied updates (``train.winsorize``, passed by the party)."""
    model = copy.deepcopy(trained["model"])
    name, param = next((n, p) for n, p in model.named_parameters() if p.requires_grad and "gate" in n)
    fired = {"n": 0}

    def poison(g):
        fired["n"] += 1
        return g * float("nan") if fired["n"] == 1 else g

    param.register_hook(poison)
    cfg = RLConfig(**{"engine": "exact", **BASE, "steps": 2, "minibatches": 2})
    res = run_grpo(model, trained["tok"], trained["prompts"], "lookup", cfg)
    assert res.skipped_steps == 1 and res.updates == 3
    assert res.nonfinite.skipped == 1 and res.nonfinite.params == {name: 1}
    assert all(torch.isfinite(p).all() for p in model.parameters())

    plain, _ = _run(trained, steps=1)
    again, _ = _run(trained, steps=1)
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), again.parameters(), strict=True))  # seeded
    wins = copy.deepcopy(trained["model"])
    run_grpo(wins, trained["tok"], trained["prompts"], "lookup", RLConfig(**{"engine": "exact", **BASE, "steps": 1}),
             winsorize=1.5)
    a, b = dict(plain.named_parameters()), dict(wins.named_parameters())
    assert any(not torch.equal(a[k], b[k]) for k in a if b[k].requires_grad)
def _prune_batch(trained, n_prompts=8):
    """A rollout batch from a prune-2 engine (so the mismatch weights are not all one: prune-1 masks no token
    of this batch on some builds), with its advantages."""
    model = copy.deepcopy(trained["model"]).eval()
    cfg = RLConfig(**{**BASE, "engine": "prune-2", "minibatches": 1})
    engine = build_engine(model, trained["tok"], trained["prompts"], cfg)
    ids, _ = _encode(trained["tok"], trained["prompts"][:n_prompts], 256)
    ro = generate_rollouts(engine, trained["tok"], ids, 4, 8, 1.0, seed=3)
    adv = torch.randn(ro.num_rollouts, generator=torch.Generator().manual_seed(0))  # [N]
    return model, cfg, ro, adv


def test_reused_logp_old_gives_the_loss_and_gradient_of_the_separate_recompute(trained):
    """On-policy reuse: the update forward's detached log-probs as logp_old (and the weights from them) give the
    same loss and gradient as the separate no-grad eval-mode recompute, to float tolerance."""
    model, cfg, ro, adv = _prune_batch(trained)
    mask = ro.response_mask
    loss_fn = get_policy_loss("grpo")

    def weigh(lp):
        return mismatch_weights(lp, ro.logp_infer, mask, "token", "mask", cfg.icepop_low, cfg.icepop_high)[0]

    logp_sep, _, _ = logprobs_and_logits(model, ro)  # [N, T] eval mode, no grad
    w_sep = weigh(logp_sep)
    assert 0 < int((w_sep[mask] == 0).sum()) < int(mask.sum())  # some tokens masked: the weights matter
    model.train()
    loss_a, _ = minibatch_loss(model, ro, loss_fn, logp_sep, adv, w_sep, cfg)
    loss_a.backward()
    grad_a = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    seen = {}

    def old_fn(lp):
        seen["logp"] = lp
        return lp, weigh(lp)

    loss_b, _ = minibatch_loss(model, ro, loss_fn, None, adv, None, cfg, old_fn=old_fn)
    loss_b.backward()
    assert not seen["logp"].requires_grad
    torch.testing.assert_close(seen["logp"], logp_sep, rtol=1e-5, atol=1e-5)
    assert torch.equal(weigh(seen["logp"]) == 0, w_sep == 0)  # the same tokens masked
    torch.testing.assert_close(loss_b.detach(), loss_a.detach(), rtol=1e-5, atol=1e-6)
    grad_b = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grad_a.keys() == grad_b.keys() and grad_a
    for n in grad_a:
        torch.testing.assert_close(grad_b[n], grad_a[n], rtol=1e-4, atol=1e-6, msg=n)
    with pytest.raises(ValueError, match="logp_old and weights, or old_fn"):
        minibatch_loss(model, ro, loss_fn, None, adv, None, cfg)


@pytest.mark.parametrize("minibatches", [1, 2])
def test_run_grpo_reuse_matches_the_recompute_path(trained, minibatches):
    """One step with reuse on and off: the same rollouts, logp_old, weights, masked share, entropy and loss; with one
    minibatch no row is recomputed, with two the first half comes from the update forward."""
    kw = {"steps": 1, "engine": "prune-1", "minibatches": minibatches, "correction": "icepop"}
    _, on = _run(trained, **kw)
    _, off = _run(trained, reuse_logprobs=False, **kw)
    a, b = on.last_batch, off.last_batch
    assert torch.equal(a.rollouts.sequences, b.rollouts.sequences)
    torch.testing.assert_close(a.logp_old, b.logp_old, rtol=1e-5, atol=1e-5)
    assert torch.equal(a.weights == 0, b.weights == 0)
    torch.testing.assert_close(a.weights, b.weights, rtol=1e-4, atol=1e-6)
    m, p = on.steps[0], off.steps[0]
    assert m["logp_old_reused_frac"] == 1.0 / minibatches and p["logp_old_reused_frac"] == 0.0
    for k in ("masked_frac", "logp_diff_mean", "k3", "loss", "masked_entropy", "grad_norm"):
        assert m[k] == pytest.approx(p[k], rel=1e-4, abs=1e-6, nan_ok=True), k
    assert on.updates == off.updates == minibatches


def test_reuse_is_off_where_it_is_not_valid(trained):
    model = trained["model"]
    assert reuse_valid(RLConfig(), model)
    assert reuse_valid(RLConfig(ppo_epochs=3, minibatches=4), model)  # the first minibatch is still at theta_old
    assert not reuse_valid(RLConfig(reuse_logprobs=False), model)
    assert not reuse_valid(RLConfig(simulator=True), model)
    assert not reuse_valid(RLConfig(routing_replay=True), model)
    dropped = copy.deepcopy(model)
    dropped.model.layers[0].mlp.add_module("drop", torch.nn.Dropout(0.1))
    assert not reuse_valid(RLConfig(), dropped)
    _, res = _run(trained, steps=1, routing_replay=True, minibatches=1)
    assert res.steps[0]["logp_old_reused_frac"] == 0.0


def test_prune_calibration_leaves_out_answers_that_do_not_fit_and_never_refuses(trained):
    """The prune engine's calibration batch: an example whose answer does not fit is left out (no ``DataError``,
    which would tell the longest answer's length); with none fitting, the prompts alone calibrate."""
    import dataclasses

    model = copy.deepcopy(trained["model"]).eval()
    cfg = RLConfig(**{**BASE, "engine": "prune-2", "minibatches": 1})
    long = [dataclasses.replace(ex, messages=(*ex.messages[:-1], ("assistant", "x" * 2000)))
            for ex in trained["prompts"][:4]]
    mixed = build_engine(model, trained["tok"], long[:2] + trained["prompts"][:4], cfg)
    assert mixed.calibration[0]["input_ids"].shape[0] == 4  # the two long ones left out
    alone = build_engine(model, trained["tok"], long, cfg)
    batch = alone.calibration[0]
    assert batch["input_ids"].shape[0] == 4 and bool((batch["labels"] == -100).all())  # prompts only
