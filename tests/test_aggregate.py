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


def test_the_secure_sums_norm_check_decides_as_the_concatenated_float64_formula_at_its_bound():
    """``aggregate_problem`` copies the average into one float64 vector without an intermediate per tensor: the
    norm it compares is the one of ``np.concatenate`` of float64 copies, bit for bit, so averages scaled to just
    below and just above the bound get the same verdicts; a NaN in any tensor is still caught."""
    from distmoe.aggregate import aggregate_problem
    from distmoe.privacy.vectors import UpdateLayout

    shapes = {"a": (7, 5), "b": (11,), "c": (2, 3, 4)}
    lay = UpdateLayout.build(shapes, 3, clip=1.0)
    rng = np.random.default_rng(2)
    base = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    flat = np.concatenate([np.asarray(a, np.float64).ravel() for a in base.values()])
    bound = lay.clip * (1.0 + 1e-6) + 1e-6 + math.sqrt(flat.size) * lay.quantisation_bound()
    for f in (1.0 - 1e-7, 1.0 - 1e-12, 1.0 + 1e-12, 1.0 + 1e-7):
        avg = {k: (v.astype(np.float64) * (bound * f / float(np.linalg.norm(flat)))).astype(np.float32)
               for k, v in base.items()}
        ref = float(np.linalg.norm(np.concatenate([np.asarray(a, np.float64).ravel() for a in avg.values()])))
        got = aggregate_problem(lay, avg, 3.0, 3)
        assert (got is None) == (ref <= bound), (f, got)
        if got is not None:
            assert f"average update norm {ref:.6g}" in got
    bad = dict(base, c=np.full((2, 3, 4), np.nan, np.float32))
    assert "not finite" in aggregate_problem(lay, bad, 3.0, 3)
