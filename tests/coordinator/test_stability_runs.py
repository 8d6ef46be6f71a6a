"""A whole in-process run (three parties, secure aggregation on) with the stability details of a local step:
a NaN gradient step is skipped at the party and named in its own log, the skipped-step count never
reaches the coordinator (an exact count outside every DP account), and a per-tensor divergence of the aggregate
update is flagged as a warning in ``run.json``, the progress stream, ``metrics.jsonl`` and the report; the audit
still passes."""

from __future__ import annotations

import json

import pytest
import torch

import distmoe.train.sft as sft_mod
from distmoe.audit import audit_run
from distmoe.report.report import write_report

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GATE = "model.layers.0.mlp.gate.weight"


def _jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_nan_steps_are_named_and_counted_at_the_party_only_and_divergence_is_flagged(tmp_path, monkeypatch,
                                                                                      make_run):
    real, calls = sft_mod.sft_loss, []

    def poisoned(model, *args, **kwargs):  # every other local step of the run: finite loss, NaN gate gradient
        calls.append(1)
        loss, parts = real(model, *args, **kwargs)
        if len(calls) % 2 == 1:
            loss = loss + 0.0 * torch.sqrt(dict(model.named_parameters())[GATE].sum() * 0.0)
        return loss, parts

    monkeypatch.setattr(sft_mod, "sft_loss", poisoned)
    coord, _, run_dir, dirs, lines = make_run(tmp_path, {"schedule.phases": "sft:arith",
                                                         "federation.divergence-max": 1e-9})
    coord.run()
    poisoned_steps = (len(calls) + 1) // 2
    assert len(calls) == 6 and poisoned_steps == 3  # 3 parties x train.local-steps 2

    # the party's own metrics log names the parameter; the names never reach the coordinator's files
    party_lines = [row for d in dirs for row in _jsonl(run_dir / "work" / d.name / "metrics" / f"{d.name}.jsonl")]
    assert sum(row["skipped_steps"] for row in party_lines) == poisoned_steps
    for row in party_lines:
        if row["skipped_steps"] > 0:
            assert row["nonfinite_params"] == [GATE] and row["nonfinite_tensors"] == 1
    for f in ("metrics.jsonl", "run.json"):
        assert "nonfinite" not in (run_dir / f).read_text()

    # the count stays at the parties: an exact, uncharged integer would escape every DP account
    (train,) = [r for r in _jsonl(run_dir / "metrics.jsonl") if r["event"] == "train"]
    assert "skipped_steps" not in train and train["party"] == "all"
    assert not any("skipped NaN/Inf steps" in x for x in lines)

    # every applied tensor moved more than 1e-9: flagged as a warning, naming the tensors
    warn = [w for w in json.loads((run_dir / "run.json").read_text())["warnings"] if "update diverges" in w]
    assert len(warn) == 1 and warn[0].startswith("round 1: train update diverges: max|delta| above "
                                                 "federation.divergence-max = 1e-09")
    assert any("WARNING: train update diverges" in x for x in lines)
    (anomaly,) = [r for r in _jsonl(run_dir / "metrics.jsonl") if r["event"] == "anomaly"]
    assert anomaly["kind"] == "train" and "update diverges" in anomaly["detail"]
    report = write_report(run_dir).read_text()
    assert "update diverges" in report
    result = audit_run(run_dir)
    assert result.verdict == "pass", [(c.name, c.findings) for c in result.checks if c.status == "fail"]
