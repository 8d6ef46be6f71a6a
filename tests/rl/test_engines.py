"""Inference engines, rollouts and rewards for local RL: genuine train/inference mismatch on a briefly
trained tiny MoE (random init misleads: ``docs/algorithms.md``, inference engine profiles)."""

from __future__ import annotations

import copy

import pytest
import torch

from distmoe.data.template import collate, encode_prompt
from distmoe.model.device import base_dtype
from distmoe.rl.engines import InferenceEngine, expert_tensor_names, fake_quant_channels_, measure_usage, parse_profile
from distmoe.rl.rewards import REWARDS, compute_rewards, get_reward
from distmoe.rl.rollout import (
    _record_routes,
    generate_rollouts,
    response_mask_from_tokens,
    routing_disagreement,
    train_logprobs,
)

ALPHA, BETA = 0.5, 5.0


@pytest.fixture(scope="module")
def trained(train_small_lookup):
    """The small model after 150 SFT steps on synthetic lookup data (~5 s), prompts and calibration."""
    t = train_small_lookup()
    cfg, model, tok, examples, encoded = t["cfg"], t["model"], t["tok"], t["examples"], t["encoded"]
    prompts = [encode_prompt(tok, ex, cfg.model.max_seq_len) for ex in examples[:32]]
    calibration = [collate(encoded[:64], tok.pad_token_id)]
    return {"model": model, "tok": tok, "prompts": prompts, "calibration": calibration,
            "usage": measure_usage(model, calibration)}


def _mismatch(trained, engine, seed=0, prompts=None, group_size=4):
    ro = generate_rollouts(engine, trained["tok"], prompts or trained["prompts"], group_size, 8, 1.0, seed)
    delta = (train_logprobs(trained["model"], ro) - ro.logp_infer)[ro.response_mask]  # [n valid]
    k = delta.exp()
    return ro, delta, float(((k < ALPHA) | (k > BETA)).float().mean())


def test_exact_engine_matches_training_numerics(trained):
    engine = InferenceEngine(trained["model"], "exact")
    ro, delta, masked = _mismatch(trained, engine)
    assert delta.abs().max() < 1e-4 and masked == 0.0
    assert ro.logp_infer.dtype == torch.float32 and ro.logp_infer.shape == ro.response.shape
    assert ro.sequences.shape == (len(trained["prompts"]) * 4, ro.prompt_len + ro.response.shape[1])
    assert routing_disagreement(trained["model"], engine, ro) == [0.0, 0.0]
    assert engine.model is not trained["model"]


def test_prune_engine_creates_masked_tokens_and_routing_disagreement(trained):
    before = {n: p.clone() for n, p in trained["model"].state_dict().items()}
    engine = InferenceEngine(trained["model"], "prune-1", calibration=trained["calibration"])
    assert torch.equal(engine.usage, trained["usage"]) and engine.pruned.shape == (2, 1)
    ro, delta, _ = _mismatch(trained, engine)
    assert delta.abs().mean() > 1e-3  # removing one expert per layer shifts the log-probs (0.006-0.11 measured)
    assert max(routing_disagreement(trained["model"], engine, ro)) > 0.0
    for li, routes in enumerate(_record_routes(engine.model, ro)):  # [N, P+T, k]
        assert not torch.isin(routes, engine.pruned[li]).any()  # pruned experts are never chosen
    after = trained["model"].state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)  # the policy is untouched
    # Whether prune-1 leaves any ratio outside IcePop's [0.5, 5] depends on the trained weights (0.0-4.7 % of
    # ~500 tokens measured across thread counts and package versions); removing two experts per layer does
    # (3.2-11.4 % measured), so the masking claim is checked there.
    _, _, masked = _mismatch(trained, InferenceEngine(trained["model"], "prune-2", calibration=trained["calibration"]))
    assert masked > 0.0


def test_bf16_and_int8_give_small_nonzero_mismatch(trained):
    for profile in ("bf16", "int8-dynamic", "int8-weight-only"):
        engine = InferenceEngine(trained["model"], profile)
        _, delta, masked = _mismatch(trained, engine)  # ~516 tokens (16 prompts x 2 read 0.024 masked on bf16)
        assert 0.0 < float(delta.abs().mean()) < 0.05, profile
        assert masked < 0.02, profile
    view = InferenceEngine(trained["model"], "bf16+prune-1", usage=trained["usage"]).model
    assert base_dtype(view) == torch.bfloat16  # computes in bf16 (cast on the fly) over the policy's fp32 tensors
    assert next(view.parameters()).dtype == torch.float32
    copied = InferenceEngine(trained["model"], "bf16+prune-1", usage=trained["usage"], share_weights=False).model
    assert next(copied.parameters()).dtype == torch.bfloat16


