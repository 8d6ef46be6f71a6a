"""Unit tests: aux load-balance loss, anchor KL, router statistics, the anchor, routing metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from distmoe.data.template import collate
from distmoe.model.build import build_model
from distmoe.model.router import forward_with_router
from distmoe.routing import metrics as rm
from distmoe.routing.anchor import AnchorError, AnchorVersion, build_anchor, load_anchor, save_anchor
from distmoe.routing.losses import anchor_kl, aux_load_balance_loss
from distmoe.routing.stats import per_sequence_mean_routing, router_stats

L, E, K = 2, 4, 2


def _logits(n=12, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, E, generator=g) * scale for _ in range(L))


def _mask(b=3, s=4, lengths=(4, 2, 3)):
    m = torch.zeros(b, s, dtype=torch.long)
    for i, n in enumerate(lengths):
        m[i, :n] = 1
    return m


def _perturb_padding(logits, mask, seed=1):
    pad = mask.reshape(-1) == 0
    g = torch.Generator().manual_seed(seed)
    out = []
    for z in logits:
        z = z.clone()
        z[pad] = torch.randn(int(pad.sum()), E, generator=g) * 10
        out.append(z)
    return tuple(out)


def _batch_mean_routing(logits, mask):
    keep = mask.reshape(-1).bool()
    return torch.stack([torch.softmax(z[keep], -1).mean(0) for z in logits])  # [L, E]


def _meta(round_=3, layers=L, experts=E):
    return AnchorVersion(version=1, round=round_, source_checkpoint="abc",
                         router_spec={"family": "qwen3_moe", "moe_layers": list(range(layers)),
                                      "num_experts": experts, "top_k": K},
                         num_sequences=5.0, task="arith")


# ------------------------------------------------------------------------------------------ aux loss
def test_aux_loss_uniform_routing_equals_top_k():
    zeros = tuple(torch.zeros(12, E) for _ in range(L))
    assert float(aux_load_balance_loss(zeros, E, K, None)) == pytest.approx(K, abs=1e-5)
    mask = _mask()
    assert float(aux_load_balance_loss(zeros, E, K, mask)) == pytest.approx(K, abs=1e-5)
    assert float(aux_load_balance_loss(zeros, E, 1, None)) == pytest.approx(1.0, abs=1e-5)


def test_aux_loss_collapsed_routing_is_larger():
    z = torch.full((12, E), -10.0)
    z[:, 0] = 10.0
    collapsed = (z, z.clone())
    assert float(aux_load_balance_loss(collapsed, E, K, None)) > K + 0.5


def test_aux_loss_ignores_padding():
    mask = _mask()
    logits = _logits()
    a = aux_load_balance_loss(logits, E, K, mask)
    b = aux_load_balance_loss(_perturb_padding(logits, mask), E, K, mask)
    torch.testing.assert_close(a, b)
    # but without the mask the padded rows count
    c = aux_load_balance_loss(_perturb_padding(logits, mask), E, K, None)
    assert abs(float(c) - float(a)) > 1e-4


@pytest.mark.parametrize("scope", ["layer", "pooled"])
def test_aux_loss_scopes_agree_where_every_layer_has_the_same_loads(scope):
    """Both scopes read k on uniform routing and the same value when the layers' routing is identical."""
    z = _logits()[0]
    same = (z, z.clone())
    ref = aux_load_balance_loss((z,), E, K, None, scope)
    torch.testing.assert_close(aux_load_balance_loss(same, E, K, None, scope), ref)
    zeros = tuple(torch.zeros(12, E) for _ in range(L))
    assert float(aux_load_balance_loss(zeros, E, K, _mask(), scope)) == pytest.approx(K, abs=1e-5)


def test_aux_loss_per_layer_sees_imbalances_that_cancel_across_layers():
    """Layer 0 sends every token to experts {0, 1}, layer 1 to {2, 3}: pooled over layers the counts are even
    (transformers' form reads about k, balanced), per layer each layer is collapsed onto half the experts."""
    z0 = torch.full((12, E), -5.0)
    z0[:, :2] = 5.0
    z1 = torch.full((12, E), -5.0)
    z1[:, 2:] = 5.0
    pooled = float(aux_load_balance_loss((z0, z1), E, K, None, "pooled"))
    layer = float(aux_load_balance_loss((z0, z1), E, K, None, "layer"))
    assert pooled == pytest.approx(K, abs=1e-3)
    assert layer == pytest.approx(2 * K, abs=1e-3)  # E * (2 experts * 1 * 1/2): twice the balanced value
    with pytest.raises(ValueError, match="scope"):
        aux_load_balance_loss((z0, z1), E, K, None, "bogus")


def test_aux_loss_per_layer_gradient_pushes_each_layer_towards_its_idle_experts():
    z = torch.zeros(12, E)
    z[:, 0] = 3.0
    layers = (z.clone().requires_grad_(), torch.zeros(12, E, requires_grad=True))
    aux_load_balance_loss(layers, E, 1, None, "layer").backward()
    g = layers[0].grad.sum(0)  # [E]: descending the loss lowers the overloaded expert's logit
    assert g[0] > 0 and (g[1:] < 0).all()


