"""The ICEPOP seed's inference simulator (distmoe.rl.simulator) and its optional GRPO path: the ratio identities,
masking at the bound, detachment, the offset table on biased / pruned engines, the load-balance loss on simulated
routing, the degraded -> fallback rule on a noise-only engine, and simulator=False leaving GRPO unchanged."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from distmoe.config import ConfigError, RLConfig
from distmoe.model.build import router_modules
from distmoe.rl.engines import InferenceEngine
from distmoe.rl.grpo import _encode, build_engine, lb_mask, minibatch_loss, run_grpo
from distmoe.rl.losses import grpo_loss, mismatch_weights
from distmoe.rl.rollout import generate_rollouts, train_logprobs
from distmoe.rl.simulator import (
    InferenceSimulator,
    auroc,
    capture,
    compare,
    expert_usage,
    heldout_split,
    lb_loss_simulated,
    r2_score,
    simulated_weights,
)

BIAS_EXPERT, BIAS = 3, 2.0


@pytest.fixture(scope="module")
def env(train_small_lookup):
    t = train_small_lookup()
    model, tok, examples = t["model"], t["tok"], t["examples"]
    model.eval()
    ids, _ = _encode(tok, examples[:96], 256)
    return {"model": model, "tok": tok, "examples": examples, "ids": ids}


def _rollouts(env, engine, lo, hi, seed):
    return generate_rollouts(engine, env["tok"], env["ids"][lo:hi], 4, 8, 1.0, seed=seed)


def _noise_engine(model):
    """Pure numeric noise: iid N(0, 0.05^2) added to the engine's LM logits (routing untouched)."""
    eng = InferenceEngine(model, "exact")
    eng.model.get_output_embeddings().register_forward_hook(lambda _m, _i, out: out + 0.05 * torch.randn_like(out))
    return eng


def _bias_engine(model):
    """A known router bias: +BIAS on expert BIAS_EXPERT's logit in MoE layer 0 (re-routed like the router)."""
    eng = InferenceEngine(model, "exact")
    _, router = router_modules(eng.model)[0]
    k = int(model.config.num_experts_per_tok)

    def hook(mod, _inp, out):
        z = out[0].clone()
        z[:, BIAS_EXPERT] += BIAS
        v, i = torch.topk(torch.softmax(z, -1, dtype=torch.float), k, dim=-1)
        if getattr(mod, "norm_topk_prob", False):
            v = v / v.sum(-1, keepdim=True)
        return z, v.to(z.dtype), i

    router.register_forward_hook(hook)
    return eng


def _synthetic(seed=0, n=6, t=5):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, t, dtype=torch.bool)
    mask[0, 3:] = False
    mask[2, 1:] = False
    logp_infer = -torch.rand(n, t, generator=g) * 3
    adv = torch.randn(n, generator=g)
    return g, mask, logp_infer, adv


def test_zero_delta_gives_the_plain_ratio_and_the_mode_none_loss():
    g, mask, logp_infer, adv = _synthetic()
    logp_new = (logp_infer + 0.3 * torch.randn(logp_infer.shape, generator=g)).requires_grad_(True)
    old, w, st = simulated_weights(logp_infer, torch.zeros_like(logp_infer), mask, bound=0.5)
    assert torch.equal(w, mask.float()) and st["sim/masked_frac"] == 0.0
    assert torch.equal(old[mask], logp_infer[mask])
    w_none, _ = mismatch_weights(logp_infer, logp_infer, mask, "token", "none")
    loss_sim, m_sim = grpo_loss(logp_new, old, adv, mask, w)
    loss_none, m_none = grpo_loss(logp_new, logp_infer, adv, mask, w_none)
    assert torch.equal(loss_sim, loss_none) and m_sim == m_none