def test_sync_after_policy_update_restores_exact_match(trained):
    """A deep-copy engine is stale until ``sync``; a view reads the policy's updated tensors at once."""
    policy = copy.deepcopy(trained["model"])
    copied, view = InferenceEngine(policy, "exact", share_weights=False), InferenceEngine(policy, "exact")
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    prompts = trained["prompts"][:8]

    def gap(engine):
        ro = generate_rollouts(engine, trained["tok"], prompts, 2, 6, 1.0, seed=1)
        return (train_logprobs(policy, ro) - ro.logp_infer)[ro.response_mask].abs().max()

    stale, current = gap(copied), gap(view)
    copied.sync(policy)
    assert stale > 1e-2 and gap(copied) < 1e-4 and current < 1e-4


def test_response_mask_stops_after_eos(trained):
    eos = 5
    toks = torch.tensor([[7, 8, eos, 0, 0], [eos, 0, 0, 0, 0], [7, 7, 7, 7, 7]])  # [3, 5]
    mask = response_mask_from_tokens(toks, eos)
    assert mask.tolist() == [[True, True, True, False, False], [True, False, False, False, False], [True] * 5]
    tok = trained["tok"]
    ro = generate_rollouts(InferenceEngine(trained["model"], "exact"), tok, trained["prompts"][:8], 2, 8, 1.0, 0)
    for row, m in zip(ro.response, ro.response_mask, strict=True):
        hits = (row == tok.eos_token_id).nonzero().flatten().tolist()
        if hits:
            assert m[: hits[0] + 1].all() and not m[hits[0] + 1:].any()
            assert (row[hits[0] + 1:] == tok.pad_token_id).all()
        else:
            assert m.all()
    assert (ro.logp_infer[~ro.response_mask] == 0).all()
    assert any(t for t in ro.texts) and all("<|end|>" not in t for t in ro.texts)


def test_rollouts_reproducible_for_fixed_seed(trained):
    engine = InferenceEngine(trained["model"], "exact")
    prompts = trained["prompts"][:8]
    a = generate_rollouts(engine, trained["tok"], prompts, 4, 8, 1.5, seed=3)
    b = generate_rollouts(engine, trained["tok"], prompts, 4, 8, 1.5, seed=3)
    c = generate_rollouts(engine, trained["tok"], prompts, 4, 8, 1.5, seed=4)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.logp_infer, b.logp_infer)
    assert not torch.equal(a.sequences, c.sequences)
    assert a.prompt_index.tolist() == [i for i in range(8) for _ in range(4)]


def test_rewards_on_hand_examples():
    assert get_reward("exact_match")(" ABC\n", "ABC") == 1.0
    assert get_reward("exact_match")("ABD", "ABC") == 0.0
    assert get_reward("numeric")("12.0", "12") == 1.0 and get_reward("numeric")("13", "12") == 0.0
    assert get_reward("numeric")("twelve", "12") == 0.0
    fmt = get_reward("format")
    assert fmt("ABC", task="lookup") == 1.0 and fmt("AB C", task="lookup") == 0.0
    assert fmt("ABC\n", task="lookup") == 0.0 and fmt("", task="lookup") == 0.0
    assert fmt("-3", task="arith") == 1.0 and fmt("3 ", task="arith") == 0.0 and fmt("x", task="other") == 1.0
    task = get_reward("task")
    assert task("7", "7.0", task="arith") == 1.0 and task("olleh", "olleh", task="strings") == 1.0
    assert task("XYZ", "ABC", task="lookup") == 0.0
    assert compute_rewards("task", ["ABC", "ABD"], ["ABC", "ABC"], "lookup") == [1.0, 0.0]


def test_unknown_names_error_with_valid_list(trained):
    with pytest.raises(ValueError, match="exact_match, format, numeric, task"):
        get_reward("nope")
    assert set(REWARDS) == {"exact_match", "numeric", "format", "task"}
    for bad in ("fp8", "exact+bf16", "bf16+int8-dynamic", "prune-x", "prune-0"):
        with pytest.raises(ValueError, match="valid profiles: exact, bf16, int8-dynamic, int8-weight-only, prune-k"):
            parse_profile(bad)
    with pytest.raises(ValueError, match="fp8"):
        InferenceEngine(trained["model"], "fp8")
    with pytest.raises(ValueError, match="usage table"):
        InferenceEngine(trained["model"], "prune-1")
    with pytest.raises(ValueError, match="fewer than top_k"):
        InferenceEngine(trained["model"], "prune-7", usage=trained["usage"])
    assert parse_profile("bf16+prune-2") == {"bf16": True, "int8_dynamic": False, "int8_wo": False, "prune": 2,
                                             "expert_bits": 0, "expert_group": 0}


