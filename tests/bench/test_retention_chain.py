"""``bench/retention_chain.py``'s analysis on tiny synthetic rows: ACC, BWT and the old tasks' NLL from an accuracy
matrix worked by hand, whole seeds only, the pairing check through T1, the paired Holm tests and the claim rule, and
the model-after-each-task lookup over a run's checkpoint manifests.

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
_spec = importlib.util.spec_from_file_location("retention_chain_bench", _DIR / "retention_chain.py")
chain = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chain)

NLL = [[1.0, 5.0, 6.0], [7.0, 1.0, 6.0], [8.0, 4.0, 1.0]]


def _acc(forget: float) -> list[list[float]]:
    """Each task learned to 0.6 on its diagonal; T1 and T2 keep 0.6 - forget after T3."""
    keep = 0.6 - forget
    return [[0.6, 0.0, 0.0], [keep, 0.6, 0.0], [keep, keep, 0.6]]


def _row(arm: str, seed: int, forget: float, h0: str = "h") -> dict:
    acc = _acc(forget)
    ev = {"hashes": [h0, f"{arm}{seed}b", f"{arm}{seed}c"], "acc_matrix": acc, "nll_matrix": NLL, "n": [132, 144, 120]}
    return {**chain.row_of(arm, seed, ev), "wall_s": 200.0}


def _rows(n: int = 6) -> list[dict]:
    rows = []
    for s in range(n):
        jitter = 0.01 * ((s % 3) - 1)
        rows += [_row("none", s, 0.5), _row("anchors", s, 0.5 + (0.002 if s % 2 else -0.002)),
                 _row("distillation", s, 0.3 + jitter)]
    return rows


def test_endpoints_match_the_matrix_worked_by_hand():
    acc = [[0.5, 0.1, 0.0], [0.2, 0.4, 0.0], [0.1, 0.3, 0.6]]
    e = chain.endpoints(acc, NLL)
    assert e["acc"] == pytest.approx((0.1 + 0.3 + 0.6) / 3)
    assert e["bwt"] == pytest.approx(((0.1 - 0.5) + (0.3 - 0.4)) / 2)  # the last task's own column is left out
    assert e["nll_old"] == pytest.approx((8.0 + 4.0) / 2)
    with pytest.raises(ValueError, match="square"):
        chain.endpoints([[0.5, 0.1], [0.2]], NLL)


def test_a_clear_gain_is_claimed_and_a_null_arm_is_not():
    rows = _rows()
    by = {(r["seed"], r["arm"]): r for r in rows}
    res = chain.compare(by, list(range(6)), "bwt")
    assert res["distillation"]["mean"] == pytest.approx(0.2)  # forgetting 0.3 (± 0.01, mean 0) vs none's 0.5
    assert res["distillation"]["claimed"] == 1.0 and res["distillation"]["adj_lo"] > 0
    assert res["anchors"]["claimed"] == 0.0 and res["anchors"]["adj_lo"] < 0 < res["anchors"]["adj_hi"]
    acc = chain.compare(by, list(range(6)), "acc")  # two of three columns gain 0.2
    assert acc["distillation"]["mean"] == pytest.approx(0.2 * 2 / 3)


def test_tables_show_the_matrix_and_leave_out_a_cut_off_seed():
    rows = [r for r in _rows(4) if not (r["seed"] == 3 and r["arm"] == "distillation")]
    text = chain.tables(rows)
    assert "Complete seeds: [0, 1, 2] (n = 3); cut off before every arm ran: [3]" in text
    assert "Pairing through T1 (model after T1: the same trainable hash in every arm of a seed): exact" in text
    assert "| strings | 0.100 | 0.100 | 0.600 |" in text  # none's last row: 0.6 - 0.5 on T1 and T2
    assert "**claimed**" in text  # distillation's BWT gain over 3 seeds
    rows[1] = {**rows[1], "hashes": ["other", *rows[1]["hashes"][1:]]}  # seed 0's anchors started T2 elsewhere
    assert "NOT exact on s0" in chain.tables(rows)
    assert chain.tables(rows[:3]).startswith("fewer than 2 complete seeds ([0])")


def test_task_models_are_the_kept_checkpoints_before_t2_and_t3_and_the_last(tmp_path):
    kept = {1: "", 3: "before task arith", 4: "", 7: "before task strings", 9: "", 10: ""}
    for rnd, why in kept.items():
        d = tmp_path / "checkpoints" / f"round-{rnd:05d}"
        d.mkdir(parents=True)
        (d / "manifest.json").write_text(json.dumps({"round": rnd, "trainable_hash": f"h{rnd}",
                                                     **({"kept": why} if why else {})}))
    assert [m["round"] for m, _ in chain.task_models(tmp_path)] == [3, 7, 10]
    (tmp_path / "checkpoints" / "round-00007" / "manifest.json").write_text(json.dumps({"round": 7}))
    with pytest.raises(SystemExit, match="before task strings"):
        chain.task_models(tmp_path)