def test_exact_delta_with_theta_old_gives_ratio_one_synthetic_and_on_the_model(env):
    g, mask, logp_infer, _ = _synthetic(1)
    logp_train_old = logp_infer + 0.4 * (2 * torch.rand(logp_infer.shape, generator=g) - 1)  # |delta| <= 0.4
    delta = logp_train_old - logp_infer
    old, w, _ = simulated_weights(logp_infer, delta, mask, bound=0.5)
    assert torch.allclose(torch.exp(logp_train_old - old)[mask], torch.ones(int(mask.sum())), atol=1e-6, rtol=0)
    w_ice, _ = mismatch_weights(logp_train_old, logp_infer, mask, "token", "mask", math.exp(-0.5), math.exp(0.5))
    assert torch.allclose(w, w_ice, atol=1e-6)  # exact delta: IcePop with bounds exp(+-bound)
    # the real model, a pruned engine: exp(logp_new - logp_infer - delta) == 1 when theta == theta_old
    model = env["model"]
    eng = build_engine(model, env["tok"], env["examples"], RLConfig(engine="prune-1"))
    ro = _rollouts(env, eng, 0, 16, seed=3)
    delta = train_logprobs(model, ro) - ro.logp_infer
    old, _, _ = simulated_weights(ro.logp_infer, delta, ro.response_mask, bound=100.0)
    ratio = torch.exp(train_logprobs(model, ro) - old)[ro.response_mask]
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)


def test_tokens_beyond_the_bound_are_masked_not_clipped():
    mask = torch.tensor([[True, True, True, True, True, False]])
    d = torch.tensor([[0.3, 0.6, -0.7, -0.5, 0.5, 9.0]])
    old, w, st = simulated_weights(torch.zeros_like(d), d, mask, bound=0.5)
    expect = torch.tensor([[math.exp(0.3), 0.0, 0.0, math.exp(-0.5), math.exp(0.5), 0.0]])
    assert torch.allclose(w, expect, atol=1e-7) and st["sim/masked_frac"] == pytest.approx(2 / 5)
    assert torch.allclose(old[mask], d[mask])  # logp_old = logp_infer + delta_hat, delta_hat itself unclipped
    with pytest.raises(ValueError, match="bound"):
        simulated_weights(d, d, mask, bound=0.0)


def test_offset_table_shape_zero_table_routing_and_lb_loss():
    sim = InferenceSimulator(num_layers=2, num_experts=8, top_k=2)
    assert sim.offset.shape == (2, 8) and torch.equal(sim.offset, torch.zeros(2, 8))
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 4, 5, 8, generator=g)  # [L, N, T, E]
    assert torch.equal(sim.simulated_routes(z), torch.sort(torch.topk(z, 2, -1).indices, -1).values)
    # LB on simulated routing: == the ordinary aux loss for o = 0; == LB on the inference logits for a pure offset
    zt = tuple(torch.randn(12, 8, generator=g).requires_grad_(True) for _ in range(2))
    mask = torch.ones(3, 4, dtype=torch.long)
    mask[0, :2] = 0
    zero = torch.zeros(2, 8)
    assert torch.allclose(lb_loss_simulated(zt, zero, mask, 8, 2), load_balancing_loss_func(zt, 8, 2, mask))
    off = torch.randn(2, 8, generator=g)
    z_inf = tuple(z_l.detach() + off[li] for li, z_l in enumerate(zt))
    lb = lb_loss_simulated(zt, off, mask, 8, 2)
    assert torch.allclose(lb, load_balancing_loss_func(z_inf, 8, 2, mask), atol=1e-6)
    lb.backward()
    assert all(z_l.grad is not None and z_l.grad.abs().sum() > 0 for z_l in zt)  # differentiable through z_train
    with pytest.raises(ValueError, match="offset"):
        lb_loss_simulated(zt, torch.zeros(3, 8), mask, 8, 2)


def test_metrics_helpers():
    y = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert r2_score(y, y) == 1.0 and r2_score(torch.full_like(y, 1.5), y) == 0.0
    assert math.isnan(r2_score(y, torch.ones(4)))
    assert auroc(torch.tensor([0.1, 0.2, 0.9, 0.8]), torch.tensor([0, 0, 1, 1])) == 1.0
    assert auroc(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 1, 0])) == 0.5  # ties: average ranks
    assert math.isnan(auroc(torch.rand(3), torch.zeros(3)))
    m = compare(y[None], y[None], torch.ones(1, 4, dtype=torch.bool))
    assert m["r2"] == 1.0 and m["auroc"] == 1.0 and m["degraded"] == 0.0