def test_fake_quant_channels_puts_each_output_channel_on_its_own_symmetric_grid():
    torch.manual_seed(0)
    w = torch.randn(3, 5, 64)  # [E, out, in]
    q = w.clone()
    fake_quant_channels_(q, 4)
    scale = w.abs().amax(-1, keepdim=True) / 7  # s = max_i |W[e, o, i]| / (2^(4-1) - 1)
    codes = q / scale  # [E, out, in]
    assert torch.allclose(codes, codes.round(), atol=1e-4) and codes.abs().max() <= 7 + 1e-4
    assert torch.allclose(q, (w / scale).round().clamp(-7, 7) * scale)
    assert ((q - w).abs() <= scale / 2 + 1e-6).all()  # rounding error at most half a step per channel
    g = w.clone()
    fake_quant_channels_(g, 2, group=16)  # 2 bits: q = 1, values {-s, 0, s} per group of 16 columns
    per_group = g.reshape(3, 5, 4, 16)
    assert all(len(set(row.abs().unique().round(decimals=6).tolist()) - {0.0}) <= 1
               for row in per_group.reshape(-1, 16))
    with pytest.raises(ValueError, match="group size 5 does not divide the input dim 64"):
        fake_quant_channels_(w.clone(), 4, group=5)


def test_expert_quant_engine_changes_logprobs_keeps_routes_and_the_router_exact(trained):
    model = trained["model"]
    engine = InferenceEngine(model, "int2g32-experts")  # a view: the experts fake-quantised on the fly
    copied = InferenceEngine(model, "int2g32-experts", share_weights=False)  # the same applied to a deep copy
    names = expert_tensor_names(model)
    assert names and all(".experts." in n for n in names)
    mp, ep = dict(model.named_parameters()), dict(copied.model.named_parameters())
    changed = {n for n in mp if not torch.equal(mp[n], ep[n])}
    assert changed == set(names)  # the experts only: router, attention, embeddings and lm_head exact
    ro, delta, _ = _mismatch(trained, engine)
    assert float(delta.abs().mean()) > 1e-3  # the log-probs move on the tokens
    assert max(routing_disagreement(model, engine, ro)) < 0.15  # most routes are kept (router untouched)
    ro_copy = generate_rollouts(copied, trained["tok"], trained["prompts"], 4, 8, 1.0, 0)
    assert torch.equal(ro.sequences, ro_copy.sequences)  # the view samples what the quantised copy samples
    assert torch.allclose(ro.logp_infer, ro_copy.logp_infer, atol=1e-5)
    again = InferenceEngine(model, "int2g32-experts", share_weights=False)  # deterministic: the same weights
    assert all(torch.equal(ep[n], dict(again.model.named_parameters())[n]) for n in names)
    again = InferenceEngine(model, "int2g32-experts")  # and the same samples
    ro2 = generate_rollouts(again, trained["tok"], trained["prompts"], 4, 8, 1.0, 0)
    assert torch.equal(ro.sequences, ro2.sequences) and torch.equal(ro.logp_infer, ro2.logp_infer)
    mild = InferenceEngine(model, "int6-experts")  # more bits, less mismatch
    assert float(_mismatch(trained, mild)[1].abs().mean()) < float(delta.abs().mean())


def test_expert_quant_profile_grammar():
    assert parse_profile("int4-experts")["expert_bits"] == 4 and parse_profile("int4-experts")["expert_group"] == 0
    assert parse_profile("bf16+int3g32-experts") == {"bf16": True, "int8_dynamic": False, "int8_wo": False,
                                                     "prune": 0, "expert_bits": 3, "expert_group": 32}
    for bad, why in (("int1-experts", "bits must be in 2..8"), ("int9-experts", "bits must be in 2..8"),
                     ("int4g0-experts", "group size must be >= 1"),
                     ("int8-weight-only+int4-experts", "both quantise the experts"),
                     ("int4-experts+int3-experts", "given twice")):
        with pytest.raises(ValueError, match=why):
            parse_profile(bad)
