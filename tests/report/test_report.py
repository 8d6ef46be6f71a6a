"""Unit tests for the metrics log and the run report (synthetic run directories only; no models)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from distmoe.io import write_json_atomic
from distmoe.report.report import summarise, write_report
from distmoe.rundir.metrics import MetricsLog, read_metrics

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


# ------------------------------------------------------------ a report that reads right
def _secagg_run(root: Path, retention: float = 0.12) -> Path:
    """A secure-aggregation run as the coordinator writes it: train rows count contributors and carry no loss, no
    per-party row, DP-noised aggregate evaluations, a statistics round between the tasks, a skipped round, a
    party's budget refusal and a contributor-count refusal in ``privacy/ledger.json``."""
    run_dir = root / "runs" / "20261202-101010-ab12"
    (run_dir / "privacy").mkdir(parents=True)
    plan = {"planned_epsilon": 7.9985, "stats_releases": 1, "update_releases": 0, "eval_releases": 2,
            "update_noise_multiplier": 0.0}
    write_json_atomic(run_dir / "run.json", {
        "run_id": "4242424242", "name": run_dir.name, "status": "completed", "started": 1.0e9,
        "finished": 1.0e9 + 65, "warnings": [], "schedule": ["sft:arith*2", "stats:arith", "eval", "sft:strings*2",
                                                             "eval"],
        "privacy": {"mode": "secagg", "secure_aggregation": True, "plan": plan, "epsilon_budget": 8.0,
                    "delta": 1e-6, "threshold": 2, "n_parties": 3,
                    "epsilon_spent": {p: {"prv": 5.1, "rdp": 6.2} for p in ("party-0", "party-1", "party-2")}},
        "parties": {p: {"node": str(100 + i), "ledger_public_key": "ab"} for i, p in enumerate(PARTIES)},
    })
    events = [{"noise_multiplier": 2.0, "sample_rate": 1.0, "steps": 1, "mechanism": "skellam",
               "label": "router-stats round 3", "d2": 1.0, "d1": 1.0},
              {"noise_multiplier": 3.0, "sample_rate": 1.0, "steps": 1, "mechanism": "skellam",
               "label": "eval round 4", "d2": 1.0, "d1": 1.0},
              {"noise_multiplier": 3.0, "sample_rate": 1.0, "steps": 1, "mechanism": "skellam",
               "label": "eval round 7", "d2": 1.0, "d1": 1.0}]
    write_json_atomic(run_dir / "privacy" / "ledger.json", {
        "epsilon_budget": 8.0, "delta": 1e-6, "parties": {p: {"events": events} for p in ("party-0", "party-1")},
        "epsilon": {"party-0": {"prv": 5.1, "rdp": 6.2}, "party-1": {"prv": 5.0, "rdp": 6.0}},
        "refused": [{"round": 6, "release": "model-update", "reason": "too-few-contributors", "contributors": 1,
                     "survivors": 2, "min_parties": 2}],
    })
    log = MetricsLog(run_dir / "metrics.jsonl")
    log.append({"event": "run_start", "run_id": "4242424242"})
    for r, task in ((1, "arith"), (2, "arith"), (5, "strings")):
        log.append({"event": "train", "round": r, "phase_label": f"sft:{task}", "task": task, "party": "all",
                    "contributors": 3, "parties": 3})
    log.append({"event": "stats", "round": 3, "party": "all", "task": "arith", "anchor_version": 1,
                "num_sequences": 1200.0})
    log.append({"event": "eval", "round": 4, "party": "all", "phase_label": "eval", "acc/arith": 0.81,
                "n/arith": 48})
    log.append({"event": "party_error", "round": 5, "phase_label": "sft:strings", "node": "102", "party": "party-2",
                "code": "budget", "reason": "budget: ..."})
    log.append({"event": "train", "round": 6, "phase_label": "sft:strings", "task": "strings", "party": "all",
                "num_examples": 0, "skipped": True})
    log.append({"event": "eval", "round": 7, "party": "all", "phase_label": "eval", "acc/arith": 0.81 * retention,
                "acc/strings": 0.7, "retention/arith": retention, "new_task": "strings"})
    log.append({"event": "run_end", "status": "completed"})
    return run_dir


