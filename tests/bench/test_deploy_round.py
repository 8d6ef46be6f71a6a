"""``bench/deploy_round.py``'s alternating order and its pairs: with ``--abba`` every second repetition runs the arms in
the reverse order (a floor still right after distmoe's arm, whose messages it replays); each repetition is one pair of
distmoe and simulated, read from the kept runs (ledger and metrics files as the arms wrote them); a run whose
parties replied with errors or whose rounds released nothing is left out of the pairs."""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path

import pytest
from scipy import stats as sps

_BENCH = Path(__file__).resolve().parents[2] / "bench"
_KEPT = _BENCH / "results" / "deploy-round-walkthrough"
sys.path.insert(0, str(_BENCH))
import deploy_round  # noqa: E402


def test_abba_reverses_every_second_repetition_and_keeps_each_floor_after_distmoe():
    two = ["distmoe", "simulated"]
    assert [deploy_round.arm_order(two, rep, True) for rep in (1, 2, 3, 4)] == [
        two, two[::-1], two, two[::-1]]
    assert deploy_round.arm_order(two, 2, False) == two
    every = ["distmoe", "floor-cut", "simulated", "floor-stock"]
    assert deploy_round.arm_order(every, 2, True) == ["simulated", "distmoe", "floor-cut", "floor-stock"]


def test_the_mean_interval_is_students_t():
    xs = [1.31, 1.52, 1.44, 1.38]
    mean, lo, hi = deploy_round.mean_interval(xs)
    half = sps.t.ppf(0.975, 3) * statistics.stdev(xs) / 2
    assert abs(mean - statistics.fmean(xs)) < 1e-12
    assert abs(lo - (mean - half)) < 1e-12 and abs(hi - (mean + half)) < 1e-12
    assert deploy_round.mean_interval([1.4]) == (1.4, None, None)


def _kept(tmp_path: Path, scale: float, fault: bool) -> Path:
    """Two repetitions of the kept walkthrough runs, the second's simulated rounds ``scale`` times as long."""
    root = tmp_path / "kept"
    res = json.loads((_KEPT / "bench.json").read_text())
    arms = [a for a in res["reps"][0]["arms"] if a["arm"] in ("distmoe", "simulated")]
    reps = []
    for rep in (1, 2):
        out = []
        for a in arms if rep == 1 else arms[::-1]:
            name = f"{a['arm']}-{rep}"
            shutil.copytree(_KEPT / a["dir"], root / name)
            out.append({**a, "dir": name, "load_mean": 5.0 + rep})
        reps.append({"rep": rep, "arms": out})
    sim2 = root / "simulated-2"
    files = {rel: [json.loads(x) for x in (sim2 / rel).read_text().splitlines() if x.strip()]
             for rel in ("metrics.jsonl", "ledger/coordinator.jsonl")}
    t0 = min(e["time"] for lines in files.values() for e in lines if "time" in e)
    for rel, lines in files.items():  # every time stretched about the run's start
        for e in lines:
            if "time" in e:
                e["time"] = t0 + (e["time"] - t0) * scale
        if fault and rel == "metrics.jsonl":
            lines.insert(2, {"event": "party_error", "round": 1, "code": "withheld", "time": t0})
        (sim2 / rel).write_text("".join(json.dumps(e) + "\n" for e in lines))
    (root / "bench.json").write_text(json.dumps({**res, "abba": True, "reps": reps}))
    return root


def test_each_repetition_is_a_pair_in_its_own_order_with_its_load(tmp_path: Path, capsys):
    root = _kept(tmp_path, 2.0, fault=False)
    pairs = deploy_round.pair_ratios(root, json.loads((root / "bench.json").read_text()))
    assert [p["order"] for p in pairs] == [["distmoe", "simulated"], ["simulated", "distmoe"]]
    assert abs(pairs[0]["ratio"] - 191.19 / 134.45) < 0.01  # the published table's rounds >= 1
    assert abs(pairs[1]["ratio"] - pairs[0]["ratio"] / 2) < 0.01
    assert pairs[1]["loads"] == {"distmoe": 7.0, "simulated": 7.0}
    deploy_round.report(root)
    out = capsys.readouterr().out
    mean = (pairs[0]["ratio"] + pairs[1]["ratio"]) / 2
    assert f"mean distmoe / simulated over 2 pairs: {mean:.2f}x, 95 % t-interval" in out, out


def test_a_run_whose_parties_refused_is_left_out_of_the_pairs(tmp_path: Path, capsys):
    root = _kept(tmp_path, 1.0, fault=True)
    pairs = deploy_round.pair_ratios(root, json.loads((root / "bench.json").read_text()))
    assert [p["rep"] for p in pairs] == [1]
    deploy_round.report(root)
    assert "warning: simulated-2: 1 party error replies (withheld)" in capsys.readouterr().out


def test_the_kept_abba_rows_rebuild_the_published_pairs(capsys):
    root = _BENCH / "results" / "deploy-round-walkthrough-abba"
    pairs = deploy_round.pair_ratios(root, json.loads((root / "bench.json").read_text()))
    assert [(p["order"][0], round(p["ratio"], 2)) for p in pairs] == [("distmoe", 1.51), ("simulated", 2.34)]
    assert [round(p["loads"]["distmoe"], 1) for p in pairs] == [11.2, 15.0]
    deploy_round.report(root)
    assert "mean distmoe / simulated over 2 pairs: 1.93x" in capsys.readouterr().out


