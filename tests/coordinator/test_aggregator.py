"""The plaintext aggregates the phases rely on: metric weighting, evaluation pooling, update checks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from distmoe.coordinator.aggregator import aggregate_eval, check_update, weighted_metrics
from distmoe.wire.schema import EVAL_ROUTING_KEYS, ModelUpdate


def test_weighted_metrics_weights_sums_counts_and_takes_the_max():
    out = weighted_metrics([({"loss": 1.0, "steps": 2, "logp_diff_max": 0.1}, 1.0),
                            ({"loss": 3.0, "steps": 3, "logp_diff_max": 0.4}, 3.0),
                            ({"loss": math.nan}, 5.0)])
    assert out["loss"] == pytest.approx(2.5) and out["steps"] == 5 and out["logp_diff_max"] == 0.4
    assert math.isnan(weighted_metrics([({"k": math.nan}, 1.0)])["k"])


def test_eval_pools_by_held_out_counts():
    a = {"acc/t": 1.0, "loss/t": 0.0, "n/t": 1.0, **{k: 1.0 for k in EVAL_ROUTING_KEYS}}
    b = {"acc/t": 0.0, "loss/t": 2.0, "n/t": 3.0, **{k: 0.0 for k in EVAL_ROUTING_KEYS}}
    out = aggregate_eval([a, b, {"n/t": 0.0}], ("t",))
    assert out["n/t"] == 4 and out["acc/t"] == pytest.approx(0.25) and out["loss/t"] == pytest.approx(1.5)
    assert out[EVAL_ROUTING_KEYS[0]] == pytest.approx(0.25)


@pytest.mark.parametrize("delta,needle", [({"v": np.zeros(2, np.float32)}, "keys do not match"),
                                          ({"w": np.zeros(3, np.float32)}, "has shape"),
                                          ({"w": np.array([0, np.inf], np.float32)}, "NaN or Inf")])
def test_update_check_names_the_problem(delta, needle):
    assert needle in check_update(ModelUpdate("p", delta, 1, {}), {"w": (2,)})
    assert check_update(ModelUpdate("p", {"w": np.zeros(2, np.float32)}, 1, {}), {"w": (2,)}) is None
