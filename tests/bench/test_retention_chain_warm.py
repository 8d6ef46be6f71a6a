"""``bench/retention_chain_warm.py`` without running a federation: the chain's schedule, the runner's cut-off clock,
the three disjoint tasks it writes (each party's canary only in its own vault file and canary list), and the tables
(the secondary two-task quantity, a seed cut off before every arm ran left out, the pilot never tabulated).

Must not: run the experiment (the bench does that).
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from distmoe.config import DataConfig
from distmoe.data.party import load_party

_DIR = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(_DIR))
_spec = importlib.util.spec_from_file_location("retention_chain_warm_bench", _DIR / "retention_chain_warm.py")
warm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(warm)

NLL = [[1.0, 5.0, 6.0], [2.0, 1.0, 6.0], [3.0, 4.0, 1.0]]


def test_the_schedule_has_a_stats_round_before_t2_and_t3_and_an_eval_after_each_task():
    assert warm.phases((8, 1, 1)) == ("sft:lookup-t1*8, eval, stats:lookup-t1, sft:lookup-t2*1, eval, "
                                      "stats:lookup-t2, sft:lookup-t3*1, eval")
    for bad in ((8, 1), (8, 0, 1)):
        with pytest.raises(ValueError, match="round counts"):
            warm.phases(bad)


def test_the_cut_off_counts_down_in_utc_and_goes_negative_once_past():
    now = dt.datetime(2026, 12, 7, 3, 30, tzinfo=dt.UTC)
    assert warm.seconds_left("2026-12-07T04:30", now) == 3600.0
    assert warm.seconds_left("2026-12-07T03:29", now) == -60.0
    with pytest.raises(ValueError):
        warm.seconds_left("half past four", now)


def test_three_disjoint_tasks_with_the_canary_only_in_the_vault(tmp_path):
    cfg = DataConfig(eval_fraction=0.5, max_eval_examples=10**9, seed=0)
    dirs = warm.fw.write_data(tmp_path, 0, warm.TASKS)
    parties = [load_party(d, cfg) for d in dirs]
    keys = {}
    for t in warm.TASKS:
        items = [e for p in parties for e in p.heldout(t) + p.train(t)]
        assert len(items) == 12 * warm.fw.KEYS and len([e for p in parties for e in p.heldout(t)]) >= 480
        keys[t] = {re.search(r"k\d+", e.prompt_messages[-1]["content"]).group() for e in items}
    a, b, c = (keys[t] for t in warm.TASKS)
    assert len(a) == len(b) == len(c) == warm.fw.KEYS and not (a & b or a & c or b & c)
    for d in dirs:
        secret = (d / "canaries.txt").read_text().strip()
        assert [p.name for p in sorted(d.iterdir()) if secret in p.read_text()] == ["canaries.txt", "vault.jsonl"]


def _row(arm: str, seed: int, t1_after_t2: float, forget: float) -> dict:
    keep = 0.6 - forget
    acc = [[0.6, 0.0, 0.0], [t1_after_t2, 0.6, 0.0], [keep, keep, 0.6]]
    ev = {"hashes": ["h", f"{arm}{seed}b", f"{arm}{seed}c"], "acc_matrix": acc, "nll_matrix": NLL, "n": [528] * 3}
    return {**warm.rch.row_of(arm, seed, ev), "a_after_t2": t1_after_t2, "wall_s": 400.0, "load": [5.0, 7.5]}


def test_tables_give_the_two_task_quantity_and_leave_out_a_cut_off_seed_and_the_pilot(tmp_path):
    rows = []
    for s in range(4):
        j = 0.01 * (s % 2)
        rows += [_row("none", s, 0.3 + j, 0.5), _row("anchors", s, 0.3 + j, 0.5), _row("distillation", s, 0.4, 0.3)]
    for r in rows[:-1]:  # seed 3's distillation never ran
        (tmp_path / f"{r['arm']}-s{r['seed']}").mkdir()
        (tmp_path / f"{r['arm']}-s{r['seed']}" / "row.json").write_text(json.dumps(r))
    (tmp_path / "pilot.json").write_text(json.dumps([{**_row("anchors", 100, 0.9, 0.0)}]))
    text = warm.table(tmp_path)
    assert "Complete seeds: [0, 1, 2] (n = 3); cut off before every arm ran: [3]" in text
    assert "| lookup-t3 | 0.100 | 0.100 | 0.600 |" in text  # none's last row
    assert "| anchors | 0.303 ± 0.006 | +0.000 [+0.000, +0.000] | 3.000 ± 0.000 | 4.000 ± 0.000 |" in text
    assert "| distillation | 0.400 ± 0.000 | +0.097" in text  # T1 after T2: 0.4 vs none's 0.3 / 0.31 / 0.3
    assert "s100" not in text and "Load (1-min average, 2 shared cores) at the runs' start and end: 5.0-7.5." in text
