"""The ``dpo.*`` config keys and the ``dpo`` phase in the schedule grammar and the privacy plan (the phase end to
end: tests/coordinator/test_dpo_phase.py)."""

from __future__ import annotations

import pytest

from distmoe.config import ConfigError, parse_run_config
from distmoe.privacy.plan import count_releases


def test_dpo_phase_parses_and_counts_as_an_update_release():
    cfg = parse_run_config({"schedule.phases": "sft:pref*2, dpo:pref*3, eval, dpo:pref", "schedule.sft-rounds": 4,
                            "privacy.update-noise-multiplier": 1.0})
    assert [(p.kind, p.task, p.rounds) for p in cfg.schedule.phases] == \
        [("sft", "pref", 2), ("dpo", "pref", 3), ("eval", None, 1), ("dpo", "pref", 4)]
    stats, updates, evals = count_releases(cfg.privacy, cfg.schedule)
    assert (stats, updates, evals) == (0, 2 + 3 + 4, 1)  # dpo rounds are charged like sft rounds
    d = parse_run_config({}).dpo
    assert (d.beta, d.reference, d.reference_engine) == (0.1, "phase", "")
    assert parse_run_config({"dpo.reference-engine": "bf16+prune-2"}).dpo.reference_engine == "bf16+prune-2"


@pytest.mark.parametrize("key,value,needle", [
    ("schedule.phases", "dpo", "needs a task"), ("dpo.beta", 0.0, "dpo.beta"), ("dpo.steps", 0, "dpo.steps"),
    ("dpo.reference", "base", "dpo.reference"), ("dpo.reference-engine", "fp8", "dpo.reference-engine"),
    ("dpo.reference-engine", "bf16+prune-x", "prune-<k>"), ("dpo.pairs-per-step", 0, "dpo.pairs-per-step"),
])
def test_dpo_config_errors_name_the_key(key, value, needle):
    with pytest.raises(ConfigError, match=needle.replace("+", r"\+")):
        parse_run_config({key: value})
