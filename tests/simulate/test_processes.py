"""Stopping a simulated run's processes by PID (``distmoe/simulate/processes.py``), on real processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from distmoe.simulate.processes import processes_with_token, stop_processes

# Like Ray's dashboard and runtime-env agents: a new session, an environment without the run's token or
# RAY_TMPDIR, and a log file held open under the run's Ray directory.
AGENT = "import sys, time; f = open(sys.argv[1], 'a'); time.sleep(120)"


def _agent(log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", AGENT, str(log)], env={"RAY_CLIENT_MODE": "0"},
                            start_new_session=True)
    for _ in range(100):  # until the log is open
        if log.exists():
            break
        time.sleep(0.05)
    time.sleep(0.2)
    return proc


def test_an_agent_that_only_holds_a_log_in_the_runs_ray_directory_is_found_and_stopped(tmp_path: Path):
    ray_dir = tmp_path / "ray"
    (ray_dir / "session_x" / "logs").mkdir(parents=True)
    proc = _agent(ray_dir / "session_x" / "logs" / "dashboard_agent.out")
    try:
        assert proc.pid in processes_with_token("no-such-token", ray_dir=str(ray_dir))
        assert proc.pid not in processes_with_token("no-such-token")  # neither token, session nor Ray dir
        stopped = stop_processes("no-such-token", grace=2.0, ray_dir=str(ray_dir))
        assert proc.pid in stopped
        assert proc.wait(timeout=10) is not None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_process_holding_files_elsewhere_is_left_alone(tmp_path: Path):
    (tmp_path / "ray").mkdir()
    (tmp_path / "other").mkdir()
    proc = _agent(tmp_path / "other" / "app.log")
    try:
        assert proc.pid not in processes_with_token("no-such-token", ray_dir=str(tmp_path / "ray"))
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