def test_secure_aggregation_report_reads_right(tmp_path: Path) -> None:
    """One run id (Flower's only as a detail), no unexplained counter, the per-party section says
    why it is empty and where the losses are, a privacy section with epsilon per party against the budget, the
    releases and every refusal, and a collapsed retention is named."""
    run_dir = _secagg_run(tmp_path)
    md = write_report(run_dir).read_text(encoding="utf-8")
    lines = md.splitlines()
    assert lines[0] == f"# Run report: `{run_dir.name}` — completed"
    assert sum("4242424242" in line for line in lines) == 1  # Flower's id: one detail line
    assert "- detail: Flower's run id `4242424242`" in md
    assert "**events**" not in md and "events:" not in md
    assert "- **rounds logged**: 7 (4 training, 1 statistics, 2 evaluation; 1 skipped)" in md
    assert "Per-party metrics: none, by design under secure aggregation" in md
    assert "`<work-dir>/metrics/<party>.jsonl`" in md
    assert "## Privacy" in md
    assert "Budget ε = 8 at δ = 1e-06 per party" in md and "planned ε 7.998" in md
    assert "| party-0 | 6.2 | 8 | 78% | 1 | 2 |" in md  # max(PRV, RDP) against the budget; releases by kind
    assert "| party | ε spent | budget | of budget | router-stats releases | eval releases |" in md
    assert "round 5: party `party-2` refused the release: it would exceed its privacy budget" in md
    assert "round 6: model-update not released: fewer contributing parties than privacy.min-parties" in md
    assert "round 6: train round skipped" in md
    assert "Not released: under secure aggregation the routing metrics" in md
    assert "**Retention collapsed**: `arith` 0.12" in md
    assert "Sequences: the number of sequences in the router statistics, summed over the parties" in md
    assert "| 6 | sft:strings | strings | – | skipped: nothing released |" in md
    assert "mean loss" not in md  # no column of dashes where no loss is released
    _assert_png(run_dir / "report" / "loss.png")  # contributors per training round, not an empty panel


def test_retention_without_collapse_is_not_flagged(tmp_path: Path) -> None:
    md = write_report(_secagg_run(tmp_path, retention=0.95)).read_text(encoding="utf-8")
    assert "Retention collapsed" not in md and "| arith | 0.7695 | – | – | 0.95 |" in md


def test_loss_line_is_not_drawn_across_non_training_rounds(tmp_path: Path, monkeypatch) -> None:
    """Rounds 1-3 train arith, round 4 is a statistics round, rounds 5-6 train arith again, 7-8 train strings: the
    lines break between 3 and 5 (nothing trained in 4) and between 6 and 7 (another task)."""
    from distmoe.report import plots as rep

    run_dir = tmp_path / "gaps"
    log = MetricsLog(run_dir / "metrics.jsonl")
    for r in (1, 2, 3, 5, 6, 7, 8):
        task = "arith" if r < 7 else "strings"
        for p in (*PARTIES, "all"):
            log.append(_train(r, task, p, 2.0 - 0.1 * r))
    log.append({"event": "stats", "round": 4, "party": "all", "task": "arith"})
    figs = {}
    monkeypatch.setattr(rep, "_save", lambda fig, path: figs.__setitem__(path.name, fig))
    write_report(run_dir)
    (ax,) = figs["loss.png"].axes
    lines = [line for line in ax.lines if not line.get_label().startswith("_")]  # not the task boundary
    assert len(lines) == 3  # two parties and the aggregate
    for line in lines:
        xs, ys = list(line.get_xdata()), list(line.get_ydata())
        segments, cur = [], []
        for x, y in zip(xs, ys, strict=True):
            if math.isnan(y):
                segments.append(cur)
                cur = []
            else:
                cur.append(x)
        segments.append(cur)
        assert segments == [[1, 2, 3], [5, 6], [7, 8]], (line.get_label(), xs, ys)
