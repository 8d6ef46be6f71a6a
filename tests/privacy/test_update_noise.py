"""Client-level DP on updates: each party's Gaussian share, only on the update block, only when private."""

from __future__ import annotations

import math

import numpy as np
import pytest

from distmoe.privacy.ring import from_ring, from_ring64
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


def test_noise_share_in_a_32_bit_layout():
    """Ring width: a noised update in Z_2^32 keeps its width, and its noise is calibrated to the sensitivity after
    stochastic rounding, ``clip * 2^f + sqrt(numel)`` (fixed-point units)."""
    z, t = 2.0, 3
    lay = UpdateLayout.build(SHAPES, 5, 1.0, private=True, noise_multiplier=z, threshold=t, ring="auto")
    assert lay.bits == 32
    assert lay.int_sensitivity() == lay.clip * 2.0**lay.frac_bits + math.sqrt(lay.numel)
    vec, _ = lay.encode({"w": np.zeros(SHAPES["w"], np.float32)}, 1)
    noisy = add_update_noise(vec, lay, z, t)
    assert noisy.dtype == np.uint32
    diff = (from_ring(noisy).astype(np.int64) - from_ring(vec)).astype(np.float64)  # [D] fixed-point units
    want = z * lay.int_sensitivity() / math.sqrt(t)
    assert abs(diff[:lay.numel].std() / want - 1) < 0.1
    assert not diff[lay.numel:].any()
    # the noisy sum of all 5 parties stays inside B(f), the bound the width was chosen by (no wrap)
    total = sum(from_ring(add_update_noise(vec, lay, z, t)).astype(np.int64) for _ in range(5))  # [D]
    assert np.abs(total).max() < lay.int_bound(lay.frac_bits) < 2**31
