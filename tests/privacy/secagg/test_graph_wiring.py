"""``privacy.secagg-graph`` wired through the config, the party session and the coordinator.

Owns: the config key (choices equal to ``secagg.GRAPHS``) and one in-process run (``LocalTransport``: the exact
party code path) with the Harary graph, checking that the coordinator and every party derived the same sparse
graph from public facts (the SecAgg run id and the number of invited parties) and its per-neighbourhood threshold.
The protocol-level graph tests are in ``test_graph.py``.

Must not: touch the network or start Flower engines.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distmoe.config import SECAGG_GRAPHS, ConfigError, parse_node_config, parse_run_config
from distmoe.privacy import secagg as sa
from distmoe.privacy.secagg import graph as G


def test_config_key():
    assert SECAGG_GRAPHS == sa.GRAPHS
    assert parse_run_config({"privacy.secagg-graph": "harary"}).privacy.secagg_graph == "harary"
    assert parse_run_config({}).privacy.secagg_graph == "complete"
    with pytest.raises(ConfigError, match="privacy.secagg-graph"):
        parse_run_config({"privacy.secagg-graph": "ring"})


@pytest.mark.integration
def test_a_run_with_the_harary_graph_goes_through_session_and_coordinator(tmp_path: Path, monkeypatch, tiny_run):
    """5 parties in process with ``privacy.secagg-graph = "harary"``; the degree rule is forced to k = 2 (the
    bound gives the complete graph below 26 parties), so each party masks with 2 of the 4 others."""
    from distmoe.coordinator import Coordinator
    from distmoe.data.synth import write_synthetic
    from distmoe.inprocess import LocalTransport
    from distmoe.party.session import PartySession

    monkeypatch.setattr(G, "harary_degree", lambda n, *a, **kw: 2)
    cfg = parse_run_config({**tiny_run, "schedule.phases": "sft:arith, stats:arith, eval",
                            "federation.min-available": 5, "privacy.secagg-graph": "harary"})
    dirs = write_synthetic(tmp_path / "data", parties=5, examples_per_task=16, seed=0)
    nodes = {100 + i: parse_node_config({"data-path": str(d), "party-name": d.name,
                                         "work-dir": str(tmp_path / "work" / d.name)}, cfg.sim)
             for i, d in enumerate(dirs)}
    run_id = "harary-run"
    coord = Coordinator(cfg, tmp_path / "run", LocalTransport(cfg, nodes, run_id), run_id, log=lambda _s: None)
    rec = coord.run()
    assert rec["status"] == "completed", rec.get("error")
    assert rec["privacy"]["threshold"] == 2  # floor((2 + 1) / 2) + 1 over 3 holders, not 5 // 2 + 1 = 3
    events = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["parties"] for e in events if e["event"] == "train" and e["party"] == "all"] == [5]
    assert any(e["event"] == "stats" and e["parties"] == 5 for e in events)
    for nid, node in nodes.items():
        session = PartySession(cfg, node, run_id)
        assert session.facts.n_invited == 5 and session.facts.threshold == 2
        assert len(session.client._peers) == 2 and nid not in session.client._peers
