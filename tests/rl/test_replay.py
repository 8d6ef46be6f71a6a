"""Routing replay (distmoe.rl.replay) on a briefly SFT-trained small MoE: the engine's routes are recorded during
``generate``, the trainer's forward then uses exactly those experts (a pruned expert is never selected), the
weights are the trainer's softmax renormalised over them, gradients flow, an exact engine makes replay a no-op,
and the GRPO loop reports it."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from distmoe.config import ConfigError, RLConfig
from distmoe.model.build import router_modules
from distmoe.rl.grpo import _encode, build_engine, run_grpo
from distmoe.rl.replay import UNRECORDED, replay_routes, replay_weights
from distmoe.rl.rollout import _record_routes, generate_rollouts, train_logprobs


@pytest.fixture(scope="module")
def env(train_small_lookup):
    t = train_small_lookup()
    model, tok, examples = t["model"], t["tok"], t["examples"]
    model.eval()
    ids, _ = _encode(tok, examples[:32], 256)
    return {"model": model, "tok": tok, "examples": examples, "ids": ids}


def _engine(env, profile):
    return build_engine(env["model"], env["tok"], env["examples"], RLConfig(engine=profile))


def _rollouts(env, engine, n=16, seed=1, record=True):
    return generate_rollouts(engine, env["tok"], env["ids"][:n], 4, 8, 1.0, seed=seed, record_routes=record)


def _experts_used(model, fn):
    """Run ``fn()``; per MoE layer the expert indices the experts module received ``[rows, k]``."""
    got = {}
    handles = []
    for li, (name, _) in enumerate(router_modules(model)):
        experts = model.get_submodule(name.rsplit(".", 1)[0] + ".experts")
        handles.append(experts.register_forward_pre_hook(lambda _m, args, li=li: got.__setitem__(li, args[1].clone())))
    try:
        fn()
    finally:
        for h in handles:
            h.remove()
    return got


@pytest.mark.parametrize("profile", ["exact", "prune-1"])
def test_recording_during_generate_equals_the_engines_own_routing(env, profile):
    eng = _engine(env, profile)
    ro = _rollouts(env, eng)
    r = ro.engine_routes  # [L, N, S, k]
    n, s = ro.sequences.shape
    assert r.shape == (2, n, s, 2) and r.dtype == torch.long
    recorded = (r >= 0).all(-1)  # [L, N, S]
    assert recorded[:, :, :-1].all() and (r[:, :, -1] == UNRECORDED).all()  # only the last position is unrouted
    tf = torch.stack(_record_routes(eng.model, ro))  # [L, N, S, k] teacher-forced engine routing
    same = (torch.sort(r, -1).values == torch.sort(tf, -1).values).all(-1)[:, :, :-1]
    assert same.float().mean() > 0.999  # KV-cache decode vs teacher forcing: ~1e-6, near-ties at most
    # recording changes nothing: same samples and log-probs as without it
    plain = _rollouts(env, eng, record=False)
    assert plain.engine_routes is None
    assert torch.equal(plain.sequences, ro.sequences) and torch.equal(plain.logp_infer, ro.logp_infer)


def test_prune_replay_selects_exactly_the_recorded_experts_never_a_pruned_one(env):
    # prune-2: with one expert removed, the tiny model's mismatch is within float noise on some builds
    model = env["model"]
    eng = _engine(env, "prune-2")
    ro = _rollouts(env, eng)
    n, s = ro.sequences.shape
    own = _experts_used(model, lambda: train_logprobs(model, ro))
    rep = _experts_used(model, lambda: train_logprobs(model, ro, replay=True))
    for li in range(2):
        pruned = eng.pruned[li]  # [2]
        rec = ro.engine_routes[li].reshape(n * s, -1)  # [rows, k]
        used = rep[li].reshape(n, s, -1)[:, :-1].reshape(-1, 2)  # [rows without the last position, k]
        assert torch.equal(used, rec.reshape(n, s, -1)[:, :-1].reshape(-1, 2))
        assert not torch.isin(used, pruned).any()
        assert torch.isin(own[li], pruned).any()  # the trainer's own routing does pick them: replay removes them
    # with replay the trainer computes what the pruned engine computed (pruning only changes the routing)
    m = ro.response_mask
    d_own = (train_logprobs(model, ro) - ro.logp_infer)[m].abs().mean()
    d_rep = (train_logprobs(model, ro, replay=True) - ro.logp_infer)[m].abs().mean()
    assert d_own > 1e-2 and d_rep < 1e-4


def test_replay_weights_are_the_train_softmax_renormalised_over_the_replayed_experts():
    z = torch.tensor([[2.0, 0.0, -1.0, 1.0], [0.5, 0.5, 3.0, -2.0]], requires_grad=True)  # [rows, E]
    idx = torch.tensor([[2, 1], [3, 0]])  # [rows, k]: deliberately not the top-k of z
    w = replay_weights(z, idx, norm_topk_prob=True)
    e = z.detach().exp()
    expect = torch.stack([e[0, [2, 1]] / e[0, [2, 1]].sum(), e[1, [3, 0]] / e[1, [3, 0]].sum()])
    assert torch.allclose(w, expect, atol=1e-6) and torch.allclose(w.sum(-1), torch.ones(2))
    raw = replay_weights(z, idx, norm_topk_prob=False)
    assert torch.allclose(raw, torch.softmax(z.detach(), -1).gather(-1, idx), atol=1e-7)
    w[:, 0].sum().backward()
    assert z.grad is not None and z.grad.abs().sum() > 0  # differentiable in the router logits
    # on its own top-k it is exactly the HF router's weights
    top = torch.topk(torch.softmax(z.detach(), -1), 2, -1)
    assert torch.allclose(replay_weights(z.detach(), top.indices, True), top.values / top.values.sum(-1, keepdim=True))


def test_replay_gradients_reach_router_and_experts(env):
    model = copy.deepcopy(env["model"])
    eng = _engine(env, "prune-1")
    ro = _rollouts(env, eng, n=8)
    model.zero_grad(set_to_none=True)
    logp = train_logprobs(model, ro, grad=True, replay=True)
    (-(logp * ro.response_mask).sum()).backward()
    params = dict(model.named_parameters())
    for name, _ in router_modules(model):
        g = params[f"{name}.weight"].grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
        gu = params[name.rsplit(".", 1)[0] + ".experts.gate_up_proj"].grad
        assert gu is not None and gu.abs().sum() > 0
    with pytest.raises(ValueError, match="record_routes"):
        train_logprobs(model, _rollouts(env, eng, n=2, record=False), replay=True)
    with pytest.raises(ValueError, match="rows"), replay_routes(model, ro.engine_routes[:, :2]):
        train_logprobs(model, ro)


def test_exact_engine_replay_changes_nothing(env):
    model = env["model"]
    ro = _rollouts(env, _engine(env, "exact"))
    m = ro.response_mask
    a, b = train_logprobs(model, ro), train_logprobs(model, ro, replay=True)
    assert torch.allclose(a[m], b[m], atol=1e-5, rtol=0)
    # one update at theta = theta_old (one minibatch, one epoch): the replayed routes are the trainer's own.
    # (With several minibatches the routes stay frozen at the rollout's theta_old choice while theta moves, as R3
    # intends, so later minibatches may differ on near-tie tokens even with an exact engine.)
    cfg = {"prompts_per_step": 8, "group_size": 4, "max_new_tokens": 6, "lr": 1e-3, "steps": 1, "engine": "exact",
           "minibatches": 1}
    m_on, m_off = copy.deepcopy(model), copy.deepcopy(model)
    on = run_grpo(m_on, env["tok"], env["examples"][:32], "lookup", RLConfig(**cfg, routing_replay=True))
    off = run_grpo(m_off, env["tok"], env["examples"][:32], "lookup", RLConfig(**cfg))
    x, y = on.steps[0], off.steps[0]
    assert x["replay"] == 1.0 and x["replay_override_frac"] < 1e-3 and "replay" not in y
    assert x["reward"] == y["reward"]  # the same rollouts
    assert x["logp_diff_mean"] == pytest.approx(y["logp_diff_mean"], abs=1e-6)
    assert x["loss"] == pytest.approx(y["loss"], abs=1e-6)
    vm = on.last_batch.rollouts.response_mask
    assert torch.allclose(on.last_batch.logp_old[vm], off.last_batch.logp_old[vm], atol=1e-5, rtol=0)
    for p, q in zip(m_on.parameters(), m_off.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-5)


def test_grpo_with_replay_on_prune_1_reports_and_removes_the_mismatch(env):
    cfg = {"prompts_per_step": 32, "group_size": 4, "max_new_tokens": 8, "lr": 1e-3, "steps": 1,
           "engine": "prune-1", "correction": "icepop"}
    model = copy.deepcopy(env["model"])
    res = run_grpo(model, env["tok"], env["examples"][:32], "lookup", RLConfig(**cfg, routing_replay=True))
    base = run_grpo(copy.deepcopy(env["model"]), env["tok"], env["examples"][:32], "lookup", RLConfig(**cfg))
    m, b = res.steps[0], base.steps[0]
    assert res.updates == 2 and res.skipped_steps == 0
    assert m["replay"] == 1.0 and 0.0 < m["replay_override_frac"] <= 1.0
    assert m["logp_diff_mean_native"] == pytest.approx(b["logp_diff_mean"], rel=1e-5)  # same rollouts, own routing
    assert m["logp_diff_mean"] < 1e-4 < b["logp_diff_mean"]  # k = pi_train_replayed(theta_old) / pi_infer ~ 1
    assert m["masked_frac"] == 0.0 and b["masked_frac"] > 0.0
    assert max(m["route_disagree_l0"], m["route_disagree_l1"]) > 0  # the native gap is still reported
    lb = res.last_batch
    assert lb.rollouts.engine_routes is not None and lb.rollouts.engine_routes.shape[1] == lb.rollouts.num_rollouts
    assert math.isfinite(m["loss"]) and m["grad_norm"] > 0


def test_replay_config_validation():
    with pytest.raises(ConfigError, match="rl.routing-replay"):
        RLConfig(routing_replay=1)
    with pytest.raises(ConfigError, match="rl.routing-replay.*rl.simulator"):
        RLConfig(routing_replay=True, simulator=True)
    for correction in ("icepop", "tis", "none"):  # compatible with every correction
        assert RLConfig(routing_replay=True, correction=correction).routing_replay


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_replay_on_a_sigmoid_router_uses_the_familys_own_weighting(family, tmp_path):
    """DeepSeek-V3 / GLM-4.5: the trainer replays a prune-1 engine's recorded experts, weighted by the family's own rule
    (``sigmoid(z)[I]`` renormalised, times ``routed_scaling_factor``, never a softmax), and replaying an exact
    engine's routes gives the family router's own output."""
    from distmoe.model.build import load_checkpoint
    from distmoe.model.fabricate import write_checkpoint
    from distmoe.rl.engines import InferenceEngine

    model, tok = load_checkpoint(write_checkpoint(family, tmp_path / "ckpt", seed=6))
    model.eval()
    prompts = [tok.encode(t) for t in ("Compute\n3+4", "Reverse\nabc", "Look up k7", "What is 2+2")]
    usage = torch.arange(8, dtype=torch.float).repeat(len(router_modules(model)), 1)  # [L, E]: expert 0 dropped
    pruned = InferenceEngine(model, "prune-1", usage=usage)
    ro = generate_rollouts(pruned, tok, prompts, 2, 4, 1.0, seed=1, record_routes=True)
    rec = ro.engine_routes  # [L, N, S, k]
    assert rec is not None and not (rec == 0).any()  # the engine never used the dropped expert

    got_w, got_z = {}, {}
    handles = []
    for li, (name, router) in enumerate(router_modules(model)):
        experts = model.get_submodule(name.rsplit(".", 1)[0] + ".experts")
        handles.append(experts.register_forward_pre_hook(
            lambda _m, args, li=li: got_w.__setitem__(li, (args[1].clone(), args[2].detach().clone()))))
        handles.append(router.register_forward_hook(lambda _m, _i, out, li=li: got_z.__setitem__(li, out[0].detach())))
    try:
        train_logprobs(model, ro, replay=True)
    finally:
        for h in handles:
            h.remove()
    scale = float(model.config.routed_scaling_factor)
    for li in got_w:
        idx, w = got_w[li]  # what the experts module received under replay
        flat = rec[li].reshape(-1, rec.shape[-1])  # [rows, k]
        done = (flat >= 0).all(-1)
        assert torch.equal(idx[done], flat[done])
        a = torch.sigmoid(got_z[li]).gather(-1, idx)  # [rows, k] the trainer's own affinities of the replayed experts
        torch.testing.assert_close(w, a / (a.sum(-1, keepdim=True) + 1e-20) * scale)
        assert not torch.allclose(w, torch.softmax(got_z[li], -1).gather(-1, idx) * scale)

    exact = generate_rollouts(InferenceEngine(model, "exact"), tok, prompts, 2, 4, 1.0, seed=1, record_routes=True)
    m = exact.response_mask
    torch.testing.assert_close(train_logprobs(model, exact, replay=True)[m], train_logprobs(model, exact)[m],
                               rtol=0, atol=1e-6)