def test_bias_engine_offset_recovered_and_predictions_detached(env):
    model = env["model"]
    eng = _bias_engine(model)
    sim = InferenceSimulator.for_model(model)
    sim.calibrate(model, eng, _rollouts(env, eng, 0, 48, seed=1))
    o = sim.offset
    assert o.shape == (2, 8)
    assert o[0, BIAS_EXPERT] == pytest.approx(BIAS, abs=1e-3)
    others = torch.cat([o[0, :BIAS_EXPERT], o[0, BIAS_EXPERT + 1:]])
    assert others.abs().max() < 1e-3
    # simulated routing agrees with the engine's routing better than the raw training routing does (layer 0)
    ro = _rollouts(env, eng, 48, 64, seed=2)
    tf, zi = capture(model, ro), capture(eng.model, ro, lm_logits=False).router
    v = ro.response_mask
    k = sim.top_k
    srt = lambda z: torch.sort(torch.topk(z, k, -1).indices, -1).values  # noqa: E731
    agree_train = (srt(tf.router[0]) == srt(zi[0])).all(-1)[v].float().mean()
    agree_sim = (sim.simulated_routes(tf.router)[0] == srt(zi[0])).all(-1)[v].float().mean()
    assert agree_train < 1.0 and agree_sim > agree_train and agree_sim > 0.99
    # delta_hat is detached: no graph, no grad to the simulator, the policy gets no grad from predict
    model.zero_grad(set_to_none=True)
    dh = sim.predict(model, ro)
    assert not dh.requires_grad and dh.grad_fn is None and dh.shape == ro.response.shape
    assert torch.equal(dh[~v], torch.zeros_like(dh[~v]))
    assert torch.equal(dh, sim.predict(model, ro, captured=tf))  # cached pass == fresh pass
    old, w, _ = simulated_weights(ro.logp_infer, dh, v, sim.bound)
    logp_new = train_logprobs(model, ro, grad=True)
    loss, _ = grpo_loss(logp_new, old, torch.randn(ro.num_rollouts), v, w)
    loss.backward()
    assert all(not p.requires_grad and p.grad is None for p in sim.mlp.parameters())
    assert not old.requires_grad and not w.requires_grad
    model.zero_grad(set_to_none=True)


def test_prune_engines_show_minus_30_and_fallback_fires_on_noise_only(env):
    model = env["model"]
    r2 = {}
    for profile in ("prune-1", "prune-2"):
        eng = build_engine(model, env["tok"], env["examples"], RLConfig(engine=profile))
        sim = InferenceSimulator.for_model(model)
        sim.calibrate(model, eng, _rollouts(env, eng, 0, 64, seed=1))
        pruned = eng.pruned  # [L, k]
        for li in range(pruned.shape[0]):
            kept = [e for e in range(8) if e not in pruned[li].tolist()]
            assert torch.all(sim.offset[li, pruned[li]] == -30.0)
            assert sim.offset[li, kept].min() > -29.0
        ro = _rollouts(env, eng, 64, 96, seed=2)
        m = compare(sim.predict(model, ro), train_logprobs(model, ro) - ro.logp_infer, ro.response_mask)
        r2[profile] = m["r2"]
        # measured R2 0.38-0.7 on one machine; for prune-1, 0.20 on another and -0.01 on a third (CPU kernels
        # and package versions change the tiny model's training and so its routing: there the one removed expert
        # is almost never chosen, mean |dlogp| 0.006, so R2 has no signal to explain); AUROC 0.72-0.93. The claim
        # is "predictive", far above the noise engine's: R2 where two experts are removed, AUROC on both
        assert m["auroc"] > 0.65, (profile, m)
        assert profile == "prune-1" or m["r2"] > 0.12, (profile, m)
    eng = _noise_engine(model)
    sim = InferenceSimulator.for_model(model)
    cal = sim.calibrate(model, eng, _rollouts(env, eng, 0, 64, seed=1))
    assert cal["r2"] < 0.05 and cal["degraded"] == 1.0 and sim.degraded  # noise: unpredictable -> fallback
    assert sim.offset.abs().max() == 0.0  # routing untouched
    assert min(r2.values()) > cal["r2"] + 0.12, (r2, cal)


