"""A run that ends without completing: ``run.json`` says ``failed`` with the reason, and the terminal gives the
next step (``--resume`` when there is a checkpoint, else the command to retry)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from distmoe.simulate import SimOptions, flower_reason
from distmoe.simulate.launch import _failed

BOX = """INFO :      Starting local SuperLink on 127.0.0.1:41234...
╭─ Error ──────────────────────────────────────────────────────────────────────╮
│ Connection to the SuperLink is unavailable. Please check your network        │
│ connection and 'address' in the SuperLink connection configuration.          │
╰──────────────────────────────────────────────────────────────────────────────╯
"""


def _run_dir(tmp_path: Path, checkpoint: bool) -> Path:
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": "123", "status": "running", "config": {}}))
    (run / "flower.log").write_text(BOX)
    if checkpoint:
        (run / "checkpoints" / "round-1").mkdir(parents=True)
    return run


def test_a_run_that_died_says_failed_with_flowers_reason_and_how_to_resume(tmp_path: Path, capsys):
    run = _run_dir(tmp_path, checkpoint=True)
    assert flower_reason(run / "flower.log") == "Connection to the SuperLink is unavailable"
    assert _failed(SimOptions(overrides={}), run, run / "flower.log", timed_out=False) == 1
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "failed" and "Connection to the SuperLink is unavailable" in rec["error"]
    assert rec["run_id"] == "123" and rec["finished"] > 0  # the record is kept, only completed
    err = capsys.readouterr().err
    assert "run FAILED" in err and f"distmoe simulate --resume {run}" in err


def test_without_a_checkpoint_the_next_step_is_the_retry(tmp_path: Path, capsys):
    run = _run_dir(tmp_path, checkpoint=False)
    _failed(SimOptions(overrides={}), run, run / "flower.log", timed_out=True)
    assert json.loads((run / "run.json").read_text())["error"].startswith("timed out after --timeout 3600 s")
    err = capsys.readouterr().err
    assert "nothing to resume (no checkpoint); retry with:" in err


def test_a_reason_the_coordinator_wrote_is_kept(tmp_path: Path, capsys):
    run = _run_dir(tmp_path, checkpoint=True)
    (run / "run.json").write_text(json.dumps({"run_id": "1", "status": "failed", "error": "round 3: budget"}))
    _failed(SimOptions(overrides={}), run, run / "flower.log", timed_out=False)
    assert json.loads((run / "run.json").read_text())["error"] == "round 3: budget"


TINY = {"model.hidden-size": 32, "model.moe-intermediate-size": 32, "model.layers": 1, "model.heads": 2,
        "model.kv-heads": 1, "model.head-dim": 16, "model.experts": 4, "model.top-k": 2, "train.local-steps": 2,
        "train.batch-size": 4, "data.synth-examples": 20, "schedule.phases": "sft:lookup*4", "routing.probe-every": 0,
        "eval.max-new-tokens": 2}


@pytest.mark.slow
def test_a_superlink_lost_mid_run_leaves_a_failed_record_and_the_resume_command(tmp_path: Path):
    """Real processes: the run's SuperLink dies after round 1 (what another run's cleanup did to a run that had
    attached to its SuperLink); `simulate` exits 1, `run.json` says failed with the reason, the terminal says
    how to resume, and no process of the run is left. The run is long enough (40 rounds of 20 steps) that it cannot
    finish before the loss is noticed: with the Simulation Engine's hand-off, 4 short rounds can."""
    long_run = {**TINY, "schedule.phases": "sft:lookup*40", "train.local-steps": 20}
    over = " ".join(f"{k}={json.dumps(v)}" for k, v in long_run.items())
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-m", "distmoe.cli", "simulate", "--parties", "2", "--no-report",
                             "--runs-dir", str(tmp_path / "runs"), "--run-id", "r", "--timeout", "500",
                             "--run-config", over], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = tmp_path / "runs" / "r"
    killed = False
    for line in proc.stdout:
        if "round 1/40" in line and not killed:
            pids = [p for p in processes_of(run) if b"flower-superlink" in Path(f"/proc/{p}/cmdline").read_bytes()]
            assert pids
            for p in pids:
                os.kill(p, signal.SIGKILL)
            killed = True
    err = proc.stderr.read()
    assert proc.wait(120) == 1 and killed
    rec = json.loads((run / "run.json").read_text())
    assert rec["status"] == "failed" and rec["error"], rec
    assert f"distmoe simulate --resume {run}" in err, err
    assert json.loads((run / "simulate.json").read_text())["remaining"] == []


def processes_of(run: Path) -> list[int]:
    """PIDs whose environment names this run's Flower home (every process of the run carries it)."""
    needle = f"FLWR_HOME={run / 'flwr'}".encode()
    out = []
    for e in Path("/proc").iterdir():
        if e.name.isdigit():
            try:
                if needle in (e / "environ").read_bytes().split(b"\0"):
                    out.append(int(e.name))
            except OSError:
                continue
    return out
