"""``distmoe.aggregate``'s plaintext norm screen: the norm each update is screened on is the float64 formula's, bit
for bit, and computing it leaves the update as it was."""

from __future__ import annotations

import math

import numpy as np

from distmoe.aggregate import _norm, divergent_updates


def _reference(delta):  # the formula: sqrt of the sum over tensors of the float64 sum of squares
    return float(math.sqrt(sum(float(np.square(np.asarray(v, np.float64)).sum()) for v in delta.values())))


def test_the_screens_norm_is_the_float64_formulas_bit_for_bit_and_leaves_its_input_unchanged():
    rng = np.random.default_rng(0)
    delta = {"a": rng.standard_normal((64, 33)).astype(np.float32), "b": rng.standard_normal(1000) * 1e3,
             "c": np.array([3.0e38, -3.0e38], np.float32), "d": np.zeros((0, 4), np.float32)}
    before = {k: v.copy() for k, v in delta.items()}
    assert _norm(delta) == _reference(delta)
    assert all(np.array_equal(delta[k], before[k]) and delta[k].dtype == before[k].dtype for k in delta)
    ups = {i: {k: v * (1.0 + i) for k, v in delta.items() if k != "c"} for i in range(3)}
    ups[3] = {k: v * 50.0 for k, v in ups[0].items()}
    assert list(divergent_updates(ups, 10.0)) == [3]
