"""TensorBoard scalars of a run: ``distmoe report --tensorboard`` and ``report.tensorboard``.

The writer needs the optional ``tensorboard`` package; the tests that write event files skip only when it is
absent. What does not need it always runs: which scalars are written, and the error naming the extra.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest

from distmoe.cli import main
from distmoe.report.tensorboard import TensorBoardMissing, scalars, write_tensorboard
from distmoe.rundir.metrics import MetricsLog

ROWS = [
    {"event": "run_start", "run_id": "r"},
    {"event": "train", "round": 1, "party": "party-0", "loss": 9.0, "num_examples": 10},
    {
        "event": "train",
        "round": 1,
        "party": "all",
        "task": "arith",
        "loss": 1.5,
        "loss_last": 1.25,
        "num_examples": 20,
        "skipped_steps": 0,
    },
    {"event": "stats", "round": 2, "party": "all", "task": "arith", "num_sequences": 400.0, "anchor_version": 1},
    {"event": "eval", "round": 3, "party": "all", "acc/arith": 0.75, "retention/arith": None, "new_task": "arith"},
    {"event": "party_error", "round": 3, "party": "party-1", "code": "budget"},
    {"event": "run_end", "status": "completed", "rounds": 3},
]
WANT = {
    ("train/loss", 1, 1.5),
    ("train/loss_last", 1, 1.25),
    ("train/num_examples", 1, 20.0),
    ("train/skipped_steps", 1, 0.0),
    ("stats/num_sequences", 2, 400.0),
    ("eval/acc/arith", 3, 0.75),
}


def _run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    log = MetricsLog(run_dir / "metrics.jsonl")
    for row in ROWS:
        log.append(row)
    return run_dir


def test_scalars_are_the_aggregate_numbers_only(tmp_path: Path) -> None:
    """Every finite number of an aggregate train/rl/stats/eval row, at its round; no per-party row, no null, no
    label, no bookkeeping key (round, time, anchor version)."""
    got = {(tag, step, value) for tag, step, value, _ in scalars(_run(tmp_path))}
    assert got == WANT


def _hide_tensorboard(monkeypatch) -> None:
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard... -> ImportError


def test_without_tensorboard_the_error_names_the_extra(tmp_path: Path, monkeypatch, capsys) -> None:
    run_dir = _run(tmp_path)
    _hide_tensorboard(monkeypatch)
    with pytest.raises(TensorBoardMissing, match=r"distmoe\[tensorboard\]"):
        write_tensorboard(run_dir)
    assert main(["report", str(run_dir), "--tensorboard"]) == 2
    err = capsys.readouterr().err
    assert "error: --tensorboard:" in err and "pip install 'distmoe[tensorboard]'" in err
    assert not (run_dir / "tensorboard").exists() and not (run_dir / "report").exists()  # nothing half-written


def test_simulate_refuses_report_tensorboard_without_the_package(tmp_path: Path, monkeypatch) -> None:
    """``report.tensorboard = true`` without the package is a config error before any run directory is made."""
    from distmoe.config import ConfigError
    from distmoe.simulate import SimOptions, prepare

    _hide_tensorboard(monkeypatch)
    opts = SimOptions(overrides={"report.tensorboard": True}, runs_dir=tmp_path / "runs")
    with pytest.raises(ConfigError, match=r"config key 'report.tensorboard'.*distmoe\[tensorboard\]"):
        prepare(opts)
    assert not (tmp_path / "runs").exists()


def _f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def test_event_files_hold_every_aggregate_scalar_and_pass_the_audit_reader(tmp_path: Path, capsys) -> None:
    """With the package: ``distmoe report --tensorboard`` writes one event file under RUN/tensorboard that the
    audit's own reader (``distmoe.audit.tfevents``) reads back to exactly the aggregate scalars; a second run
    replaces it (no duplicate points)."""
    pytest.importorskip("tensorboard", reason="the optional extra distmoe[tensorboard] is not installed")
    from distmoe.audit.tfevents import read_scalars

    run_dir = _run(tmp_path)
    assert main(["report", str(run_dir), "--tensorboard"]) == 0
    assert "tensorboard --logdir" in capsys.readouterr().err
    for _ in range(2):
        files = sorted((run_dir / "tensorboard").iterdir())
        assert len(files) == 1 and files[0].name.startswith("events.out.tfevents.")
        assert set(read_scalars(files[0])) == {(t, s, _f32(v)) for t, s, v in WANT}
        write_tensorboard(run_dir)