GRPO = {"prompts_per_step": 8, "group_size": 4, "max_new_tokens": 6, "lr": 1e-3, "reward": "task", "steps": 2,
        "engine": "exact"}


def test_grpo_simulator_path(env):
    prompts = env["examples"][:32]
    # pruned engine: simulator on, metrics reported, delta_hat cached on the batch
    model = copy.deepcopy(env["model"])
    res = run_grpo(model, env["tok"], prompts, "lookup", RLConfig(**{**GRPO, "engine": "prune-1"}, simulator=True,
                                                                   simulator_recalibrate_every=1))
    assert len(res.steps) == 2 and res.updates == 4
    for m in res.steps:
        for key in ("sim_r2", "sim_auroc", "sim_fallback", "sim_masked_frac", "sim_cal_r2", "sim_predict_s"):
            assert key in m, key
        assert m["sim_fallback"] in (0.0, 1.0) and 0.0 <= m["sim_masked_frac"] <= 1.0
    assert res.sim_fallbacks == sum(int(m["sim_fallback"]) for m in res.steps)
    assert res.summary()["sim_fallbacks"] == float(res.sim_fallbacks)
    b = res.last_batch
    assert b.delta_hat is not None and not b.delta_hat.requires_grad
    if res.steps[-1]["sim_fallback"] == 0.0:
        old, w, _ = simulated_weights(b.rollouts.logp_infer, b.delta_hat, b.rollouts.response_mask, 0.5)
        assert torch.equal(b.weights, w) and torch.equal(b.logp_old_used, old)
    # exact engine: delta is ~1e-6 noise -> always degraded -> the fallback is today's path, bit for bit
    m_on, m_off = copy.deepcopy(env["model"]), copy.deepcopy(env["model"])
    on = run_grpo(m_on, env["tok"], prompts, "lookup", RLConfig(**GRPO, simulator=True, simulator_heldout_frac=0.0))
    off = run_grpo(m_off, env["tok"], prompts, "lookup", RLConfig(**GRPO, reuse_logprobs=False))
    assert on.sim_fallbacks == 2 and all(m["sim_fallback"] == 1.0 for m in on.steps)
    assert "sim_fallbacks" not in off.summary() and all("sim_r2" not in m for m in off.steps)
    assert off.last_batch.delta_hat is None and off.last_batch.logp_old_used is None
    assert torch.equal(on.last_batch.weights, off.last_batch.weights)
    assert all(torch.equal(p, q) for p, q in zip(m_on.parameters(), m_off.parameters(), strict=True))
    for a, c in zip(on.steps, off.steps, strict=True):
        assert a["loss"] == c["loss"] and a["reward"] == c["reward"]


def test_config_validation():
    for bad in ({"simulator": 1}, {"simulator_recalibrate_every": 0}, {"simulator_bound": 0.0}):
        with pytest.raises(ConfigError, match=f"'rl.{next(iter(bad)).replace('_', '-')}'"):
            RLConfig(**bad)


def test_sequence_level_simulated_weights():
    mask = torch.tensor([[True, True, True, False], [True, True, False, False], [True, True, True, True]])
    d = torch.tensor([[0.2, 0.4, -0.3, 7.0], [0.9, 0.5, -5.0, 0.0], [-0.1, 0.1, 0.0, 0.4]])
    logp_infer = -torch.ones_like(d)
    old, w, st = simulated_weights(logp_infer, d, mask, bound=0.5, level="sequence")
    seq = torch.tensor([0.1, 0.7, 0.1])  # mean delta_hat over each row's valid tokens (padding ignored)
    expect = torch.tensor([[math.exp(0.1)] * 3 + [0.0], [0.0] * 4, [math.exp(0.1)] * 4])  # row 1 masked whole
    assert torch.allclose(w, expect, atol=1e-6) and st["sim/masked_frac"] == pytest.approx(2 / 9)
    assert torch.allclose(old[mask], (logp_infer + d)[mask])  # logp_old stays per token at either level
    assert torch.equal(old[~mask], torch.zeros(int((~mask).sum())))
    # with the exact delta it is sequence-level IcePop at bounds exp(+-bound)
    w_ice, _ = mismatch_weights(logp_infer + d, logp_infer, mask, "sequence", "mask", math.exp(-0.5), math.exp(0.5))
    assert torch.allclose(w, w_ice, atol=1e-6)
    _, w_tok, _ = simulated_weights(logp_infer, d, mask, bound=0.5)
    assert not torch.equal(w_tok, w)
    assert float(seq[0]) == pytest.approx(float(d[0, :3].mean()))
    with pytest.raises(ValueError, match="level"):
        simulated_weights(logp_infer, d, mask, level="batch")


