"""``bench/retention_fed.py``'s analysis on tiny synthetic rows: whole seeds only, the pairing check through task A,
the paired tests with Holm over the two arm-vs-none tests and the claim rule, the equal-B-loss reading, and the
checkpoint chain it evaluates (one entry per distinct model, from the model kept before B).

Must not: run the experiment (the bench does that).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_DIR = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(_DIR))
_spec = importlib.util.spec_from_file_location("retention_fed_bench", _DIR / "retention_fed.py")
fed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fed)


def _row(arm: str, seed: int, acc_after: float, nll_after: float = 4.0, hash_before: str = "h", acc_before=0.3):
    curve = [{"b_round": 0, "acc_a": acc_before, "nll_a": 1.0, "acc_b": 0.0, "nll_b": 3.0},
             {"b_round": 1, "acc_a": acc_after, "nll_a": nll_after, "acc_b": 0.2, "nll_b": 1.0}]
    return {"arm": arm, "seed": seed, "hash_before": hash_before, "hash_after": f"{arm}{seed}", "n_a": 144,
            "n_b": 150, "acc_a_before": acc_before, "nll_a_before": 1.0, "acc_a_after": acc_after,
            "nll_a_after": nll_after, "acc_b_after": 0.2, "nll_b_after": 1.0, "wall_s": 100.0, "curve": curve}


def _rows(n: int = 10, gain: float = 0.1) -> list[dict]:
    rows = []
    for s in range(n):
        jitter = 0.01 * ((s % 3) - 1)
        rows += [_row("none", s, 0.05), _row("anchor", s, 0.05 + (0.002 if s % 2 else -0.002)),
                 _row("distillation", s, 0.05 + gain + jitter, nll_after=2.0)]
    return rows


def test_a_clear_gain_is_claimed_and_a_null_arm_is_not():
    rows = _rows()
    res = fed.compare(rows, list(range(10)), "acc_a_after")
    assert res["distillation"]["mean"] == pytest.approx(0.099)  # 0.1 + jitter (4 x -0.01, 3 x +0.01) / 10
    assert res["distillation"]["claimed"] == 1.0 and res["distillation"]["adj_lo"] > 0
    assert res["anchor"]["claimed"] == 0.0 and res["anchor"]["adj_lo"] < 0 < res["anchor"]["adj_hi"]
    # Holm over 2 tests: the smaller p is doubled, the larger kept (but never below the smaller adjusted one)
    assert res["distillation"]["p_t_holm"] == pytest.approx(min(1.0, 2 * res["distillation"]["p_t"]))
    assert res["anchor"]["p_t_holm"] == pytest.approx(max(res["anchor"]["p_t"], res["distillation"]["p_t_holm"]))


def test_holm_can_withdraw_a_claim_the_uncorrected_test_makes():
    # a gain with the smaller p (0.034) of the two: Holm doubles it (0.068), so the claim falls although the
    # unadjusted interval excludes 0; the other arm's p (1.0) is the larger one and stays as it is
    diffs = {"anchor": [0.01, -0.02, 0.03, -0.01, 0.0, 0.02, -0.03, 0.01, 0.0, -0.01],
             "distillation": [0.05, -0.02, 0.04, 0.06, -0.01, 0.05, 0.03, 0.0, 0.06, -0.01]}
    res = fed.e1_stats.compare_arms(diffs)
    assert res["distillation"]["p_t"] < 0.05 < res["distillation"]["p_t_holm"]
    assert res["distillation"]["p_t_holm"] == pytest.approx(2 * res["distillation"]["p_t"])
    assert res["distillation"]["claimed"] == 0.0 and res["distillation"]["lo"] > 0 > res["distillation"]["adj_lo"]
    assert res["anchor"]["p_t_holm"] == pytest.approx(1.0)


def test_a_seed_missing_an_arm_is_left_out_and_named():
    rows = _rows(4)
    rows = [r for r in rows if not (r["seed"] == 3 and r["arm"] == "distillation")]
    assert fed.complete_seeds(rows) == ([0, 1, 2], [3])
    text = fed.tables(rows)
    assert "Complete seeds: [0, 1, 2] (n = 3); cut off before every arm ran: [3]" in text


def test_pairing_is_reported_exact_or_names_the_seed_that_is_not():
    rows = _rows(3)
    assert fed.pairing(rows, [0, 1, 2]) == []
    assert "exact on every seed" in fed.tables(rows)
    rows[4] = {**rows[4], "hash_before": "other", "acc_a_before": 0.31}  # seed 1's anchor started B elsewhere
    bad = fed.pairing(rows, [0, 1, 2])
    assert len(bad) == 1 and bad[0].startswith("s1:")
    assert "NOT exact: s1:" in fed.tables(rows)


def test_tables_mark_the_claim_in_the_distillation_column_only():
    text = fed.tables(_rows())
    line = next(x for x in text.splitlines() if x.startswith("| A accuracy after B |"))
    anchor_cell, distill_cell = line.split(" | ")[1:3]
    assert "**claimed**" in distill_cell and "**claimed**" not in anchor_cell


def test_equal_loss_reads_a_at_the_common_b_nll():
    rows = _rows(2)
    for r in rows:  # distillation learns B more slowly: final B NLL 2.0 (the target); the others pass it halfway
        if r["arm"] == "distillation":
            r["nll_b_after"] = r["curve"][1]["nll_b"] = 2.0
    by = {(r["seed"], r["arm"]): r for r in rows}
    d = fed.equal_loss(by, [0, 1])
    # none at B NLL 2.0 lies halfway from (3.0, 0.3) to (1.0, 0.05): A acc 0.175; distillation ends at 2.0
    assert d["distillation"][0] == pytest.approx(rows[2]["acc_a_after"] - 0.175)
    assert d["anchor"][0] == pytest.approx((0.3 + rows[1]["acc_a_after"]) / 2 - 0.175)


def test_checkpoint_chain_starts_before_b_and_skips_a_repeated_model(tmp_path):
    kept = {0: ("initial model", "h0"), 3: ("", "h3"), 5: ("before task arith", "h5"), 6: ("", "h6"),
            7: ("", "h7"), 8: ("", "h7")}  # round 8: the eval after B keeps B's last model again
    for r, (label, h) in kept.items():
        d = tmp_path / "checkpoints" / f"round-{r}"
        d.mkdir(parents=True)
        (d / "manifest.json").write_text(json.dumps({"round": r, "kept": label, "trainable_hash": h}))
    before, chain = fed._checkpoints(tmp_path, "arith")
    assert before["round"] == 5
    assert [m["round"] for m, _ in chain] == [5, 6, 7]
    with pytest.raises(SystemExit, match="before task lookup"):
        fed._checkpoints(tmp_path, "lookup")


def test_a_repeat_of_a_seed_not_run_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(SystemExit, match="--repeat 5: not among --seeds"):
        fed.run([0, 1], tmp_path / "runs", tmp_path / "keep", [5])
    assert not (tmp_path / "runs").exists() and not (tmp_path / "keep").exists()
