"""``bench/continual_anchor.py``'s local-replay data mixer: the party's own task-A training examples join its
task-B file, no held-out example of either task is trained on, and the evaluated task-B set is unchanged; its
kept rows rebuild the table; every arm is a valid run config.

Must not: run the experiment (the bench does that).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from distmoe.config import parse_run_config
from distmoe.data.formats import read_jsonl
from distmoe.data.party import load_party
from distmoe.data.synth import write_synthetic

_PATH = Path(__file__).resolve().parents[2] / "bench" / "continual_anchor.py"
_spec = importlib.util.spec_from_file_location("continual_anchor_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize(("old", "new", "seed", "n", "max_eval"),
                         [("lookup", "arith", 0, 240, 48), ("arith", "lookup", 3, 120, 10)])
def test_mix_replay_adds_only_own_training_examples(tmp_path, old, new, seed, n, max_eval):
    data = parse_run_config({"run.seed": seed, "data.max-eval-examples": max_eval}).data
    party = write_synthetic(tmp_path, parties=2, examples_per_task=n, seed=seed, canaries=1)[1]
    before = load_party(party, data)
    own_lines = read_jsonl(party / f"{new}.jsonl")
    counts = bench.mix_replay(party, old, new, data)
    after = load_party(party, data)
    assert after.heldout(new) == before.heldout(new)  # the evaluated task-B set is the same examples
    assert after.heldout(old) == before.heldout(old)  # task A's file is untouched
    mixed = read_jsonl(party / f"{new}.jsonl")
    assert mixed[: len(own_lines)] == own_lines
    added = mixed[len(own_lines):]
    old_train = set(before.train(old))
    assert added and set(added) <= old_train  # only this party's own task-A training examples
    assert counts["replayed"] == len(added) and counts["dropped"] == len(before.train(old)) - len(added)
    trained = set(after.train(new))
    assert not trained & set(before.heldout(old)) and not trained & set(before.heldout(new))  # nothing held out trained
    own = set(own_lines)  # examples may repeat within a task: count lines
    assert counts["new_train"] == sum(e in own for e in after.train(new)) <= counts["new_train_before"]
    assert sum(e in old_train for e in after.train(new)) == len(added)  # every replayed example is trained on


def test_mix_replay_keeps_the_evaluated_held_out_set(tmp_path):
    """With the data-independent split, replaying another task's training examples into a task file never moves
    one of its own examples: the evaluated held-out set stays the same (the replay refuses otherwise)."""
    data = parse_run_config({"run.seed": 0, "data.max-eval-examples": 1000}).data  # every held-out example counts
    party = write_synthetic(tmp_path, parties=1, examples_per_task=120, seed=0)[0]
    before = load_party(party, data).heldout("arith")
    counts = bench.mix_replay(party, "lookup", "arith", data)
    assert counts["replayed"] > 0 and load_party(party, data).heldout("arith") == before


def test_kept_rows_in_the_repository_rebuild_the_table(tmp_path):
    """``keep_row`` copies a finished run's row and bench.json; ``--collect`` over the kept rows tabulates them
    under their own arm and order, and a directory holding only a row (no bench.json) is not taken."""
    import json

    rows = {}
    for seed, ret in ((0, 0.25), (1, 0.75)):
        run = tmp_path / "runs" / f"expansion-arith-lookup-s{seed}"
        run.mkdir(parents=True)
        row = {"retention of A (arith)": ret, "accuracy B (lookup)": 0.5, "wall time (s)": 90.0, "seed": float(seed),
               "anchor-kl-coef": 0.0}
        bench.write_bench_file(run, "bench.json", json.dumps({"arm": "expansion", "order": "arith-lookup",
                                                              "seed": seed}))  # beside the run directory
        kept = bench.keep_row(run, row, tmp_path / "kept")
        assert kept == tmp_path / "kept" / run.name and bench._completed(kept)
        rows.setdefault(bench._arm_of(kept, bench.row_of(kept)), []).append(bench.row_of(kept))
    lone = tmp_path / "kept" / "lone-s0"
    lone.mkdir()
    (lone / "row.json").write_text("{}")
    assert not bench._completed(lone)
    assert list(rows) == [("expansion", "arith-lookup")]
    text = bench.table({"expansion": rows[("expansion", "arith-lookup")]})
    assert "| retention of A (arith) | 0.500 ± 0.354 (0.250, 0.750) |" in text


@pytest.mark.parametrize("arm", sorted({*bench.ARMS, *bench.RETENTION_ARMS}))
def test_every_arm_is_a_valid_run_config_in_both_orders(arm):
    """Each arm's overrides (config file, schedule, switches, the sweep's extra settings) parse into a run config,
    with the arm's switch in it: a typo in an arm fails here, not after an hour of sweep."""
    extra = "train.local-steps=20 train.batch-size=16 train.threads=1"
    for order in bench.ORDERS:
        over = bench.overrides_of(arm, 0, order, extra, (3, 3))
        cfg = parse_run_config(over)
        a, b = bench.ORDERS[order]
        sft = [(ph.task, ph.rounds) for ph in cfg.schedule.phases if ph.kind == "sft"]
        assert sft == [(a, 3), (b, 3)]
        if arm.startswith("balance-"):
            assert cfg.routing.balance == "bias"
            assert cfg.routing.balance_count == ("first" if arm.startswith("balance-first") else "topk")
        # the kept rows were measured with distillation off unless the arm turns it on (it is the default now)
        distills = "distill-weight" in bench.RETENTION_ARMS.get(arm, ("", ""))[1]
        assert (cfg.retention.distill_weight > 0) == distills, arm