TRUSTED = {"r2_min": -1e9, "auroc_min": -1.0}  # run_grpo's simulator_fit: never degraded, no fallback


def test_grpo_simulator_sequence_level_uses_sequence_weights(env):
    model = copy.deepcopy(env["model"])
    res = run_grpo(model, env["tok"], env["examples"][:32], "lookup",
                   RLConfig(**{**GRPO, "steps": 1, "engine": "prune-1"}, correction_level="sequence", simulator=True),
                   simulator_fit=TRUSTED)
    assert res.sim_fallbacks == 0 and res.steps[0]["sim_fallback"] == 0.0
    b = res.last_batch
    v = b.rollouts.response_mask
    _, w, st = simulated_weights(b.rollouts.logp_infer, b.delta_hat, v, 0.5, "sequence")
    assert torch.equal(b.weights, w) and res.steps[0]["sim_masked_frac"] == st["sim/masked_frac"]
    for row, m in zip(b.weights, v, strict=True):  # one weight per sequence
        assert torch.unique(row[m]).numel() <= 1


def test_simulator_lb_coef_changes_the_gradient(env):
    model = copy.deepcopy(env["model"])
    eng = build_engine(model, env["tok"], env["examples"], RLConfig(engine="prune-1"))
    sim = InferenceSimulator.for_model(model)
    sim.calibrate(model, eng, _rollouts(env, eng, 0, 32, seed=1))
    ro = _rollouts(env, eng, 32, 40, seed=2)
    logp_old = train_logprobs(model, ro)  # [N, T]
    adv = torch.randn(ro.num_rollouts, generator=torch.Generator().manual_seed(0))
    w = ro.response_mask.float()
    router_w = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]

    def grads(coef, use_sim=True):
        model.zero_grad(set_to_none=True)
        cfg = RLConfig(simulator=True, simulator_lb_coef=coef)
        loss, lm = minibatch_loss(model, ro, grpo_loss, logp_old, adv, w, cfg, None, sim if use_sim else None)
        loss.backward()
        return [p.grad.clone() for p in router_w], lm

    g0, m0 = grads(0.0)
    g_plain, _ = grads(0.5, use_sim=False)  # no simulator passed (a fallback step): no LB term
    g1, m1 = grads(0.5)
    assert "sim_lb_loss" not in m0 and math.isfinite(m1["sim_lb_loss"]) and m1["sim_lb_loss"] > 0
    assert all(torch.equal(a, b) for a, b in zip(g0, g_plain, strict=True))
    assert any(not torch.allclose(a, b) for a, b in zip(g0, g1, strict=True))  # the coefficient changes the gradient
    # ... by exactly coef * d(lb_loss_simulated)/d(router) on the same forward
    model.zero_grad(set_to_none=True)
    _, router = train_logprobs(model, ro, grad=True, router_logits=True)
    lb = lb_loss_simulated(router, sim.offset, lb_mask(ro), sim.num_experts, sim.top_k)
    assert float(lb.detach()) == pytest.approx(m1["sim_lb_loss"], rel=1e-6)
    lb.backward()
    for a, b, p in zip(g0, g1, router_w, strict=True):
        assert torch.allclose(b - a, 0.5 * p.grad, atol=1e-6, rtol=1e-4)
    model.zero_grad(set_to_none=True)


