"""Whole secure in-process runs: the training metrics released as slots of the model-update secure sum.

The decoded mean equals the mean of the parties' own logged figures (within the ring's rounding); a party whose
figure is huge, infinite or NaN cannot move the released mean beyond the slot's bound (its clip, and behind it the
coordinator's bound check); a round with fewer contributors than ``privacy.min-parties`` releases no metric.
"""

from __future__ import annotations

import json
import math

import pytest

from distmoe.audit import audit_run
from distmoe.privacy import train_metrics as TM
from distmoe.report.report import write_report
from distmoe.report.tensorboard import scalars

pytestmark = pytest.mark.integration  # every test here judges a whole in-process run

BOUND = 16.0  # privacy.metric-loss-bound (default): the task-loss slot's bound


def _train_rows(run_dir, event="train"):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return [r for r in rows if r.get("event") == event and r.get("party") == "all"]


def _own(run_dir, dirs):
    """Each party's own metrics log: ``{party: {round: line}}``."""
    out = {}
    for d in dirs:
        lines = (run_dir / "work" / d.name / "metrics" / f"{d.name}.jsonl").read_text().splitlines()
        out[d.name] = {json.loads(x)["round"]: json.loads(x) for x in lines if x}
    return out


def _tolerance(rel) -> float:
    """One rounding unit per contributor of the task-loss slot, in loss units (no update noise)."""
    return BOUND / (10.0 * 2.0 ** rel["info"]["frac_bits"])  # a = max(update-clip, 1) / B, update-clip = 10


def test_decoded_mean_loss_is_the_mean_of_the_parties_own_losses(tmp_path, make_run, releases):
    coord, _, run_dir, dirs, lines = make_run(tmp_path, {"schedule.phases": "sft:arith*2"})
    coord.run()
    rows, own, rels = _train_rows(run_dir), _own(run_dir, dirs), releases(run_dir, "model-update")
    assert [r["round"] for r in rows] == [1, 2] and len(rels) == 2
    for row, rel in zip(rows, rels, strict=True):
        mine = [own[p][row["round"]]["task_loss"] for p in own]
        assert row["contributors"] == 3 and all(math.isfinite(x) for x in mine)
        assert abs(row["task_loss"] - sum(mine) / 3) <= _tolerance(rel), (row["task_loss"], mine)
        assert rel["info"]["metric_slots"] == [["task_loss", 0.0, BOUND]]
    assert all(f"task loss {r['task_loss']:.3f}" in "\n".join(lines) for r in rows)  # the round line
    assert "no router-statistics release" in "\n".join(lines)  # the header, not 'z = 0.000 over 0 release(s)'
    assert [(t, step) for t, step, _, _ in scalars(run_dir) if t == "train/task_loss"] == [("train/task_loss", 1),
                                                                                           ("train/task_loss", 2)]
    assert "mean task loss†" in write_report(run_dir).read_text()  # the report's train table (and loss.png)
    result = audit_run(run_dir)  # the metrics row and the release entry pass the audit's schemas
    assert result.verdict == "pass", [(c.name, c.findings) for c in result.checks if c.status == "fail"]


def _lie(monkeypatch, value, party="party-0"):
    """``party`` reports ``value`` as its task loss (its training is otherwise honest)."""
    from distmoe.party import work

    real = work.run_sft

    def lying(cfg, node, instr, loaded=None):
        upd = real(cfg, node, instr, loaded)
        if node.party == party:
            upd.metrics["task_loss"] = value
        return upd

    monkeypatch.setattr(work, "run_sft", lying)


@pytest.mark.parametrize("value", [1e30, math.inf, math.nan, -1e30])
def test_a_huge_or_non_finite_loss_cannot_move_the_mean_beyond_its_bound(tmp_path, monkeypatch, make_run, releases,
                                                                        value):
    """The party's clip: +huge, +inf and NaN count as the bound (16), -huge as 0. Without the clip, the 1e30 and inf
    vectors cannot be encoded (the party fails, the round has 2 contributors) and NaN is refused by the encoder."""
    _lie(monkeypatch, value)
    coord, _, run_dir, dirs, _ = make_run(tmp_path, {"schedule.phases": "sft:arith"})
    coord.run()
    (row,) = _train_rows(run_dir)
    (rel,) = releases(run_dir, "model-update")
    own = _own(run_dir, dirs)
    honest = [own[p][1]["task_loss"] for p in ("party-1", "party-2")]
    clipped = 0.0 if value < 0 else BOUND
    assert row["contributors"] == 3 and own["party-0"][1]["released_task_loss"] == clipped
    assert abs(row["task_loss"] - (clipped + sum(honest)) / 3) <= _tolerance(rel)
    assert 0.0 <= row["task_loss"] <= BOUND


