"""Unit tests: ``eval.every`` (evaluation rounds inserted into the schedule) and their charge in the privacy plan."""

from __future__ import annotations

import pytest

from distmoe.config import ConfigError, Phase, parse_run_config, with_eval_cadence
from distmoe.privacy.plan import plan_privacy


def _labels(cfg):
    return [p.label() + (f"*{p.rounds}" if p.rounds > 1 else "") for p in cfg.schedule.phases]


def test_eval_every_splits_training_phases():
    cfg = parse_run_config({"schedule.phases": "sft:a*5, eval, stats:a, sft:b*4, rl:b*2", "eval.every": 2})
    assert _labels(cfg) == ["sft:a*2", "eval", "sft:a*2", "eval", "sft:a", "eval", "stats:a",
                            "sft:b*2", "eval", "sft:b*2", "eval", "rl:b*2", "eval"]
    assert cfg.schedule.total_rounds == 13 + 5  # the 13 scheduled rounds and 5 inserted evaluations
    off = parse_run_config({"schedule.phases": "sft:a*5, eval"})
    assert _labels(off) == ["sft:a*5", "eval"]
    # an explicit eval right after a full run is not doubled
    assert _labels(parse_run_config({"schedule.phases": "sft:a*4, eval", "eval.every": 2})) == \
        ["sft:a*2", "eval", "sft:a*2", "eval"]
    assert with_eval_cadence((Phase("stats", None, 1),), 1) == (Phase("stats", None, 1),)
    with pytest.raises(ConfigError, match="eval.every"):
        parse_run_config({"eval.every": -1})


def test_eval_every_splits_every_update_phase_kind_dpo_included():
    cfg = parse_run_config({"schedule.phases": "sft:a*2, dpo:p*5, eval", "eval.every": 2})
    assert _labels(cfg) == ["sft:a*2", "eval", "dpo:p*2", "eval", "dpo:p*2", "eval", "dpo:p", "eval"]


def test_inserted_eval_rounds_are_played_and_counted_as_releases():
    """Where the round loop plays the inserted evaluations (``position``: the loop's schedule walk), and that the
    plan counts each as an evaluation release (its epsilon: the slow test below)."""
    from distmoe.coordinator.state import position
    from distmoe.privacy.plan import count_releases

    cfg = parse_run_config({"schedule.phases": "sft:arith*2, stats:arith, sft:strings*2, eval", "eval.every": 2})
    assert _labels(cfg) == ["sft:arith*2", "eval", "stats:arith", "sft:strings*2", "eval"]
    phases = cfg.schedule.phases
    evals = [r for r in range(1, cfg.schedule.total_rounds + 1) if phases[position(phases, r)["phase"]].kind == "eval"]
    assert evals == [3, 7] and count_releases(cfg.privacy, cfg.schedule)[2] == 2


@pytest.mark.slow
def test_inserted_eval_rounds_are_charged_by_the_plan():
    base = {"schedule.phases": "sft:a*6, eval, stats:a, sft:b*6, eval", "privacy.epsilon": 40.0,
            "privacy.noise-multiplier": 2.0}
    plain = plan_privacy(parse_run_config(base).privacy, parse_run_config(base).schedule)
    cfg = parse_run_config({**base, "eval.every": 3})
    dense = plan_privacy(cfg.privacy, cfg.schedule)
    assert plain.eval_releases == 2 and dense.eval_releases == 4
    assert dense.planned_epsilon > plain.planned_epsilon
    # the same planned epsilon as writing the rounds into the schedule by hand
    hand = "sft:a*3, eval, sft:a*3, eval, stats:a, sft:b*3, eval, sft:b*3, eval"
    by_hand = parse_run_config({**base, "schedule.phases": hand})
    assert plan_privacy(by_hand.privacy, by_hand.schedule).planned_epsilon == pytest.approx(dense.planned_epsilon)
    # with the statistics noise derived from the budget, the extra evaluations cost the statistics more noise
    derived = {**base, "privacy.noise-multiplier": 0.0}
    z0 = plan_privacy(parse_run_config(derived).privacy, parse_run_config(derived).schedule).noise_multiplier
    cfg = parse_run_config({**derived, "eval.every": 3})
    assert plan_privacy(cfg.privacy, cfg.schedule).noise_multiplier > z0
