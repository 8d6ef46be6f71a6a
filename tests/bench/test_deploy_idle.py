"""``bench/deploy_idle.py``: the per-process CPU reading it sums and the process kinds it names."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

_BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(_BENCH))
import deploy_idle  # noqa: E402


def test_cpu_seconds_reads_a_process_user_and_system_time_and_none_once_it_is_gone():
    before = deploy_idle.cpu_seconds(os.getpid())
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:  # 0.3 s of this process's CPU
        sum(range(10_000))
    assert deploy_idle.cpu_seconds(os.getpid()) - before >= 0.2
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert deploy_idle.cpu_seconds(proc.pid) is None


def test_kind_of_names_the_deployments_processes_by_their_command_line(tmp_path):
    script = tmp_path / "clients.supernode"  # a command line that carries the SuperNode's module name
    script.write_text("import time\ntime.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, str(script)])
    try:
        time.sleep(0.2)
        assert deploy_idle.kind_of(proc.pid) == "SuperNode"
    finally:
        proc.kill()
        proc.wait()
    assert deploy_idle.kind_of(proc.pid) == "gone"
