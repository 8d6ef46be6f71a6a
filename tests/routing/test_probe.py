"""Unit tests: the public probe set, the probe's routing of a model, the median over parties, the probe metrics."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from distmoe.model.build import build_model
from distmoe.routing import metrics as rm
from distmoe.routing.probe import (
    ProbeError,
    combine,
    default_probe_prompts,
    expert_counts,
    probe_metrics,
    probe_routing,
    read_probe_file,
)


def test_default_probe_set_is_deterministic_public_and_covers_every_family():
    a, b = default_probe_prompts(0, 16), default_probe_prompts(0, 16)
    assert a == b and len(a) == 16 and len(set(a)) > 10
    assert default_probe_prompts(1, 16) != a  # drawn from the run seed
    assert all(re.fullmatch(r"\w+\n\d+[+-]\d+", p) for p in a[0::3])  # the families in turn: arith,
    assert all(re.fullmatch(r"\w+\n[a-z]{3}", p) for p in a[1::3])  # strings,
    assert all(re.search(r"\bk\d+\b", p) for p in a[2::3])  # lookup
    with pytest.raises(ProbeError, match="1..256"):
        default_probe_prompts(0, 0)


def test_probe_file_is_validated_with_file_and_line(tmp_path):
    good = tmp_path / "probe.jsonl"
    good.write_text(json.dumps({"prompt": "Compute\n1+2"}) + "\n\n" + json.dumps({"prompt": "hello"}) + "\n")
    assert read_probe_file(good) == ("Compute\n1+2", "hello")
    for text, msg in ((json.dumps({"prompt": "x", "answer": "y"}), r"probe\.jsonl:1: .*exactly the field 'prompt'"),
                      ("{not json", r"probe\.jsonl:1: not JSON"),
                      (json.dumps({"prompt": ""}), "prompt 1 is not a non-empty string"),
                      (json.dumps({"prompt": "x" * 2001}), "at most 2000"),
                      (json.dumps({"prompt": "a\x00b"}), "control characters"),
                      ("", "0 probe prompts")):
        bad = tmp_path / "probe.jsonl"
        bad.write_text(text + "\n")
        with pytest.raises(ProbeError, match=msg):
            read_probe_file(bad)
    with pytest.raises(ProbeError, match="cannot read"):
        read_probe_file(tmp_path / "missing.jsonl")


def test_combine_takes_the_median_and_names_a_lying_minority():
    rng = np.random.default_rng(0)
    r = rng.dirichlet(np.ones(4), size=2)  # [L, E]
    t = rng.integers(0, 4, size=(2, 30)).astype(np.int32)
    liar = (np.roll(r, 1, axis=1), (t + 1) % 4)
    R, T, bad = combine({"a": (r, t), "b": (r.copy(), t.copy()), "c": liar})
    np.testing.assert_array_equal(R, r)
    np.testing.assert_array_equal(T, t)
    assert bad == ["c"]
    R, T, bad = combine({"a": (r, t), "b": (r, t), "c": (r, t[:, :5])})  # another shape
    assert bad == ["c"] and T.shape == t.shape
    with pytest.raises(ProbeError):
        combine({})


def test_probe_metrics_follow_their_formulas():
    top1 = np.array([[0, 0, 1, 1], [2, 2, 2, 2]])  # [L=2, N=4], E = 3
    counts = expert_counts(top1, 3)
    np.testing.assert_array_equal(counts, [[2, 2, 0], [0, 0, 4]])
    routing = np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    anchor = np.array([[0.4, 0.4, 0.2], [0.2, 0.2, 0.6]], np.float32)
    m = probe_metrics(routing, top1, 3, anchor, np.array([[0, 1, 1, 1], [2, 2, 2, 0]]))
    assert m["expert_counts"] == [[2, 2, 0], [0, 0, 4]]
    cv = np.mean([np.std(c) / np.mean(c) for c in counts])
    assert m["load_cv"] == pytest.approx(cv)
    kl = np.mean([(a * np.log(a / p)).sum() for a, p in zip(anchor.astype(np.float64), routing, strict=True)])
    assert m["routing_kl"] == pytest.approx(kl, rel=1e-5)
    assert m["top1_consistency"] == pytest.approx(6 / 8)
    none = probe_metrics(routing, top1, 3, None, None)
    assert math.isnan(none["routing_kl"]) and math.isnan(none["top1_consistency"])
    assert math.isnan(probe_metrics(routing, top1, 3, None, top1[:, :2])["top1_consistency"])  # another probe set


def test_probe_routing_of_the_tiny_model(cfg):
    model, tok = build_model(cfg.model)
    prompts = default_probe_prompts(0, 5)
    R, T = probe_routing(model, tok, prompts, cfg.model.max_seq_len, batch_size=2)
    L, E = R.shape
    assert E == cfg.model.experts and T.shape[0] == L and T.dtype == np.int32
    np.testing.assert_allclose(R.sum(1), 1.0, rtol=1e-6)  # a mean of distributions
    assert T.min() >= 0 and T.max() < E
    R2, T2 = probe_routing(model, tok, prompts, cfg.model.max_seq_len, batch_size=5)  # batching does not matter
    np.testing.assert_allclose(R2, R, atol=1e-5)
    np.testing.assert_array_equal(T2, T)
    assert model.training is False
    with torch.no_grad():  # a different router -> different top-1
        for n, p in model.named_parameters():
            if "gate" in n and p.dim() == 2 and p.shape[0] == E:
                p.copy_(torch.randn_like(p) * 5)
    R3, T3 = probe_routing(model, tok, prompts, cfg.model.max_seq_len, batch_size=2)
    assert rm.load_cv(torch.from_numpy(expert_counts(T3, E))) >= 0 and not np.array_equal(T3, T)


def test_probe_top1_is_the_expert_the_router_chooses_with_a_balancing_bias(cfg):
    """With ``routing.balance = "bias"`` the router dispatches on ``z + b``: the probe's top-1 (and so its load CV
    and top-1 consistency) follows the bias, while ``R`` stays the plain softmax (as the anchor statistics)."""
    from distmoe.model.balance import biases, install_bias

    model, tok = build_model(cfg.model)
    prompts = default_probe_prompts(0, 5)
    R0, T0 = probe_routing(model, tok, prompts, cfg.model.max_seq_len, batch_size=2)
    install_bias(model)
    E = R0.shape[1]
    with torch.no_grad():
        for b in biases(model):
            b.fill_(-1e4)
            b[E - 1] = 1e4  # every token's first choice is the last expert
    R1, T1 = probe_routing(model, tok, prompts, cfg.model.max_seq_len, batch_size=2)
    assert np.all(T1 == E - 1) and not np.all(T0 == E - 1)
    np.testing.assert_allclose(R1[0], R0[0], atol=1e-5)  # the first MoE layer's input is unchanged: same softmax
