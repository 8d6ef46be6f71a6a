"""A party's declared budget cap (node config ``epsilon-max``) and rounds that release nothing.

Following ``docs/deploy.md`` literally used to give parties ``epsilon-max = 4`` under a plan of epsilon ~8:
each party refused the statistics release, no anchor was built, and ``run.json`` said ``completed`` with no
warning while the audit passed. Now each party declares its cap in its key advert at setup, the coordinator
refuses to start a schedule a cap cannot cover (naming party, cap and planned epsilon), and a round that
releases nothing is a warning in ``run.json``, ``metrics.jsonl`` and the audit (``schedule-coverage``).
"""

from __future__ import annotations

import json

import pytest

from distmoe.audit import audit_run
from distmoe.coordinator import PrivacyStop
from distmoe.privacy.plan import plan_privacy
from distmoe.report.report import render_markdown
from distmoe.wire import codec

pytestmark = pytest.mark.integration  # whole in-process runs (three parties, LocalTransport)


def _ledger(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "ledger" / "coordinator.jsonl").read_text().splitlines() if x]


def test_a_cap_below_the_plan_refuses_the_run_at_setup_naming_party_cap_and_epsilon(tmp_path, make_run, releases):
    """Without the declared cap (KeyAdvertReply.epsilon_max) and the coordinator's check at setup, this run
    starts, party-1 refuses the statistics release and the run ends ``completed``."""
    coord, _, run_dir, _, lines = make_run(tmp_path, node_extra={"party-1": {"epsilon-max": 0.5}})
    planned = plan_privacy(coord.cfg.privacy, coord.cfg.schedule).planned_epsilon
    assert planned > 0.5
    with pytest.raises(PrivacyStop) as err:
        coord.run()
    text = str(err.value)
    assert "party party-1 declares epsilon-max = 0.5" in text and f"{planned:.4f}" in text
    assert "party-0" not in text and "party-2" not in text  # only the party whose cap is short is named
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["status"] == "failed" and "party-1" in rec["error"]
    entries = _ledger(run_dir)
    assert not [e for e in entries if str(e["payload_type"]).startswith("release:")]
    # nothing but setup was sent: no key directory, no phase instruction
    assert {e["payload_type"] for e in entries if e["direction"] == "out"} <= {"policy", "setup-request", "run-end"}
    adverts = [e for e in entries if e["payload_type"] == "key-advert"]
    assert {e["peer"]: e["info"]["epsilon_max"] for e in adverts} == {"party-0": 0.0, "party-1": 0.5, "party-2": 0.0}
    assert entries[-1]["payload_type"] == "run-end" and entries[-1]["info"]["status"] == "failed"


def test_a_covering_cap_is_recorded_and_a_skipped_release_warns_in_run_json_and_the_audit(tmp_path, make_run, releases):
    """A cap at the budget lets the run start (the cap is in run.json ``parties``, accepted by the audit's
    server-files schema). Every party drops out of the statistics round: nothing is released, and without
    ``Coordinator.round_failed``'s warning and the audit's ``schedule-coverage`` check the run would read
    ``completed``, no warnings, audit PASS with no finding."""
    coord, transport, run_dir, _, lines = make_run(tmp_path, node_extra={"party-0": {"epsilon-max": 8.0}})
    # every party drops out of the statistics round before it sends anything (as a refusing party does)
    transport.drop = lambda mtype, node: mtype == codec.MSG_STATS
    coord.run()
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["status"] == "completed"
    assert rec["parties"]["party-0"]["epsilon_max"] == 8.0 and "epsilon_max" not in rec["parties"]["party-1"]
    assert releases(run_dir, "router-stats") == [] and len(releases(run_dir, "model-update")) == 1
    # the parties shared no keys for round 3 at the dropped stage: the evaluation after it releases nothing too
    assert [w.split(":")[0] for w in rec["warnings"]] == ["round 2 (stats", "round 3 (eval) released nothing"]
    assert rec["warnings"][0].startswith("round 2 (stats:arith) released nothing")
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(e["round"], e["phase_label"]) for e in events if e["event"] == "round_skipped"] == [
        (2, "stats:arith"),
        (3, "eval"),
    ]
    assert any("WARNING: round 2 (stats:arith) released nothing" in x for x in lines)
    md = render_markdown(run_dir)  # the report's Warnings section lists both rounds
    warnings_section = md.split("## Warnings", 1)[1].split("\n## ", 1)[0]
    assert all(f"- {w}" in warnings_section for w in rec["warnings"]), warnings_section
    result = audit_run(run_dir)
    check = result.check("schedule-coverage")
    assert check.status == "warn" and len(check.findings) == 2
    assert check.findings[0].startswith("round 2 (stats:arith): no applied router-stats release")
    assert check.findings[1].startswith("round 3 (eval): no applied eval release")
    assert not any("run.json does not warn" in f for f in check.findings)
    assert result.warnings == [f"schedule-coverage: {f}" for f in check.findings]
    assert result.check("server-files").status == "pass", result.check("server-files").findings
    assert result.passed, result.failed  # privacy held: a warning, not a failed verdict
