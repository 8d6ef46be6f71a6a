"""Flower's own floor (``bench/flower_floor/``, ``bench/deploy_arms.py``, ``bench/deploy_round.py``): the floor moves
messages of the records and sizes distmoe's ServerApp recorded, arrays equal where distmoe's were equal (Flower then
moves them once, as for distmoe) and never equal across runs; the plan pairs each push with its replies; the floor's
stages are read as distmoe's rounds stage by stage."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

_BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


floor_app = _load("floor_app_under_test", _BENCH / "flower_floor" / "floor_app.py")
hook = _load("deploy_trace_hook_under_test", _BENCH / "deploy_trace" / "sitecustomize.py")  # inert without its env
sys.path.insert(0, str(_BENCH))
import deploy_round  # noqa: E402


def _distmoe_like(weights: np.ndarray, share: np.ndarray) -> SimpleNamespace:
    """A packed distmoe message as ``shape_of`` reads it (its content; a Flower Message needs a run to be built)."""
    content = RecordDict({"packed": ArrayRecord({"arrays": Array(weights), "round": Array(share)}),
                          "packed_manifest": ConfigRecord({"order": ["arrays", "round"], "sizes": [3, 4, 5]})})
    return SimpleNamespace(content=content)


def test_the_floor_rebuilds_each_record_with_the_recorded_sizes_and_sharing():
    w = np.arange(3000, dtype=np.float32)
    a, b = _distmoe_like(w, np.ones(7)), _distmoe_like(w, np.zeros(7))  # same weights, different shares
    sa, sb = hook.shape_of(a), hook.shape_of(b)
    assert [r[0] for r in sa] == ["packed", "packed_manifest"]
    ra, rb = floor_app.build(sa, "run-1"), floor_app.build(sb, "run-1")
    for shape, rebuilt in ((sa, ra), (sb, rb)):
        arrays = {k: len(x.data) for k, x in rebuilt["packed"].items()}
        assert arrays == {k: n for k, n, _ in shape[0][2]}
        assert 0 <= len(rebuilt["packed_manifest"].deflate()) - shape[1][2] <= 8
    assert ra["packed"]["arrays"].data == rb["packed"]["arrays"].data  # shared in distmoe's stage, shared here
    assert ra["packed"]["round"].data != rb["packed"]["round"].data
    other_run = floor_app.build(sa, "run-2")
    assert other_run["packed"]["arrays"].data != ra["packed"]["arrays"].data  # nothing already at the SuperLink


def test_the_reply_shape_rides_in_the_config_record_the_message_already_has():
    shape = hook.shape_of(_distmoe_like(np.ones(10), np.ones(2)))
    rd = floor_app.build(shape, "s", {floor_app.SPEC: json.dumps(shape)})
    assert list(rd.keys()) == ["packed", "packed_manifest"]
    assert json.loads(rd["packed_manifest"][floor_app.SPEC]) == shape


def test_the_plan_pairs_each_push_with_its_replies_in_the_arms_time_window(tmp_path):
    da = sys.modules["deploy_arms"]
    rec = [{"ev": "push", "t": 1.0, "type": "old", "mids": ["x"], "shapes": [[]]},
           {"ev": "push", "t": 10.0, "type": "query.setup", "mids": ["a", "b"], "shapes": [["sa"], ["sb"]]},
           {"ev": "reply", "t": 11.0, "reply_to": "b", "shape": ["rb"]},
           {"ev": "reply", "t": 11.5, "reply_to": "a", "shape": None}]
    path = tmp_path / "shapes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rec))
    plan = da.plan_from_shapes(path, 5.0, 20.0)
    assert plan == {"stages": [{"type": "query.setup", "messages": [["sa"], ["sb"]], "replies": [None, ["rb"]]}]}


def test_the_floors_stages_become_distmoes_rounds():
    dep = [{"round": 0, "phase": "setup", "type": "setup-request"}, {"round": 0, "phase": "setup", "type": "key-dir"},
           {"round": 1, "phase": "sft", "type": "sft-instruction"}, {"round": 1, "phase": "sft", "type": "unmask"}]
    recs = [{"stage": i, "start": 10.0 * i, "end": 10.0 * i + 2} for i in range(4)] + [{"event": "end", "time": 45.0}]
    rounds = deploy_round.floor_rounds(dep, recs)
    assert [(r["round"], r["seconds"]) for r in rounds] == [(0, 20.0), (1, 25.0)]
    assert rounds[1]["stages"] == {"sft-instruction": 2.0, "unmask": 2.0}
    assert deploy_round.floor_rounds(dep[:3], recs) is None  # a floor that did not replay every stage is not read


def test_the_kept_walkthrough_rows_rebuild_the_published_table(capsys):
    """``--table`` on the rows ``bench/results/`` keeps (run directories named relative to them, ledger and metrics
    only): the deployed and simulated rounds are read again, and the arm the invocation left out prints "-"."""
    deploy_round.report(_BENCH / "results" / "deploy-round-walkthrough")
    out = capsys.readouterr().out
    total = next(line for line in out.splitlines() if line.lstrip().startswith(">= 1"))
    sim, dep, cut, stock = total.split()[3:7]
    assert float(dep) / float(sim) > 1.0 and float(cut) > 0 and stock == "-"
    assert f"{float(dep) / float(sim):.2f}x" in total
    assert len([line for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit()]) == 8  # 0-7
