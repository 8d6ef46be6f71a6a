"""Client-level DP on updates: each party's Gaussian share, only on the update block, only when private."""

from __future__ import annotations

import math

import numpy as np
import pytest

from distmoe.privacy.ring import from_ring64
from distmoe.privacy.update_noise import UpdateNoiseError, add_update_noise, update_dp_facts
from distmoe.privacy.vectors import UpdateLayout

SHAPES = {"w": (64, 32)}


def _layout(private: bool) -> UpdateLayout:
    return UpdateLayout.build(SHAPES, 5, 1.0, private=private)


def test_refused_on_a_layout_that_releases_weights_or_metrics():
    lay = _layout(private=False)
    vec, _ = lay.encode({"w": np.zeros(SHAPES["w"], np.float32)}, 3)
    with pytest.raises(UpdateNoiseError, match="non-private layout"):
        add_update_noise(vec, lay, 1.0, 3)


def test_noise_share_has_the_over_provisioned_std_and_spares_the_rest():
    lay = _layout(private=True)
    vec, _ = lay.encode({"w": np.zeros(SHAPES["w"], np.float32)}, 1)
    z, t = 2.0, 3
    noisy = add_update_noise(vec, lay, z, t)
    diff = (from_ring64(noisy) - from_ring64(vec)).astype(np.float64)  # [D] fixed-point units
    block = diff[:lay.numel] / 2.0 ** lay.frac_bits  # back to update units
    want = z * lay.sensitivity / math.sqrt(t)  # the sum over >= t survivors has std >= z * clip
    assert abs(block.std() / want - 1) < 0.1  # 2048 samples: a 10 % band is > 4 standard errors
    assert not diff[lay.numel:].any()  # the weight slot untouched
    facts = update_dp_facts(lay, z, 5, t)
    assert facts["z_eff"] == z and facts["max_dropouts"] == 2 and facts["metrics"] == "withheld"
