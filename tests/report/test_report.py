"""Unit tests for the metrics log and the run report (synthetic run directories only; no models)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from distmoe.io import write_json_atomic
from distmoe.report.metrics_log import MetricsLog, read_metrics
from distmoe.report.report import summarise, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PARTIES = ("party-0", "party-1")
WARNING = "anchor-kl-coef is 0: routing drift is not regularised"


def _train(rnd: int, task: str, party: str, loss: float) -> dict:
    phase = 0 if task == "arith" else 1
    return {
        "event": "train", "round": rnd, "phase": phase, "phase_label": f"sft:{task}", "task": task,
        "party": party, "loss": loss, "task_loss": loss - 0.03, "aux_loss": 2.01, "anchor_kl": 0.05,
        "loss_first": loss + 0.5, "loss_last": loss - 0.2, "steps": 25, "skipped_steps": 1 if rnd == 5 else 0,
        "num_examples": 190, "time_s": 4.2,
    }


def _eval(rnd: int, party: str, acc_a: float, acc_s: float, retention: float | None) -> dict:
    ev = {
        "event": "eval", "round": rnd, "party": party, "phase_label": "eval",
        "acc/arith": acc_a, "loss/arith": 0.5, "n/arith": 48,
        "acc/strings": acc_s, "loss/strings": 2.3, "n/strings": 48,
        "routing_kl": None if rnd == 3 else 0.0123, "load_cv": 0.31 if rnd == 3 else 0.18,
        "top1_consistency": None if rnd == 3 else 0.9537, "new_task": "strings", "new_task_loss": 2.3,
    }
    if retention is not None:
        ev["retention/arith"] = retention
    return ev


def _make_run(root: Path, n_rounds: int = 6, run_id: str = "run-abc123") -> Path:
    run_dir = root / "runs" / run_id
    (run_dir / "anchors").mkdir(parents=True)
    (run_dir / "checkpoints").mkdir()
    write_json_atomic(run_dir / "run.json", {
        "run_id": run_id, "status": "completed", "started": "2025-01-01T10:00:00+00:00",
        "finished": "2025-01-01T10:03:25+00:00", "config": {"train.lr": 1e-3, "model.experts": 8},
        "warnings": [WARNING], "error": None, "schedule": ["sft:arith*3", "eval", "sft:strings*3", "eval"],
    })
    log = MetricsLog(run_dir / "metrics.jsonl")
    log.append({"event": "run_start", "run_id": run_id})
    half = n_rounds // 2
    for r in range(1, n_rounds + 1):
        task = "arith" if r <= half else "strings"
        for i, p in enumerate(PARTIES):
            log.append(_train(r, task, p, 2.0 - 0.1 * r + 0.05 * i))
        log.append(_train(r, task, "all", 2.0 - 0.1 * r + 0.025))
        if r == half:
            log.append({"event": "stats", "round": r, "party": "all", "task": "arith", "anchor_version": 1,
                        "num_sequences": 570.0})
        if r % half == 0:
            if r > half:  # strings trained: arith now has a retention
                log.append(_eval(r, "party-0", 0.7917, 0.6, 0.9))
                log.append(_eval(r, "party-1", 0.75, 0.55, 0.85))
                log.append(_eval(r, "all", 0.7708, 0.5729, 0.8924))
            else:
                log.append(_eval(r, "party-0", 0.8, 0.1, None))
                log.append(_eval(r, "party-1", 0.7, 0.1, None))
                log.append(_eval(r, "all", 0.75, 0.1, None))
    log.append({"event": "run_end", "status": "completed", "mystery": {"x": 1}})
    return run_dir


def _assert_png(path: Path) -> None:
    assert path.is_file(), path
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 5000, (path, len(data))


def test_report_contents_and_plots(tmp_path: Path) -> None:
    run_dir = _make_run(tmp_path)
    md_path = write_report(run_dir)
    assert md_path == run_dir / "report" / "report.md"
    md = md_path.read_text(encoding="utf-8")
    assert "run-abc123" in md and "completed" in md
    assert "## Warnings" in md and f"- {WARNING}" in md
    assert "sft:strings*3" in md
    # final aggregate eval row: task | accuracy | loss | n | retention
    assert "| arith | 0.7708 | 0.5 | 48 | 0.8924 |" in md
    assert "| strings | 0.5729 | 2.3 | 48 | – |" in md
    assert "0.9537" in md and "0.0123" in md  # top-1 consistency and routing KL
    assert "party-0" in md and "0.7917" in md  # per-party table
    assert "| 1 | sft:arith | arith | 2.425 → 1.725 | 1.925 |" in md  # train row: first → last, mean
    for name in ("loss", "routing", "tasks"):
        assert f"![{name}]({name}.png)" in md
        _assert_png(run_dir / "report" / f"{name}.png")

    summary = summarise(run_dir)
    assert summary["round"] == 6 and summary["party"] == "all"
    assert summary["acc/arith"] == pytest.approx(0.7708)
    assert summary["retention/arith"] == pytest.approx(0.8924)


def test_report_of_many_rounds_has_every_round(tmp_path: Path) -> None:
    """300 rounds: one train row per round, in order, the final evaluation of the last round, valid plots
    (how long it takes is a benchmark's question, not a test's)."""
    run_dir = _make_run(tmp_path, n_rounds=300)
    md = write_report(run_dir).read_text(encoding="utf-8")
    rows = [line.split("|")[1].strip() for line in md.splitlines() if line.startswith("| ") and "| sft:" in line]
    assert rows == [str(r) for r in range(1, 301)]
    assert "| 300 | sft:strings | strings |" in md
    assert "| arith | 0.7708 | 0.5 | 48 | 0.8924 |" in md  # round 300's aggregate evaluation
    for name in ("loss", "routing", "tasks"):
        _assert_png(run_dir / "report" / f"{name}.png")


def test_report_with_only_run_start(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "run.json").write_text(json.dumps({"run_id": "r1", "status": "failed", "warnings": [],
                                                  "error": "RuntimeError: boom", "schedule": []}))
    MetricsLog(run_dir / "metrics.jsonl").append({"event": "run_start"})
    md = write_report(run_dir).read_text(encoding="utf-8")
    assert "r1" in md and "failed" in md and "boom" in md
    for name in ("loss", "routing", "tasks"):
        _assert_png(run_dir / "report" / f"{name}.png")
    assert summarise(run_dir) == {}


def test_report_without_run_json_and_with_partial_round(tmp_path: Path) -> None:
    """A crashed run: no run.json, party events for a round whose aggregate never got logged."""
    run_dir = tmp_path / "crashed"
    log = MetricsLog(run_dir / "metrics.jsonl")
    log.append(_train(1, "arith", "party-0", 1.5))
    log.append({"event": "eval", "round": 1, "party": "all", "acc/arith": float("nan"), "load_cv": "bad"})
    with open(run_dir / "metrics.jsonl", "ab") as fh:
        fh.write(b'{"event": "train", "rou')
    md = write_report(run_dir).read_text(encoding="utf-8")
    assert "crashed" in md and "run.json missing" in md and "1 partial trailing line" in md
    assert "1*" in md  # derived aggregate row


def test_missing_metrics_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        write_report(tmp_path)


def test_metrics_log_nan_is_null_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "metrics.jsonl"
    log = MetricsLog(path)
    log.append({"event": "train", "loss": float("nan"), "nested": {"a": [1.0, float("inf"), -float("inf")]}})
    log.append({"event": "eval", "round": 2, "time": 123.5, "acc/x": 0.5})
    raw = path.read_text(encoding="utf-8")
    assert "NaN" not in raw and "Infinity" not in raw
    assert raw.endswith("\n") and raw.count("\n") == 2
    events = read_metrics(path)
    assert events.skipped == 0
    assert events[0]["loss"] is None and events[0]["nested"] == {"a": [1.0, None, None]}
    assert isinstance(events[0]["time"], float) and not math.isnan(events[0]["time"])
    assert events[1] == {"event": "eval", "round": 2, "time": 123.5, "acc/x": 0.5}


def test_truncated_trailing_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.append({"event": "a"})
    log.append({"event": "b"})
    with open(path, "ab") as fh:
        fh.write(b'{"event": "c", "lo')
    events = read_metrics(path)
    assert [e["event"] for e in events] == ["a", "b"]
    assert events.skipped == 1


def test_corrupt_middle_line_raises_with_line_number(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "a"}\n{"event": oops}\n{"event": "c"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"metrics\.jsonl: line 2"):
        read_metrics(path)


def test_write_json_atomic_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    write_json_atomic(path, {"status": "running", "x": float("nan")})
    write_json_atomic(path, {"status": "completed"})
    assert json.loads(path.read_text()) == {"status": "completed"}
    assert os.listdir(tmp_path) == ["run.json"]


def test_report_text_does_not_depend_on_the_machines_time_zone(tmp_path: Path, monkeypatch) -> None:
    """The audit re-renders report.md and compares: an auditor in another time zone must get the same text."""
    import time

    from distmoe.report.report import render_markdown

    run_dir = _make_run(tmp_path)
    run = json.loads((run_dir / "run.json").read_text())
    write_json_atomic(run_dir / "run.json", {**run, "started": 1735725600.0, "finished": 1735725805.0})  # as written
    texts = []
    for tz in ("UTC", "Asia/Tokyo", "America/Los_Angeles"):
        monkeypatch.setenv("TZ", tz)
        time.tzset()
        texts.append(render_markdown(run_dir))
    monkeypatch.delenv("TZ")
    time.tzset()
    assert texts[0] == texts[1] == texts[2]