def test_the_kept_quiet_rows_rebuild_the_published_pairs_and_the_floor_table(capsys):
    """The pairs alone on the machine (four, ABBA) and the invocation of distmoe against Flower's floor without a
    simulated arm: ``--table`` prints both from the kept rows (before, an invocation without the simulated arm
    printed no table)."""
    root = _BENCH / "results" / "deploy-round-walkthrough-abba-quiet"
    pairs = deploy_round.pair_ratios(root, json.loads((root / "bench.json").read_text()))
    assert [round(p["ratio"], 2) for p in pairs] == [2.31, 2.25, 2.32, 2.06]
    deploy_round.report(root)
    assert "mean distmoe / simulated over 4 pairs: 2.24x, 95 % t-interval [2.04, 2.43]" in capsys.readouterr().out
    deploy_round.report(_BENCH / "results" / "deploy-round-floor-quiet")
    out = capsys.readouterr().out
    total = next(line for line in out.splitlines() if line.startswith(" >= 1"))
    assert total.split()[3:6] == ["-", "196.00", "100.38"] and "1.95x" in total


@pytest.mark.parametrize("kept, ratios, mean", [
    # the coordinator's SuperLink kept message content in memory (``server.superlink``)
    ("deploy-round-walkthrough-abba-memstore", [1.84, 1.80, 1.99, 1.85], "1.87x, 95 % t-interval [1.74, 2.00]"),
    # then each owner's SuperExec woken by its SuperNode at a task instead of polling every 50 ms (clients.superexec)
    ("deploy-round-walkthrough-abba-wake", [1.66, 1.67, 1.81, 2.12], "1.81x, 95 % t-interval [1.47, 2.15]"),
    # then the SuperLink's link state in memory too, the SuperNode registrations written through to its database
    ("deploy-round-walkthrough-abba-linkmem", [1.45, 1.48, 1.65, 1.46], "1.51x, 95 % t-interval [1.36, 1.66]"),
    # then a short message's arrays inside its manifest (three objects, ``wire.packing``), and an evaluation under
    # secure aggregation without the reference model and the anchor (``coordinator.phases.evaluate``)
    ("deploy-round-walkthrough-abba-inline", [1.35, 1.45, 1.38, 1.48], "1.41x, 95 % t-interval [1.32, 1.51]"),
])
def test_the_kept_abba_rows_alone_on_the_machine_rebuild_the_published_pairs(kept, ratios, mean, capsys):
    """Four ABBA pairs alone on the machine: ``--table`` prints the pairs and their mean again from the kept rows."""
    root = _BENCH / "results" / kept
    pairs = deploy_round.pair_ratios(root, json.loads((root / "bench.json").read_text()))
    assert [round(p["ratio"], 2) for p in pairs] == ratios
    assert [p["order"][0] for p in pairs] == ["distmoe", "simulated", "distmoe", "simulated"]
    deploy_round.report(root)
    assert f"mean distmoe / simulated over 4 pairs: {mean}" in capsys.readouterr().out


def test_the_kept_superlink_store_rows_rebuild_the_published_totals(capsys):
    """Flower's SQLite object store against the memory one (``server.superlink``), four invocations in the order
    memory, SQLite, SQLite, memory: distmoe's and the floor's rounds >= 1 as ``--table`` prints them."""
    totals = {}
    for run in ("1-memory", "2-sqlite", "3-sqlite", "4-memory"):
        deploy_round.report(_BENCH / "results" / "deploy-round-superlink-store" / run)
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(" >= 1"))
        totals[run] = tuple(line.split()[4:6])
    assert totals == {"1-memory": ("182.43", "84.14"), "2-sqlite": ("206.31", "105.94"),
                      "3-sqlite": ("255.34", "134.86"), "4-memory": ("220.81", "97.60")}


def test_the_kept_superexec_wake_rows_rebuild_the_published_totals():
    """The owner's SuperExec polling its SuperNode every 50 ms (main) against woken at each task
    (``clients.superexec``), four invocations of ``--arms distmoe --trace`` in the order poll, wake, wake, poll:
    distmoe's rounds >= 1 from each kept coordinator ledger."""
    totals = {run: round(sum(r["seconds"] for r in deploy_round.rounds_of(
        _BENCH / "results" / "deploy-round-superexec-wake" / run / "distmoe-1") if r["round"] >= 1), 1)
        for run in ("1-poll", "2-wake", "3-wake", "4-poll")}
    assert totals == {"1-poll": 200.4, "2-wake": 200.0, "3-wake": 190.0, "4-poll": 208.0}


def test_the_kept_link_state_rows_rebuild_the_published_totals():
    """The SuperLink's link state in memory (``server.superlink --link-state memory``, ``1-memory``) against Flower's
    in its SQLite database (main, ``2-sqlite``), ``--schedule bench --arms distmoe --trace``: distmoe's rounds >= 1
    from each kept coordinator ledger."""
    totals = {run: round(sum(r["seconds"] for r in deploy_round.rounds_of(
        _BENCH / "results" / "deploy-round-link-state" / run / "distmoe-1") if r["round"] >= 1), 1)
        for run in ("1-memory", "2-sqlite")}
    assert totals == {"1-memory": 31.9, "2-sqlite": 66.9}


def test_the_kept_inline_rows_rebuild_the_published_totals():
    """A short message as six Flower objects (main, ``1-six``, ``3-six``) against three, its arrays inside the
    manifest (``wire.packing``; ``2-three``, ``4-three``), alternating, ``--schedule bench --arms distmoe --trace``:
    distmoe's rounds >= 1 from each kept coordinator ledger."""
    totals = {run: round(sum(r["seconds"] for r in deploy_round.rounds_of(
        _BENCH / "results" / "deploy-round-inline" / run / "distmoe-1") if r["round"] >= 1), 1)
        for run in ("1-six", "2-three", "3-six", "4-three")}
    assert totals == {"1-six": 34.2, "2-three": 27.9, "3-six": 33.7, "4-three": 29.7}
