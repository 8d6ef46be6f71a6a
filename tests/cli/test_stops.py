"""``distmoe simulate`` output and stops without Flower: each progress line once, the run-directory lock,
no half-made run directory after a failed start. The whole-process versions are in
``tests/integration/test_signals.py`` (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distmoe.cli import main
from distmoe.simulate import RUN_LOCK, ProgressFilter, RunLock, SimOptions, SimulationError, run

# the ServerApp's lines as `flwr run --stream` prints them: the log stream's copy, then the simulation
# process's own (as in a real flower.log)
STREAM = "\x1b[92mINFO \x1b[0m:      distmoe | {}\n"
DATED = "12/02/2026 09:22:23:INFO:distmoe | {}\n"


def test_progress_filter_shows_each_line_once():
    f = ProgressFilter()
    msgs = ["2 parties connected", "round 1/3 | sft:lookup | 2/2 parties | 8.9 s", "round 2/3 | sft:lookup | x"]
    lines = [
        STREAM.format(msgs[0]),
        DATED.format(msgs[0]),
        "12/02/2026 09:22:25:DEBUG:Constructed ActorPool\n",
        DATED.format(msgs[1]),
        STREAM.format(msgs[1]),  # the other order also pairs up
        STREAM.format(msgs[2]),
        DATED.format(msgs[2]),
    ]
    shown = [s for s in map(f, lines) if s is not None]
    assert shown == ["  " + m for m in msgs]


def test_progress_filter_keeps_a_line_said_twice_and_a_single_source():
    """The same message said twice (two copies from each source) is shown twice; a log with only one of
    the two sources shows every line."""
    f = ProgressFilter()
    same = "warning: party-1 timed out"
    lines = [STREAM.format(same), DATED.format(same), STREAM.format(same), DATED.format(same)]
    assert [s for s in map(f, lines) if s] == ["  " + same] * 2
    g = ProgressFilter()
    assert [s for s in map(g, [DATED.format("a"), DATED.format("b"), DATED.format("a")]) if s] == ["  a", "  b", "  a"]
    assert g("distmoe client: party-0 ready\n") == "  distmoe client: party-0 ready"


@pytest.fixture
def live_pid():
    """The PID of a running process that is not this one (a ``sleep``), stopped at the end."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc.pid
    proc.kill()
    proc.wait()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_run_lock_refuses_a_live_holder_and_takes_over_a_stale_one(tmp_path: Path, live_pid):
    lock = tmp_path / RUN_LOCK
    lock.write_text(json.dumps({"pid": live_pid}))
    with pytest.raises(SimulationError, match=f"PID {live_pid}"):
        RunLock(tmp_path).acquire()
    assert json.loads(lock.read_text())["pid"] == live_pid  # the holder's lock is untouched

    gone = dead_pid()
    lock.write_text(json.dumps({"pid": gone}))
    said = []
    mine = RunLock(tmp_path, say=said.append)
    mine.acquire()
    assert said and f"stale lock {lock} of PID {gone}" in said[0]
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    mine.release()
    assert not lock.exists()


def test_run_lock_of_a_reused_pid_is_stale(tmp_path: Path, live_pid):
    """The lock records when its holder started: a live PID that started at another time (the PID was
    reused after the holder died) does not hold the run."""
    from distmoe.simulate import _proc_start

    lock = tmp_path / RUN_LOCK
    lock.write_text(json.dumps({"pid": live_pid, "proc_start": _proc_start(live_pid)}))
    with pytest.raises(SimulationError, match=f"PID {live_pid}"):
        RunLock(tmp_path).acquire()
    lock.write_text(json.dumps({"pid": live_pid, "proc_start": _proc_start(live_pid) - 1}))
    said = []
    RunLock(tmp_path, say=said.append).acquire()
    assert "stale lock" in said[0] and json.loads(lock.read_text())["pid"] == os.getpid()


