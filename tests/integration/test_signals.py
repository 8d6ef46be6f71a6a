"""``distmoe simulate`` stopped by a signal, on real processes (slow: Flower's local SuperLink and Ray).

SIGTERM (a job scheduler, ``timeout``) and SIGHUP (a closed terminal) stop the run like Ctrl-C: exit status
128 + signal, every process the run started is gone (by the run's token and session), the lock is released,
and either ``run.json`` says ``interrupted`` with a ``--resume`` hint (stopped in a round) or, stopped before
the coordinator wrote its record, the half-made run directory is removed. stdout and stderr go to one file:
each progress line is in it once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distmoe.config import load_override_file, parse_run_config, to_toml
from distmoe.simulate import RUN_LOCK, processes_with_token

pytestmark = pytest.mark.slow


def start(tmp_path: Path, tiny_run, run_id: str) -> tuple[subprocess.Popen, Path]:
    """``distmoe simulate`` on 2 parties, 12 SFT rounds then eval (a tiny round takes about 1.5 s: the tests stop
    it well before its end), stdout and stderr into one file."""
    conf = tmp_path / "tiny.toml"
    conf.write_text(
        to_toml(
            {
                **{k: v for k, v in tiny_run.items() if k != "federation.min-available"},
                "schedule.phases": "sft:lookup*12, eval",
                "data.synth-examples": 20,
                "federation.wait-timeout": 60.0,
            }
        )
    )
    (tmp_path / "home").mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / f"{run_id}.out"
    with out.open("w") as f:
        proc = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "distmoe"),
                "simulate",
                "--parties",
                "2",
                "--runs-dir",
                str(tmp_path / "runs"),
                "--run-id",
                run_id,
                "--no-report",
                "--config",
                str(conf),
                "--timeout",
                "300",
            ],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    _STARTED.append(proc)
    return proc, out


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _leave_nothing_running(tmp_path):
    """Whatever a test ends with (a failed wait included): each ``simulate`` it started gets SIGTERM (so it stops
    its own processes), then SIGKILL; any process whose Flower state lies under this test's directory is killed."""
    yield
    for proc in _STARTED:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    _STARTED.clear()
    prefix = f"FLWR_HOME={tmp_path.resolve()}".encode()
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and any(v.startswith(prefix) for v in (p / "environ").read_bytes().split(b"\0")):
                os.kill(int(p.name), signal.SIGKILL)
        except OSError:
            continue


def wait_for(proc: subprocess.Popen, out: Path, text: str, timeout: float = 100.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = out.read_text()
        if text in got:
            return got
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not seen; output:\n{out.read_text()[-3000:]}")


def stop_and_wait(proc: subprocess.Popen, sig: int) -> int:
    os.kill(proc.pid, sig)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def run_processes(run_dir: Path) -> list[int]:
    """PIDs of the processes whose environment puts Flower's state in this run directory (``FLWR_HOME``)."""
    needle = f"FLWR_HOME={run_dir.resolve() / 'flwr'}".encode()
    pids = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and needle in (p / "environ").read_bytes().split(b"\0"):
                pids.append(int(p.name))
        except OSError:
            continue
    return pids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_during_start_up_stops_everything_and_leaves_no_run_directory(tmp_path, tiny_run, sig):
    """Stopped while Flower starts (before the coordinator wrote ``run.json``): nothing to resume, so the
    run directory goes; the SuperLink and whatever else had started are stopped by PID."""
    proc, out = start(tmp_path, tiny_run, "early")
    wait_for(proc, out, "run directory:")
    run_dir = tmp_path / "runs" / "early"
    started: list[int] = []
    for _ in range(100):  # the processes `flwr run` has started so far (the SuperLink at least)
        started = run_processes(run_dir)
        if len(started) >= 2:
            break
        time.sleep(0.1)
    assert started, "no process of the run was found"
    code = stop_and_wait(proc, sig)
    text = out.read_text()
    name = signal.Signals(sig).name
    assert code == 128 + sig, text
    assert f"stopped by {name} before the run started; nothing to resume" in text, text
    assert not run_dir.exists()
    assert [pid for pid in started if pid in run_processes(run_dir)] == []


def test_sigterm_during_a_round_records_interrupted_and_prints_each_line_once(tmp_path, tiny_run):
    """Stopped in round 1: ``run.json`` says interrupted, the printed ``--resume`` passes resume's checks."""
    proc, out = start(tmp_path, tiny_run, "mid")
    wait_for(proc, out, "for round 1", timeout=240)  # round 1 has begun (its secure-aggregation keys)
    run_dir = tmp_path / "runs" / "mid"
    assert json.loads((run_dir / RUN_LOCK).read_text())["pid"] == proc.pid  # the lock names the holder
    code = stop_and_wait(proc, signal.SIGTERM)
    text = out.read_text()
    assert code == 128 + signal.SIGTERM, text
    assert "interrupted by SIGTERM" in text and f"distmoe simulate --resume {run_dir}" in text, text
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["status"] == "interrupted" and "SIGTERM" in rec["error"]
    sim = json.loads((run_dir / "simulate.json").read_text())
    assert sim["signal"] == "SIGTERM" and sim["stopped_pids"] and sim["remaining"] == []
    assert processes_with_token(sim["token"], sim["session"]) == []
    assert not (run_dir / RUN_LOCK).exists()

    progress = [line for line in text.splitlines() if line.startswith("  ")]  # simulate's progress indent
    assert any("for round 1" in line for line in progress) and any("connected" in line for line in progress)
    dupes = {line for line in progress if progress.count(line) > 1}
    assert not dupes, f"progress lines printed more than once: {sorted(dupes)}"

    # what it printed is true: the run may be resumed (the checks `simulate --resume` makes first)
    from distmoe.coordinator import check_resumable

    overrides = {**load_override_file(run_dir / "overrides.toml"), "run.resume": str(run_dir)}
    assert check_resumable(run_dir, parse_run_config(overrides))["status"] == "interrupted"