def test_an_unclipped_loss_beyond_its_bound_is_refused_by_the_coordinator(tmp_path, monkeypatch, make_run, releases):
    """A party that skips its clip (here: the clip removed) and sends a loss of 60 (it still fits a 32-bit word): the
    slot's sum is beyond what 3 contributors at <= 16 can produce, so the coordinator rejects the whole sum (model
    unchanged, no metric)."""
    _lie(monkeypatch, 60.0)
    monkeypatch.setattr(TM, "clip_value", lambda slot, v: float(v))
    coord, _, run_dir, _, lines = make_run(tmp_path, {"schedule.phases": "sft:arith"})
    coord.run()
    (rel,) = releases(run_dir, "model-update")
    assert rel["info"]["applied"] is False and "training-metric slot task_loss" in rel["verdict"]
    assert all("task_loss" not in r for r in _train_rows(run_dir))
    assert any("rejected" in x and "task_loss" in x for x in lines)


def test_fewer_contributors_than_min_parties_release_no_metric(tmp_path, make_run, releases):
    """Only party-0 holds the task: 1 contributor < privacy.min-parties = 2, so the sum (and its metric slots) is
    never unmasked: no release, no training figure in metrics.jsonl."""
    coord, _, run_dir, dirs, _ = make_run(tmp_path, {"schedule.phases": "sft:arith"})
    for d in dirs[1:]:
        (d / "arith.jsonl").unlink()
    coord.run()
    assert releases(run_dir, "model-update") == []
    assert _own(run_dir, dirs)["party-0"][1]["released_task_loss"] > 0  # it did encode its figure
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    assert not any("task_loss" in r for r in rows)


def test_rl_figures_under_update_noise_are_noised_and_audited(tmp_path, make_run, releases):
    """RL slots with client-level DP on updates: the figures carry the update noise (the round line gives its std),
    the release's sensitivity stays the clip, and the audit passes (the accounting is unchanged)."""
    coord, _, run_dir, _, lines = make_run(tmp_path, {"schedule.phases": "rl:arith",
                                                      "privacy.update-noise-multiplier": 5.0})
    coord.run()
    (row,) = _train_rows(run_dir, "rl")
    (rel,) = releases(run_dir, "rl-update")
    assert {"reward", "masked_frac_low", "masked_frac_high", "k3", "logp_diff_mean"} <= set(row)
    assert rel["dp"]["metric_slots"] == 5 and rel["dp"]["sensitivity"] == pytest.approx(rel["dp"]["clip"])
    assert rel["dp"]["delta_clip"] == pytest.approx(rel["dp"]["clip"] * math.sqrt(1 - 0.25**2))
    # the RL round line: each noised figure with its std, or "≈ 0 (within noise)" where the noise (fresh each run,
    # never seeded) covers it; at noise multiplier 5 a run can draw every figure within noise
    assert any("reward " in x and (" ± " in x or "reward ≈ 0 (within noise)" in x) for x in lines)
    # each figure's noise std beside it in metrics.jsonl, so the report and TensorBoard show its scale too
    keys = ("reward", "masked_frac_low", "masked_frac_high", "k3", "logp_diff_mean")
    assert all(row[f"{k}_sd"] > 0 for k in keys), row
    assert ("rl/reward_sd", row["round"]) in {(t, step) for t, step, _, _ in scalars(run_dir)}
    rl = write_report(run_dir).read_text().split("## RL rounds (aggregate)")[1]
    assert " ± " in rl or "≈ 0 (within noise)" in rl
    result = audit_run(run_dir)  # the _sd keys pass the audit's metrics schema
    assert result.verdict == "pass", [(c.name, c.findings) for c in result.checks if c.status == "fail"]