def test_grpo_simulator_lb_coef_reaches_the_update(env):
    prompts = env["examples"][:32]
    cfg = {**GRPO, "steps": 1, "engine": "prune-1", "simulator": True}
    m0, m1 = copy.deepcopy(env["model"]), copy.deepcopy(env["model"])
    r0 = run_grpo(m0, env["tok"], prompts, "lookup", RLConfig(**cfg, simulator_lb_coef=0.0),
                  simulator_fit=TRUSTED)
    r1 = run_grpo(m1, env["tok"], prompts, "lookup", RLConfig(**cfg, simulator_lb_coef=1.0),
                  simulator_fit=TRUSTED)
    assert r0.sim_fallbacks == r1.sim_fallbacks == 0
    assert math.isnan(r0.steps[0]["sim_lb_loss"]) and r1.steps[0]["sim_lb_loss"] > 0
    gate = [n for n, _ in m0.named_parameters() if n.endswith("mlp.gate.weight")]
    p0, p1 = dict(m0.named_parameters()), dict(m1.named_parameters())
    assert any(not torch.equal(p0[n], p1[n]) for n in gate)
    with pytest.raises(ConfigError, match="rl.simulator-lb-coef"):
        RLConfig(simulator_lb_coef=-0.1)


def test_heldout_split_is_stratified_by_length_and_seeded():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randperm(120, generator=g).tolist()  # prompt i has length lengths[i]
    held = heldout_split(lengths, 0.05, seed=3)
    assert held == heldout_split(lengths, 0.05, seed=3) and held != heldout_split(lengths, 0.05, seed=4)
    assert len(held) == 6 and len(set(held)) == 6  # 2 of each 40-prompt third
    thirds = [sum(1 for i in held if lo <= lengths[i] < lo + 40) for lo in (0, 40, 80)]
    assert thirds == [2, 2, 2]  # short, medium and long prompts all held out
    assert heldout_split(lengths, 0.0) == [] and heldout_split([5, 6], 0.05) == []
    assert len(heldout_split(lengths[:10], 0.05)) == 3  # at least one per third
    with pytest.raises(ValueError, match="frac"):
        heldout_split(lengths, 1.0)


def test_simulated_weights_clip_option_clips_instead_of_masking():
    mask = torch.tensor([[True, True, True, False]])
    d = torch.tensor([[0.2, 0.9, -2.0, 5.0]])
    logp_infer = -torch.ones_like(d)
    old_m, w_m, st_m = simulated_weights(logp_infer, d, mask, bound=0.5)
    assert torch.equal(w_m[0, 1:3], torch.zeros(2)) and st_m["sim/masked_frac"] == pytest.approx(2 / 3)
    old, w, st = simulated_weights(logp_infer, d, mask, bound=0.5, clip=True)
    clamped = torch.tensor([0.2, 0.5, -0.5])
    torch.testing.assert_close(w[0, :3], torch.exp(clamped))
    torch.testing.assert_close(old[0, :3], -1.0 + clamped)
    assert w[0, 3] == 0.0 and st["sim/masked_frac"] == 0.0 and st["sim/clipped_frac"] == pytest.approx(2 / 3)
    assert st_m["sim/clipped_frac"] == 0.0


def test_calibration_buffer_accumulates_across_batches_and_is_bounded(env):
    model = env["model"]
    eng = _bias_engine(model)
    ro1, ro2 = _rollouts(env, eng, 0, 16, seed=1), _rollouts(env, eng, 16, 32, seed=2)
    single = InferenceSimulator.for_model(model)  # buffer_tokens=0: only the latest calibration
    single.calibrate(model, eng, ro1)
    n1 = single.last_metrics["fit_tokens"]
    single.calibrate(model, eng, ro2)
    n2 = single.last_metrics["fit_tokens"]
    big = InferenceSimulator.for_model(model, buffer_tokens=100_000)
    big.calibrate(model, eng, ro1)
    big.calibrate(model, eng, ro2)
    assert big.last_metrics["fit_tokens"] == n1 + n2 == big.buffered_tokens  # accumulated
    assert single.buffered_tokens == n2
    added = big.observe(capture(model, ro1), ro1)  # a trained-on batch: MLP data, no engine routers
    assert added == int(ro1.response_mask.sum()) and big.buffered_tokens == n1 + n2 + added
    assert big.buffer[-1].diff is None
    cap = int(n2) + 10
    small = InferenceSimulator.for_model(model, buffer_tokens=cap)
    small.calibrate(model, eng, ro1)
    small.calibrate(model, eng, ro2)
    assert small.buffered_tokens == cap  # bounded: the oldest batch is cut to its newest 10 tokens
    assert small.buffer[0].n == 10 and small.buffer[-1].n == n2
    assert small.offset[0, BIAS_EXPERT] == pytest.approx(BIAS, abs=1e-3)  # the table uses every buffered token
    with pytest.raises(ValueError, match="buffer_tokens"):
        InferenceSimulator.for_model(model, buffer_tokens=-1)


