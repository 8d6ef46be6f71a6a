"""``distmoe deploy wait RUN_DIR``: returns when the run's own record says the run ended, not before.

The run record is written by another thread while the command waits (a real file in a real directory, as the
coordinator writes it): the command must keep waiting through ``running`` and a half-written file, and its exit
status must say how the run ended.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from distmoe.cli import main
from distmoe.deploy.wait import TIMED_OUT, run_status, wait_for_run


def _write_later(run_dir: Path, steps: list[tuple[float, str]]) -> threading.Thread:
    def go():
        for delay, text in steps:
            time.sleep(delay)
            (run_dir / "run.json").write_text(text)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_waits_through_running_and_a_partial_record_until_completed(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"status": "running"}))
    writer = _write_later(run, [(0.15, '{"status": "comp'), (0.15, json.dumps({"status": "completed"}))])
    lines: list[str] = []
    t0 = time.monotonic()
    assert wait_for_run(run, timeout=20, poll=0.02, say=lines.append) == 0
    assert time.monotonic() - t0 >= 0.3  # not before the record said completed
    writer.join()
    assert "completed" in lines[-1], lines


def test_a_failed_run_exits_1_with_its_error(tmp_path: Path, capsys):
    run = tmp_path / "run"  # the directory itself appears only once the run starts
    writer = threading.Thread(target=lambda: (time.sleep(0.1), run.mkdir(), (run / "run.json").write_text(
        json.dumps({"status": "failed", "error": "PrivacyStop: budget"}))), daemon=True)
    writer.start()
    assert main(["deploy", "wait", str(run), "--poll", "0.02", "--timeout", "20"]) == 1
    writer.join()
    out = capsys.readouterr().out
    assert "failed" in out and "PrivacyStop: budget" in out, out
    assert f"run.resume = '{run}'" in out, out  # the next step


def test_a_completed_run_gives_no_resume_step(tmp_path: Path, capsys):
    (tmp_path / "run.json").write_text(json.dumps({"status": "completed"}))
    assert main(["deploy", "wait", str(tmp_path), "--poll", "0.02"]) == 0
    assert "run.resume" not in capsys.readouterr().out


def test_a_run_still_running_at_the_timeout_exits_124(tmp_path: Path, capsys):
    (tmp_path / "run.json").write_text(json.dumps({"status": "running"}))
    assert main(["deploy", "wait", str(tmp_path), "--poll", "0.02", "--timeout", "0.1"]) == TIMED_OUT
    assert "still running" in capsys.readouterr().out
    assert run_status(tmp_path) == ("running", None)


def test_bad_options_are_named(tmp_path: Path, capsys):
    assert main(["deploy", "wait", str(tmp_path), "--poll", "0"]) == 2
    assert "--poll" in capsys.readouterr().err


def test_a_run_dir_that_never_gets_a_record_is_named_once(tmp_path: Path):
    """A mistyped RUN_DIR (or a run that never started) would wait in silence forever: after a minute without
    ``run.json`` the command says so once, naming the directory and where to look, and goes on waiting."""
    from distmoe.deploy import wait

    now = [0.0]
    lines: list[str] = []

    def sleep(s: float) -> None:
        now[0] += s

    missing = tmp_path / "runs" / "exp1"
    assert wait_for_run(missing, timeout=3 * wait.NO_RECORD_HINT_S, poll=5.0, say=lines.append,
                        clock=lambda: now[0], sleep=sleep) == TIMED_OUT
    hints = [x for x in lines if x.startswith("still no ")]
    assert len(hints) == 1 and str(missing) in hints[0] and "run.dir" in hints[0] and "flwr ls" in hints[0], lines