def test_resume_refuses_a_run_being_written_and_writes_nothing(tmp_path: Path, live_pid, capsys):
    """A second ``simulate --resume`` on a run whose lock names a running simulate is refused naming it,
    before any check writes to the run directory (``overrides.resume.toml`` is not written)."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "overrides.toml").write_text('"run.name" = "r"\n')
    (run_dir / RUN_LOCK).write_text(json.dumps({"pid": live_pid, "started": 0, "command": ["distmoe"]}))
    before = sorted(p.name for p in run_dir.iterdir())
    code = main(["simulate", "--resume", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"is being written by `distmoe simulate` PID {live_pid}" in err
    assert sorted(p.name for p in run_dir.iterdir()) == before


def test_resume_of_a_missing_directory_says_so(tmp_path: Path, capsys):
    assert main(["simulate", "--resume", str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err


def test_failed_start_leaves_no_half_made_run_directory(tmp_path: Path):
    """``federation.min-available`` above the party count is found after the run directory and the synthetic
    data were written: the start fails and removes that directory."""
    runs = tmp_path / "runs"
    with pytest.raises(Exception, match="federation.min-available"):
        run(
            SimOptions(
                overrides={"federation.min-available": 5, "data.synth-examples": 12},
                parties=2,
                runs_dir=runs,
                run_id="half",
                echo=False,
            )
        )
    assert not (runs / "half").exists()


def test_a_process_with_only_the_runs_ray_dir_is_found_and_stopped(tmp_path):
    """Ray's dashboard and runtime-env agents keep RAY_TMPDIR but neither the run token nor the session of
    ``flwr run`` (both outlived a quick-start run before): the run's own Ray directory finds them."""
    from distmoe.simulate import TOKEN_ENV, processes_with_token, stop_processes

    ray_dir = str(tmp_path / "ray")
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    env["RAY_TMPDIR"] = ray_dir
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"], env=env,
                            start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"  # exec'd: its environment is its own, not the forked parent's
        assert processes_with_token("no-such-token") == []  # neither token nor session finds it
        assert processes_with_token("no-such-token", ray_dir=ray_dir) == [proc.pid]
        assert stop_processes("no-such-token", grace=2.0, ray_dir=ray_dir) == [proc.pid]
        assert proc.wait(timeout=10) is not None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stopping_waits_for_the_killed_and_does_not_wait_for_the_exited(tmp_path):
    """A process of the run that ignores SIGTERM is SIGKILLed and gone, not merely signalled, when
    ``stop_processes`` returns (before, the SIGKILL was sent and the stop returned while the process was still
    exiting, so a check right after could list it: a whole Flower run's teardown check failed that way once). One
    that exits on SIGTERM but is not yet reaped by its parent (a zombie, as ``flwr run``, the session leader, is
    until ``simulate`` polls it) is not live, so a second stop finds nothing and does not wait out its grace."""
    from distmoe.simulate import TOKEN_ENV, processes_with_token, stop_processes

    env = {**os.environ, TOKEN_ENV: "zombie-test-token"}
    code = "import signal, sys, time; {}; print('ready', flush=True); time.sleep(60)"
    stubborn = subprocess.Popen([sys.executable, "-c", code.format("signal.signal(signal.SIGTERM, signal.SIG_IGN)")],
                                env=env, start_new_session=True, stdout=subprocess.PIPE, text=True)
    polite = subprocess.Popen([sys.executable, "-c", code.format("pass")], env=env, start_new_session=True,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert stubborn.stdout.readline().strip() == "ready" and polite.stdout.readline().strip() == "ready"
        assert sorted(processes_with_token("zombie-test-token")) == sorted([stubborn.pid, polite.pid])
        stopped = stop_processes("zombie-test-token", grace=1.0, session=stubborn.pid)
        assert sorted(stopped) == sorted([stubborn.pid, polite.pid])
        assert processes_with_token("zombie-test-token", session=stubborn.pid) == []
        assert processes_with_token("zombie-test-token", session=polite.pid) == []  # a zombie leader: not live
        t0 = time.monotonic()
        assert stop_processes("zombie-test-token", grace=5.0, session=polite.pid) == []
        assert time.monotonic() - t0 < 2.0
        assert stubborn.poll() == -9 and polite.poll() == -15  # SIGKILLed and SIGTERMed, reaped only now
    finally:
        for p in (stubborn, polite):
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdout.close()
