"""The evaluation figures' noise scales and retention: undefined when the earlier accuracy is within noise."""

from __future__ import annotations

import math

import numpy as np
import pytest

from distmoe.config import parse_run_config
from distmoe.coordinator.phases.evaluate import retention
from distmoe.privacy.releases.evaluate import spec as eval_spec
from distmoe.privacy.releases.evaluate import with_noise_scale


def test_noise_scale_matches_the_spread_of_decoded_accuracies():
    """The stated scale is the measured spread: decode many noised sums of the same true figures."""
    cfg = parse_run_config({})
    n_parties, per_party = 3, 48
    spec = eval_spec(cfg.privacy, per_party, ("t",), n_parties, 2)
    rng = np.random.default_rng(0)
    scores = {"t": [(i % 4 != 0, 1.0) for i in range(per_party)]}  # 75 % correct at each party
    accs, sds = [], []
    for _ in range(300):
        total = sum(spec.share(spec.sums(scores), rng).astype(np.uint64) for _ in range(n_parties))
        d = with_noise_scale(spec, spec.decode(np.asarray(total, np.uint64)), n_parties)
        accs.append(d["acc/t"])
        sds.append(d["acc_sd/t"])
    assert abs(np.mean(accs) - 0.75) < 0.02
    assert np.std(accs) == pytest.approx(np.mean(sds), rel=0.2)  # ~0.055 at 144 examples


def test_retention_is_undefined_against_an_accuracy_within_noise():
    assert retention(0.004, 0.04, 0.3) is None  # the "collapsed from 0.004" case: a ratio to noise
    assert retention(0.0, math.nan, 0.3) is None
    assert retention(0.8, 0.04, 0.4) == 0.5
    assert retention(0.8, math.nan, 0.4) == 0.5  # plaintext: no noise
    assert retention(math.nan, 0.04, 0.4) is None
