"""Unit tests: the report's routing from the per-round probe (synthetic run directories only; no models)."""

from __future__ import annotations

from pathlib import Path

from distmoe.io import write_json_atomic
from distmoe.report.report import render_markdown, write_report
from distmoe.report.tensorboard import scalars
from distmoe.rundir.metrics import MetricsLog

CV_WARN = "round 2: routing load CV 1.400 on the probe set exceeds routing.load-cv-warn = 1 (experts unevenly used)"


def _run(root: Path, probes: bool) -> Path:
    run_dir = root / "run"
    run_dir.mkdir(parents=True)
    write_json_atomic(run_dir / "run.json", {
        "run_id": "r", "status": "completed", "warnings": [CV_WARN] if probes else [], "error": None,
        "schedule": ["sft:a*3", "eval"], "privacy": {"secure_aggregation": True},
        "config": {"routing.probe-every": 1, "routing.load-cv-warn": 1.0, "routing.kl-rise-rounds": 3}})
    log = MetricsLog(run_dir / "metrics.jsonl")
    log.append({"event": "run_start", "run_id": "r"})
    for r in (1, 2, 3):
        log.append({"event": "train", "round": r, "phase": 0, "phase_label": "sft:a", "task": "a", "party": "all",
                    "contributors": 2, "parties": 2})
        if probes:
            log.append({"event": "probe", "round": r, "phase_label": "sft:a", "parties": 2, "disagreeing": 0,
                        "anchor_version": 1, "routing_kl": 0.01 * r, "load_cv": 0.9 + 0.25 * r,
                        "top1_consistency": None if r == 1 else 0.9, "expert_counts": [[5, 3, 0, 0], [2, 2, 2, 2]]})
        if probes and r == 2:
            log.append({"event": "routing_warning", "round": 2, "kind": "load_cv", "detail": CV_WARN})
    log.append({"event": "eval", "round": 4, "party": "all", "phase_label": "eval", "acc/a": 0.5, "n/a": 4.0})
    log.append({"event": "run_end", "status": "completed", "rounds": 4})
    return run_dir


def test_probe_rows_make_the_routing_section_and_plot(tmp_path):
    run_dir = _run(tmp_path, probes=True)
    md = write_report(run_dir).read_text()
    assert md == render_markdown(run_dir)
    section = md[md.index("## Routing"):md.index("## Per-party")]
    assert "| 2 | sft:a | 0.02 | 1.4 | 0.9 | 1 | 2 | 0 |" in section  # every round, in order
    assert "Routing-health warnings: 1" in section and CV_WARN in md
    assert "| layer 0 | 5 (62%) | 3 (38%) | 0 (0%) | 0 (0%) |" in section  # the last probe's expert selection
    assert "Not released" not in section
    png = (run_dir / "report" / "routing.png").read_bytes()
    assert png[:4] == b"\x89PNG" and len(png) > 5000
    tags = {t for t, *_ in scalars(run_dir)}
    assert {"probe/routing_kl", "probe/load_cv", "probe/top1_consistency"} <= tags
    assert not any("expert_counts" in t for t in tags)


def test_without_probe_rows_the_report_says_routing_is_not_released(tmp_path):
    md = write_report(_run(tmp_path, probes=False)).read_text()
    section = md[md.index("## Routing"):md.index("## Per-party")]
    assert "Not released" in section and "probe" not in section