# ------------------------------------------------------------------------------------------ anchor KL
def test_anchor_kl_batch_zero_at_batch_mean():
    mask = _mask()
    logits = _logits()
    anchor = _batch_mean_routing(logits, mask)
    assert float(anchor_kl(logits, mask, anchor, "batch")) == pytest.approx(0.0, abs=1e-6)
    other = torch.softmax(torch.randn(L, E, generator=torch.Generator().manual_seed(5)) * 3, -1)
    assert float(anchor_kl(logits, mask, other, "batch")) > 1e-3


def test_anchor_kl_token_zero_for_uniform_router(cfg):
    model, _ = build_model(cfg.model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.zero_()
    ids = torch.randint(6, 100, (2, 5))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        out = forward_with_router(model, ids, mask)
    uniform = torch.full((L, E), 1.0 / E)
    assert float(anchor_kl(out.router_logits, mask, uniform, "token")) == pytest.approx(0.0, abs=1e-6)
    assert float(anchor_kl(out.router_logits, mask, uniform, "batch")) == pytest.approx(0.0, abs=1e-6)
    skew = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * L)
    expected = float((skew[0] * (skew[0] / 0.25).log()).sum())  # KL(skew || uniform)
    assert float(anchor_kl(out.router_logits, mask, skew, "token")) == pytest.approx(expected, rel=1e-4)


def test_anchor_kl_token_is_mean_of_per_token_kl():
    mask = _mask()
    logits = _logits()
    anchor = torch.softmax(torch.randn(L, E, generator=torch.Generator().manual_seed(9)), -1)
    keep = mask.reshape(-1).bool()
    per_layer = []
    for li, z in enumerate(logits):
        p = torch.softmax(z[keep], -1)
        per_layer.append((anchor[li] * (anchor[li].log() - p.log())).sum(-1).mean())
    expected = float(torch.stack(per_layer).mean())
    got = float(anchor_kl(logits, mask, anchor, "token"))
    assert got == pytest.approx(expected, rel=1e-5)
    # token KL >= batch KL (convexity), and both positive here
    assert got >= float(anchor_kl(logits, mask, anchor, "batch")) > 0


@pytest.mark.parametrize("gran", ["batch", "token"])
def test_anchor_kl_ignores_padding(gran):
    mask = _mask()
    logits = _logits()
    anchor = torch.softmax(torch.randn(L, E, generator=torch.Generator().manual_seed(2)), -1)
    a = anchor_kl(logits, mask, anchor, gran)
    b = anchor_kl(_perturb_padding(logits, mask), mask, anchor, gran)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("gran", ["batch", "token"])
def test_anchor_kl_gradient_reaches_router(cfg, gran):
    model, _ = build_model(cfg.model)
    model.train()
    ids = torch.randint(6, 100, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    out = forward_with_router(model, ids, mask)
    anchor = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7]])
    kl = anchor_kl(out.router_logits, mask, anchor, gran)
    assert kl.requires_grad and float(kl.detach()) > 0
    kl.backward()
    gates = [(n, p) for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert len(gates) == L
    for n, p in gates:
        assert p.grad is not None and float(p.grad.abs().sum()) > 0, n
    assert anchor.grad is None


def test_anchor_kl_rejects_wrong_layers_and_granularity():
    logits = _logits()
    with pytest.raises(ValueError, match="layers"):
        anchor_kl(logits, None, torch.full((3, E), 0.25), "batch")
    with pytest.raises(ValueError, match="granularity"):
        anchor_kl(logits, None, torch.full((L, E), 0.25), "sequence")


# ------------------------------------------------------------------------------------------ router stats
def test_per_sequence_mean_routing_ignores_padding():
    mask = _mask()
    logits = _logits()
    per = per_sequence_mean_routing(logits, mask)
    assert per.shape == (3, L, E)
    torch.testing.assert_close(per.sum(-1), torch.ones(3, L))
    per2 = per_sequence_mean_routing(_perturb_padding(logits, mask), mask)
    torch.testing.assert_close(per, per2)
    # sequence 1 has 2 valid tokens: rows 4 and 5 of the flattened [B*S] logits
    for li in range(L):
        expected = torch.softmax(logits[li][4:6], -1).mean(0)
        torch.testing.assert_close(per[1, li], expected)


def test_router_stats_rows_equal_number_of_sequences(cfg):
    model, _ = build_model(cfg.model)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(6, 100, (n,), generator=g).tolist() for n in (7, 3, 5, 9, 2)]
    encoded = [(s, s) for s in seqs]
    batches = [collate(encoded[:3], 0), collate(encoded[3:], 0)]
    sums, n = router_stats(model, batches)
    assert n == 5
    assert sums.shape == (L, E) and sums.dtype == np.float64
    np.testing.assert_allclose(sums.sum(1), np.full(L, 5.0), atol=1e-6)
    assert np.all(sums >= 0)
    # padding does not matter: each sequence alone gives the same total
    alone = sum(router_stats(model, [collate([e], 0)])[0] for e in encoded)
    np.testing.assert_allclose(sums, alone, atol=1e-5)
    assert not model.training


