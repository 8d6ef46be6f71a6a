"""The run record (``run.json``) and the anomaly watch on aggregate metrics.

Owns: ``RunRecord``, the dict behind ``run.json`` (status, config, schedule, privacy plan, parties,
model, warnings, anomalies, resumes), rewritten atomically on every change so that a crash leaves the
last complete record; and ``flag_anomalies``: a non-finite aggregate loss, or one beyond
``federation.anomaly-z`` rolling z-scores of the same event's earlier rounds (window 8, at least 3
earlier values), over the keys of ``ANOMALY_KEYS``.

Must not: import ``flwr``, or read anything a party sent except aggregates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from distmoe.io import write_json_atomic

# aggregate metrics watched for anomalies (non-finite, or a spike beyond federation.anomaly-z)
ANOMALY_KEYS = {"train": ("loss", "loss_last"), "rl": ("k3", "logp_diff_mean")}
WINDOW, MIN_HISTORY = 8, 3


class RunRecord:
    """``run.json``: every ``update`` is written through before it returns."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.data: dict = {}

    def update(self, **changes) -> None:
        self.data.update(changes)
        write_json_atomic(self.path, self.data)

    def replace(self, data: dict) -> None:
        """Take over an existing record (a resumed run's), without writing yet."""
        self.data = dict(data)

    def get(self, key: str, default=None):
        return self.data.get(key, default)

    def __getitem__(self, key: str):
        return self.data[key]

    def append(self, key: str, item) -> None:
        self.update(**{key: [*self.data.get(key, []), item]})


def flag_anomalies(history: dict[str, list[float]], event: str, agg: Mapping[str, float], z_max: float) -> list[str]:
    """The anomalies in ``agg`` (module docstring); appends the finite values to ``history``."""
    found = []
    for key in ANOMALY_KEYS.get(event, ()):
        if key not in agg:
            continue
        v = float(agg[key])
        hist = history.setdefault(f"{event}/{key}", [])
        if not math.isfinite(v):
            found.append(f"{event} {key} is {v} (non-finite)")
            continue
        recent = hist[-WINDOW:]
        if z_max > 0 and len(recent) >= MIN_HISTORY:
            mu = sum(recent) / len(recent)
            sd = math.sqrt(sum((x - mu) ** 2 for x in recent) / (len(recent) - 1))
            z = (v - mu) / max(sd, 1e-6 * max(abs(mu), 1.0))
            if z > z_max:
                found.append(f"{event} {key} {v:.4g} is {z:.1f} rolling standard deviations above the mean "
                             f"{mu:.4g} of the last {len(recent)} rounds (federation.anomaly-z = {z_max:g})")
        hist.append(v)
    return found
