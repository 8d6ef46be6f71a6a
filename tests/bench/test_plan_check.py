"""``distmoe plan`` against measured peaks at a small shape: ``bench/plan_check.py`` saves a Qwen3-MoE-shaped
checkpoint of 0.03B parameters (100 MB of float32 experts), runs one party process per round (an ``sft`` step, the
``stats`` forward, a GRPO step with the ``exact`` engine) and compares each peak RSS with the plan (the 4-bit ``sft``
step is 0.83 of measured at this shape: ``docs/checkpoints.md``). Slow: real subprocesses that load the checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "bench" / "plan_check.py"


@pytest.mark.slow
def test_the_plan_is_within_15_percent_of_the_measured_party_peaks(tmp_path):
    out = tmp_path / "plan.json"
    subprocess.run([sys.executable, str(_BENCH), "--sizes", "small", "--rounds", "sft", "stats", "rl-exact",
                    "--ckpt-dir", str(tmp_path), "--out", str(out)], check=True, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert [r["round"] for r in rows] == ["sft", "stats", "rl-exact"]
    for r in rows:
        assert 0.85 <= r["predicted_mb"] / r["peak_rss_mb"] <= 1.15, r
