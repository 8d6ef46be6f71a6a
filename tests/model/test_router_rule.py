"""Unit tests: the sigmoid routers' rule (``distmoe.model.router_rule``) against DeepSeek-V3's and GLM-4.5's own router
modules: the routing distribution the anchor and statistics use, the choice the probe, the metrics and ``prune-k``'s
usage count take, and the refusal of a prune that leaves too few experts in the groups."""

from __future__ import annotations

import pytest
import torch

from distmoe.model.balance import selection_scores
from distmoe.model.build import load_checkpoint, router_modules
from distmoe.model.fabricate import write_checkpoint
from distmoe.model.router import forward_with_router
from distmoe.model.router_rule import CORRECTION_BIAS, Routing, routing_of
from distmoe.routing.metrics import select_valid
from distmoe.routing.stats import per_sequence_mean_routing


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def sigmoid_model(request, tmp_path_factory):
    path = write_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "ckpt", seed=7)
    model, tok = load_checkpoint(path)
    return model.eval(), tok


def _batch(tok):
    rows = [tok.encode(t) for t in ("Compute\n3+4", "Reverse\nabcdef", "Look up k12 code?")]
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), tok.pad_token_id, dtype=torch.long)  # [B, S]
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return ids, mask


def _own(model, ids, mask):
    """Each router's own (raw logits, chosen experts) on a forward, ``[B*S, E]`` and ``[B*S, k]``."""
    got, handles = {}, []
    for li, (_, r) in enumerate(router_modules(model)):
        handles.append(r.register_forward_hook(lambda _m, _i, out, li=li: got.__setitem__(li, (out[0], out[2]))))
    try:
        with torch.no_grad():
            out = forward_with_router(model, ids, mask)
    finally:
        for h in handles:
            h.remove()
    return out, got


def test_the_routing_distribution_is_the_normalised_affinities(sigmoid_model):
    model, tok = sigmoid_model
    ids, mask = _batch(tok)
    out, own = _own(model, ids, mask)
    for li, r in enumerate(out.router_logits):
        a = torch.sigmoid(own[li][0])  # [B*S, E] the router's affinities
        torch.testing.assert_close(r.softmax(-1), a / a.sum(-1, keepdim=True))
    stats = per_sequence_mean_routing(out.router_logits, mask)  # [B, L, E]
    torch.testing.assert_close(stats.sum(-1), torch.ones(stats.shape[:2]))  # rows on the simplex
    z = own[0][0].clone().requires_grad_(True)  # differentiable: the anchor KL's gradient reaches the router
    routing_of(model).routing_logits(z).softmax(-1)[:, 0].sum().backward()
    assert z.grad is not None and z.grad.abs().sum() > 0


def test_selection_scores_and_usage_are_the_routers_own_choice(sigmoid_model):
    from distmoe.rl.engines import measure_usage

    model, tok = sigmoid_model
    ids, mask = _batch(tok)
    out, own = _own(model, ids, mask)
    k = int(model.config.num_experts_per_tok)
    valid = mask.reshape(-1).bool()
    chosen = selection_scores(model, select_valid(out.router_logits, mask))  # L x [n, E]
    usage = torch.zeros(len(chosen), 8)
    for li, c in enumerate(chosen):
        idx = own[li][1][valid]  # [n, k]
        assert torch.equal(c.topk(k, -1).indices.sort(-1).values, idx.sort(-1).values)
        usage[li] = torch.bincount(idx.reshape(-1), minlength=8).float()
    torch.testing.assert_close(measure_usage(model, [{"input_ids": ids, "attention_mask": mask}]), usage)
    # without the correction bias the choice differs: selection_scores must include it
    plain = [c.topk(k, -1).indices.sort(-1).values for c in
             (routing_of(model).choice_scores(r, None, from_routing_logits=True)
              for r in select_valid(out.router_logits, mask))]
    assert any(not torch.equal(p, own[li][1][valid].sort(-1).values) for li, p in enumerate(plain))
    assert all(getattr(r, CORRECTION_BIAS).abs().sum() > 0 for _, r in router_modules(model))


def test_a_prune_that_empties_the_groups_is_refused():
    rule = Routing(sigmoid=True, top_k=2, norm=True, scale=1.0, n_group=4, topk_group=2)
    rule.check_pruned(torch.tensor([0]), 8)  # group 0 unusable, 3 groups of 2 remain: any 2 hold 4 >= 2
    with pytest.raises(ValueError, match="fewer than top_k = 2"):
        rule.check_pruned(torch.tensor([0, 2, 4]), 8)  # one usable group left, 2 are kept
    flat = Routing(sigmoid=False, top_k=2, norm=True, scale=1.0)
    with pytest.raises(ValueError, match="fewer than top_k"):
        flat.check_pruned(torch.tensor([0, 1, 2]), 4)