def test_router_stats_skips_empty_sequences_and_rejects_no_input(cfg):
    model, _ = build_model(cfg.model)
    batch = collate([([7, 8, 9], [7, 8, 9]), ([10, 11], [10, 11])], 0)
    batch["attention_mask"][1] = 0  # a sequence with no valid token
    sums, n = router_stats(model, [batch])
    assert n == 1
    assert np.all(np.isfinite(sums))
    np.testing.assert_allclose(sums.sum(1), np.ones(L), atol=1e-6)
    with pytest.raises(ValueError):
        router_stats(model, [])


# ------------------------------------------------------------------------------------------ anchor
def test_build_anchor_normalises_and_clips():
    summed = np.array([[2.0, 2.0, 0.0, 0.0], [-1.0, 3.0, 1.0, 0.0]])
    a = build_anchor(summed, _meta())
    assert a.probs.shape == (L, E) and a.probs.dtype == np.float32
    np.testing.assert_allclose(a.probs[0], [0.5, 0.5, 0, 0], atol=1e-7)
    np.testing.assert_allclose(a.probs[1], [0.0, 0.75, 0.25, 0.0], atol=1e-7)
    np.testing.assert_allclose(a.probs.sum(1), np.ones(L), atol=1e-6)
    assert np.all(a.probs >= 0)


def test_build_anchor_rejections():
    with pytest.raises(AnchorError, match="shape"):
        build_anchor(np.ones((3, E)), _meta())
    with pytest.raises(AnchorError, match="shape"):
        build_anchor(np.ones((L, E + 1)), _meta())
    bad = np.ones((L, E))
    bad[0, 1] = np.nan
    with pytest.raises(AnchorError, match="NaN"):
        build_anchor(bad, _meta())
    empty = np.ones((L, E))
    empty[1] = 0.0
    with pytest.raises(AnchorError, match="empty"):
        build_anchor(empty, _meta())
    neg = np.ones((L, E))
    neg[1] = -1.0  # clipped to zero: an empty row
    with pytest.raises(AnchorError, match="empty"):
        build_anchor(neg, _meta())


def test_save_and_load_anchor(tmp_path):
    a = build_anchor(np.array([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]]), _meta(round_=7))
    path = save_anchor(a, tmp_path / "anchors")
    assert path == tmp_path / "anchors" / "round-7.npz"
    assert path.with_suffix(".json").exists()
    b = load_anchor(path)
    np.testing.assert_array_equal(a.probs, b.probs)
    assert b.meta == a.meta
    assert b.meta.router_spec["num_experts"] == E and b.meta.task == "arith"
    assert not list((tmp_path / "anchors").glob(".*"))  # no temporary files left behind


# ------------------------------------------------------------------------------------------ metrics
def test_load_cv():
    assert rm.load_cv(torch.full((L, E), 5)) == pytest.approx(0.0, abs=1e-12)
    one_hot = torch.zeros(L, E)
    one_hot[:, 2] = 10
    assert rm.load_cv(one_hot) == pytest.approx(math.sqrt(E - 1), rel=1e-9)
    mixed = torch.stack([torch.full((E,), 5.0), one_hot[0]])
    assert rm.load_cv(mixed) == pytest.approx(math.sqrt(E - 1) / 2, rel=1e-9)


def test_top1_counts_and_select_valid():
    mask = _mask()
    logits = _logits()
    valid = rm.select_valid(logits, mask)
    assert [v.shape for v in valid] == [(9, E)] * L
    torch.testing.assert_close(valid[0], logits[0][mask.reshape(-1).bool()])
    counts = rm.top1_counts(valid, E)
    assert counts.shape == (L, E)
    assert counts.sum(1).tolist() == [9] * L
    assert counts[0].tolist() == torch.bincount(valid[0].argmax(-1), minlength=E).tolist()


def test_kl_to_anchor():
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    assert rm.kl_to_anchor(p, p) == pytest.approx(0.0, abs=1e-12)
    assert rm.kl_to_anchor(p * 7, p) == pytest.approx(0.0, abs=1e-12)  # rows are normalised
    q = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    expected = float((q[0] * (q[0] / p[0]).log()).sum()) / 2  # KL(anchor || routing), mean over layers
    assert rm.kl_to_anchor(p, q) == pytest.approx(expected, rel=1e-9)


def test_top1_agreement():
    logits = list(_logits())
    agree, total = rm.top1_agreement(logits, logits)
    assert agree == total == 12 * L
    flipped = [-z for z in logits]  # argmax becomes argmin: never equal
    agree, total = rm.top1_agreement(logits, flipped)
    assert agree == 0 and total == 12 * L
