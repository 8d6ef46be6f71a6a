"""``bench/retention_fed_warm.py`` without running a federation: the data it writes (A's and B's files the same bytes
in every run of a seed, each party's fresh canary only in its own task file and canary list, at least 480 pooled
held-out items a task under the product's split), the pilot's choice of B's rounds, and the table (the pilot never
tabulated, a pilot that failed A's gate never used).

Must not: run the experiment (the bench does that).
"""

from __future__ import annotations

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
_spec = importlib.util.spec_from_file_location("retention_fed_warm_bench", _DIR / "retention_fed_warm.py")
warm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(warm)


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_task_files_repeat_exactly_and_the_canary_stays_out_of_them(tmp_path):
    one, two = (_files(ds[0].parent) for ds in (warm.write_data(tmp_path / "a", 3), warm.write_data(tmp_path / "b", 3)))
    tasks = [k for k in one if k.endswith(tuple(f"{t}.jsonl" for t in warm.TASKS))]
    assert len(tasks) == 2 * warm.PARTIES and all(one[k] == two[k] for k in tasks)
    for i in range(warm.PARTIES):
        secret = one[f"party-{i}/canaries.txt"].decode().strip()
        assert secret.startswith("canary-") and secret != two[f"party-{i}/canaries.txt"].decode().strip()
        holders = [k for k, v in one.items() if secret.encode() in v]
        assert holders == [f"party-{i}/canaries.txt", f"party-{i}/{warm.CANARY_TASK}.jsonl"]
    assert _files(warm.write_data(tmp_path / "c", 4)[0]) != _files(tmp_path / "a" / "party-0")  # another seed


def test_tasks_are_disjoint_tables_with_enough_pooled_held_out_items(tmp_path):
    cfg = DataConfig(eval_fraction=0.5, max_eval_examples=10**9, seed=0)
    parties = [load_party(d, cfg) for d in warm.write_data(tmp_path, 0)]
    a, b = warm.TASKS
    held = {t: [e for p in parties for e in p.heldout(t)] for t in (a, b)}
    train = {t: [e for p in parties for e in p.train(t)] for t in (a, b)}
    for t in (a, b):
        assert len(held[t]) + len(train[t]) == 12 * warm.KEYS
        assert len(held[t]) >= 480 and len(train[t]) >= 480
    keys = {t: {re.search(r"k\d+", e.prompt_messages[-1]["content"]).group() for e in held[t] + train[t]}
            for t in (a, b)}
    assert len(keys[a]) == len(keys[b]) == warm.KEYS and not keys[a] & keys[b]


def _row(arm: str, seed: int, acc_after: float, acc_before: float = 0.7) -> dict:
    curve = [{"b_round": 0, "acc_a": acc_before, "nll_a": 0.5, "acc_b": 0.0, "nll_b": 7.0},
             {"b_round": 1, "acc_a": acc_after, "nll_a": 1.5, "acc_b": 0.05, "nll_b": 2.0}]
    return {"arm": arm, "seed": seed, "hash_before": "h", "hash_after": f"{arm}{seed}", "n_a": 530, "n_b": 520,
            "acc_a_before": acc_before, "nll_a_before": 0.5, "acc_a_after": acc_after, "nll_a_after": 1.5,
            "acc_b_after": 0.05, "nll_b_after": 2.0, "wall_s": 150.0, "curve": curve, "load": [5.0, 6.0]}


def test_b_rounds_are_the_count_closest_to_half_kept():
    row = _row("none", 100, 0.0, acc_before=0.8)
    row["curve"] = [{"b_round": 0, "acc_a": 0.8}, {"b_round": 1, "acc_a": 0.6}, {"b_round": 2, "acc_a": 0.42},
                    {"b_round": 3, "acc_a": 0.1}]
    got = warm.b_choice(0.0, row)
    assert got["kept"] == pytest.approx({1: 0.75, 2: 0.525, 3: 0.125}) and got["b_rounds"] == 2
    assert got["a_gate"] and got["b_gate"]
    row["curve"] = row["curve"][:1] + [{"b_round": 1, "acc_a": 0.05}, {"b_round": 2, "acc_a": 0.0}]
    got = warm.b_choice(0.0, {**row, "acc_a_before": 0.4})  # A not learned, and B forgets it at once
    assert got["b_rounds"] == 1 and not got["b_gate"] and not got["a_gate"]


def test_table_uses_the_passing_pilot_and_never_tabulates_it(tmp_path):
    failed = {"pilot": _row("none", 100, 0.0, 0.3), "a_rounds": 8, "acc_a_initial": 0.0, "kept": {"1": 0.0},
              "a_gate": False, "b_gate": False, "b_rounds": 1}
    passed = {**failed, "pilot": _row("none", 100, 0.3, 0.7), "a_rounds": 12, "kept": {"1": 0.43}, "a_gate": True,
              "b_gate": True}
    (tmp_path / "pilot.json").write_text(json.dumps([failed]))
    with pytest.raises(SystemExit, match="no pilot passed A's gate"):
        warm.chosen(tmp_path)
    (tmp_path / "pilot.json").write_text(json.dumps([failed, passed]))
    assert warm.chosen(tmp_path)["a_rounds"] == 12
    for s in range(3):
        for arm, acc in (("none", 0.30), ("anchor", 0.31 + 0.001 * s), ("distillation", 0.45 + 0.01 * s)):
            (tmp_path / f"{arm}-s{s}").mkdir()
            (tmp_path / f"{arm}-s{s}" / "row.json").write_text(json.dumps(_row(arm, s, acc)))
    text = warm.table(tmp_path)
    assert "A = 12 rounds" in text and "B = 1 round(s)" in text and "Complete seeds: [0, 1, 2] (n = 3)" in text
    assert "Load (1-min average, 2 cores) at the runs' start and end: 5.0-6.0" in text
    assert "100" not in text.split("Complete seeds")[1].split("Per seed")[1]  # the pilot's seed is in no table
