"""Unit test: a party names the parameters behind its skipped NaN/Inf steps in its own log line and hands them
to its metrics log once (``distmoe.party.work.stability`` / ``take_notes``); they never go on the wire."""

from __future__ import annotations

from types import SimpleNamespace

from distmoe.config import NodeConfig
from distmoe.party import work
from distmoe.train.stability import NonFinite

GATE = "model.layers.0.mlp.gate.weight"


def test_the_party_names_the_tensors_in_its_own_log_line_and_hands_them_over_once(tmp_path, capsys):
    node = NodeConfig(party="p0", data_path=tmp_path, work_dir=tmp_path, model_path="", progress_stdout=True)
    tally = NonFinite()
    tally.add([GATE])
    work.stability(node, SimpleNamespace(round=3), tally)
    assert capsys.readouterr().out.strip() == f"distmoe party p0: round 3: non-finite gradients skipped 1 step; " \
                                              f"1 tensor: {GATE} (1)"
    assert work.take_notes("p0") == {"nonfinite_params": [GATE], "nonfinite_tensors": 1}
    assert work.take_notes("p0") == {}  # once
    work.stability(node, SimpleNamespace(round=4), NonFinite())  # nothing skipped: no line, no notes
    assert capsys.readouterr().out == "" and work.take_notes("p0") == {}
