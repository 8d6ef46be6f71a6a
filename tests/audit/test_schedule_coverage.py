"""The audit's ``schedule-coverage`` warning (``distmoe.audit.coverage``) on hand-made ledger entries."""

from __future__ import annotations

from distmoe.audit.coverage import check_schedule, planned_rounds


def _release(rnd: int, kind: str, applied: bool = True) -> dict:
    return {"payload_type": f"release:{kind}", "round": rnd, "info": {"applied": applied}}


def _end(rnd: int, status: str = "completed") -> dict:
    return {"payload_type": "run-end", "round": rnd, "info": {"status": status}}


def test_planned_rounds_follow_the_schedule_labels():
    assert planned_rounds(["sft:lookup*2", "eval", "stats:lookup"]) == [
        (1, "sft:lookup", "release:model-update"),
        (2, "sft:lookup", "release:model-update"),
        (3, "eval", "release:eval"),
        (4, "stats:lookup", "release:router-stats"),
    ]
    assert planned_rounds(["bogus:x"]) is None


def test_every_round_released_gives_no_warning():
    meta = {"schedule": ["sft:a", "stats:a", "eval"]}
    entries = [_release(1, "model-update"), _release(2, "router-stats"), _release(3, "eval"), _end(3)]
    warnings, notes = check_schedule(meta, entries)
    assert warnings == [] and notes == ["3 of 3 planned rounds checked against the coordinator's releases"]


def test_a_missing_or_rejected_release_warns_and_says_when_run_json_is_silent():
    """A deployment where the statistics release was refused and the next round ran without keys."""
    meta = {"schedule": ["sft:a", "stats:a", "sft:b"], "warnings": ["round 3 (sft:b) released nothing: x"]}
    entries = [_release(1, "model-update"), _release(2, "router-stats", applied=False), _end(3)]
    warnings, _ = check_schedule(meta, entries)
    assert len(warnings) == 2
    assert warnings[0].startswith("round 2 (stats:a): no applied router-stats release")
    assert warnings[0].endswith("(and run.json does not warn about it)")
    assert warnings[1].startswith("round 3 (sft:b): no applied model-update release")
    assert "run.json does not warn" not in warnings[1]


def test_the_round_a_failed_run_stopped_in_is_not_judged():
    meta = {"schedule": ["sft:a", "stats:a", "eval"]}
    warnings, notes = check_schedule(meta, [_release(1, "model-update"), _end(2, "failed")])
    assert warnings == [] and notes == ["1 of 3 planned rounds checked against the coordinator's releases"]
