"""``distmoe.rl.engine_calibration``: the mismatch of an engine profile against the exact policy, measured on the
small MoE briefly trained on lookup data (the shared fixture)."""

from __future__ import annotations

import pytest
import torch

from distmoe.rl.engine_calibration import calibrate_profile, calibration_table


@pytest.fixture(scope="module")
def small(train_small_lookup):
    t = train_small_lookup()
    return t["model"], t["tok"], t["examples"][:16]


def test_exact_profile_measures_no_mismatch_and_quantised_experts_do(small):
    model, tok, prompts = small
    before = {n: p.clone() for n, p in model.state_dict().items()}
    exact = calibrate_profile(model, tok, prompts, "exact", samples=2, seed=3)
    assert exact.dlogp_mean < 1e-4 and exact.route_disagree == 0.0 and exact.tokens > 0
    q = calibrate_profile(model, tok, prompts, "int2g32-experts", samples=2, seed=3)
    assert q.dlogp_mean > 1e-3 and q.k3 > 0 and q.dlogp_max >= q.dlogp_mean
    assert 0.0 <= q.route_disagree <= q.route_disagree_max <= 1.0
    assert calibrate_profile(model, tok, prompts, "int2g32-experts", samples=2, seed=3) == q  # deterministic
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())  # the model is untouched
    table = calibration_table([exact, q])
    assert "`int2g32-experts`" in table and len(table.splitlines()) == 4


def test_calibration_refuses_bad_input(small):
    model, tok, prompts = small
    with pytest.raises(ValueError, match="no prompts"):
        calibrate_profile(model, tok, [], "exact")
    with pytest.raises(ValueError, match="samples"):
        calibrate_profile(model, tok, prompts, "exact", samples=0)
    with pytest.raises(ValueError, match="'int9-experts' is not one of"):  # the config's grammar refuses it
        calibrate_profile(model, tok, prompts, "int9-experts")
