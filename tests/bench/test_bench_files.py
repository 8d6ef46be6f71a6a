"""``bench/bench_files.py``: a bench's own files of a run go beside its run directory, so that ``distmoe audit``
passes on an in-process bench run (and still fails on a file dropped into the run directory); reads fall back to
the directory itself (kept-row directories of ``bench/results``).

Must not: run an experiment (one tiny in-process run, marked ``integration``, stands for every in-process bench).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_DIR = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(_DIR))
_spec = importlib.util.spec_from_file_location("bench_files_bench", _DIR / "bench_files.py")
bf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bf)


def test_bench_files_go_beside_the_run_directory_and_reads_fall_back_to_it(tmp_path):
    run = tmp_path / "runs" / "anchor-s0"
    run.mkdir(parents=True)
    path = bf.write_bench_file(run, "row.json", "{}\n")
    assert path == tmp_path / "runs" / "bench-files" / "anchor-s0" / "row.json" and not (run / "row.json").exists()
    assert bf.bench_file(run, "row.json") == path
    kept = tmp_path / "kept" / "anchor-s0"  # a kept-row directory holds its files itself
    kept.mkdir(parents=True)
    (kept / "bench.json").write_text("{}\n")
    assert bf.bench_file(kept, "bench.json") == kept / "bench.json"


@pytest.mark.integration
def test_an_in_process_bench_run_passes_the_audit_and_a_dropped_file_fails_it(tiny_run, tmp_path):
    from distmoe.audit.engine import audit_run
    from distmoe.config import parse_run_config
    from distmoe.simulate import SimOptions, prepare

    over = {**tiny_run, "schedule.phases": "sft:arith, stats:arith, eval", "routing.probe-every": 1,
            "routing.probe-prompts": 4}
    run_dir, parties, over = prepare(SimOptions(overrides=over, run_id="bench-s0", runs_dir=tmp_path, echo=False))
    bf.run_prepared(parse_run_config(over), run_dir, parties, "bench-s0")
    bf.write_bench_file(run_dir, "row.json", "{}\n")
    result = audit_run(run_dir)
    assert result.verdict == "pass", [(c.name, c.findings) for c in result.checks if c.status == "fail"]
    side = bf.bench_dir(run_dir)
    assert sorted(p.name for p in side.iterdir()) == ["coordinator.log", "overrides.toml", "row.json"]
    (run_dir / "coordinator.log").write_bytes((side / "coordinator.log").read_bytes())  # as the harness once did
    result = audit_run(run_dir)
    assert result.check("server-files").findings == ["coordinator.log: not a file the server writes"]
