"""The distillation cost bench (``bench/distill_cost.py``) times both arms of the real SFT loop, and the distilled arm
does the extra forward (it costs CPU time)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "bench" / "distill_cost.py"


def test_both_arms_are_timed_and_distillation_costs_cpu_time():
    spec = importlib.util.spec_from_file_location("distill_cost", _PATH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--steps", "3", "--repeats", "1"])
    assert set(out) == {"anchor", "anchor+distill"} and all(len(v) == 1 and v[0] > 0 for v in out.values())