def test_incremental_refit_changes_only_the_last_layer_and_lowers_the_error(env):
    model = env["model"]
    eng = build_engine(model, env["tok"], env["examples"], RLConfig(engine="prune-1"))
    sim = InferenceSimulator.for_model(model, buffer_tokens=100_000, fit_steps=30)  # short fit: room to improve
    with pytest.raises(RuntimeError, match="before calibrate"):
        sim.refit_last()
    sim.calibrate(model, eng, _rollouts(env, eng, 0, 16, seed=1))
    ro = _rollouts(env, eng, 16, 48, seed=2)
    sim.observe(capture(model, ro), ro)
    first = [p.clone() for p in sim.mlp[0].parameters()]
    last = [p.clone() for p in sim.mlp[2].parameters()]
    m = sim.refit_last()
    assert m["mse_after"] < m["mse_before"] and m["tokens"] == sim.buffered_tokens and sim.refits == 1
    assert all(torch.equal(a, b) for a, b in zip(first, sim.mlp[0].parameters(), strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(last, sim.mlp[2].parameters(), strict=True))
    assert all(not p.requires_grad for p in sim.mlp.parameters())


def test_route_shift_measures_the_policys_drift_on_the_last_fits_own_tokens(env):
    """The shift compares the policy's top-k usage with the fit's on the same calibration tokens: 0 for an unchanged
    policy (a usage taken on another batch's tokens differs by sampling alone, which fired the trigger on ~99 % of
    a long run's steps), and large once the router ranks the experts the other way round."""
    model = copy.deepcopy(env["model"])
    eng = _bias_engine(model)
    sim = InferenceSimulator.for_model(model)
    assert math.isnan(sim.route_shift(model))  # no fit yet
    ro = _rollouts(env, eng, 0, 16, seed=1)
    sim.calibrate(model, eng, ro)
    tf = capture(model, ro)
    u = expert_usage(tf.router, ro.response_mask, sim.top_k)  # [L, E]
    torch.testing.assert_close(u.sum(-1), torch.ones(2))
    assert sim.route_shift(model) == 0.0  # the same policy on the fit's tokens: no shift at all
    other = _rollouts(env, eng, 0, 16, seed=2)  # the same prompts sampled again: usage differs by sampling alone
    noise = 0.5 * (expert_usage(capture(model, other).router, other.response_mask, sim.top_k)
                   - sim.usage_fit).abs().sum(-1).mean()
    assert noise > 0.02
    with torch.no_grad():
        for _, gate in router_modules(model):
            gate.weight.neg_()  # every token's expert ranking reversed: the top-k picks move
    assert sim.route_shift(model) > 0.2


def test_heldout_error_trigger_sees_the_policys_drift_not_a_fresh_sample(env):
    """Between full fits the held-out error is measured on the held-out rollouts drawn at the last fit, re-scored
    by the current engine and policy: with a policy that does not move (a learning rate of 1e-12) and no
    incremental refit, the error does not move either. Drawn afresh each step (before 2026-12-03) it moved by
    sampling alone and fired the trigger on steps where nothing had changed."""
    cfg = {**GRPO, "engine": "prune-1", "steps": 3, "simulator": True, "simulator_recalibrate_every": 100,
           "simulator_incremental": False, "simulator_route_shift": 1.0, "simulator_error_shift": 1e9, "lr": 1e-12}
    res = run_grpo(copy.deepcopy(env["model"]), env["tok"], env["examples"][:40], "lookup", RLConfig(**cfg))
    assert [m["sim_full_fit"] for m in res.steps] == [1.0, 0.0, 0.0]
    fit_err = res.steps[0]["sim_heldout_abs_err"]
    assert fit_err > 0
    for m in res.steps[1:]:
        assert abs(m["sim_err_shift"]) < 1e-6, m["sim_err_shift"]
        assert m["sim_heldout_abs_err"] == pytest.approx(fit_err, rel=1e-6)


def test_grpo_simulator_heldout_triggers_and_trust_counts(env):
    prompts = env["examples"][:40]
    cfg = {**GRPO, "engine": "prune-1", "steps": 3, "simulator": True, "simulator_recalibrate_every": 100,
           "simulator_buffer_tokens": 4096}
    eager = run_grpo(copy.deepcopy(env["model"]), env["tok"], prompts, "lookup",
                     RLConfig(**cfg, simulator_error_shift=1e-9,  # any held-out error rise triggers a full fit,
                              simulator_route_shift=1e-9))  # and so does any move of the policy's routing
    calm = run_grpo(copy.deepcopy(env["model"]), env["tok"], prompts, "lookup",
                    RLConfig(**cfg, simulator_route_shift=1.0, simulator_error_shift=1e9))
    for res in (eager, calm):
        held = set(res.sim_heldout)
        assert len(held) == 3  # 5% of 40, at least one per length third
        assert not held & set(res.last_batch.prompt_ids)
        assert res.sim_trusted + res.sim_fallbacks == 3
        s = res.summary()
        assert s["sim_trusted_steps"] == res.sim_trusted and s["sim_trusted"] == pytest.approx(res.sim_trusted / 3)
        assert res.steps[0]["sim_full_fit"] == 1.0 and res.steps[0]["sim_recal_triggered"] == 0.0
        for m in res.steps:
            assert math.isfinite(m["sim_heldout_abs_err"])
            assert m["sim_buffer_tokens"] <= 4096 and "sim_refit_mse" in m
    assert [m["sim_recal_triggered"] for m in eager.steps] == [0.0, 1.0, 1.0]
    assert math.isnan(eager.steps[0]["sim_route_shift"]) and all(m["sim_route_shift"] > 0 for m in eager.steps[1:])
    for m in eager.steps[1:]:  # the rule: either shift beyond its threshold (whether the error rose depends on the
        assert m["sim_recal_triggered"] == float(m["sim_route_shift"] > 1e-9 or m["sim_err_shift"] > 1e-9)  # data)
    assert all(math.isfinite(m["sim_route_shift"]) and math.isfinite(m["sim_err_shift"]) for m in calm.steps[1:])
    assert [m["sim_full_fit"] for m in eager.steps] == [1.0, 1.0, 1.0] and eager.sim_recal_triggered == 2
    assert [m["sim_full_fit"] for m in calm.steps] == [1.0, 0.0, 0.0] and calm.sim_recal_triggered == 0
    assert calm.steps[2]["sim_buffer_tokens"] > calm.steps[0]["sim_buffer_tokens"]  # batches accumulate
    # fewer prompts left than rl.prompts-per-step after the hold-out: drawn with replacement, never refused (a
    # refusal would tell the coordinator the party's prompt count)
    few = run_grpo(copy.deepcopy(env["model"]), env["tok"], prompts[:8], "lookup", RLConfig(**{**cfg, "steps": 1}))
    assert len(few.steps) == 1 and not set(few.sim_heldout) & set(few.last_batch.prompt_ids)


def test_the_simulator_refuses_a_sigmoid_router(tmp_path):
    """Its route-offset table models a softmax top-k of z + o, not DeepSeek-V3's group-limited sigmoid choice."""
    from distmoe.model.build import load_checkpoint
    from distmoe.model.fabricate import write_checkpoint
    from distmoe.rl.simulator import InferenceSimulator

    model, _ = load_checkpoint(write_checkpoint("deepseek_v3", tmp_path / "v3"))
    with pytest.raises(ValueError, match="'deepseek_v3' router is a sigmoid.*rl.simulator = false"):
        InferenceSimulator.for_model(model)
