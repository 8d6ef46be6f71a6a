"""The ``rl.*`` config keys: the lists of names equal the RL registries, and each bad value is refused
naming its key (the phase end to end: tests/coordinator/test_rl_phase.py)."""

from __future__ import annotations

import pytest

from distmoe import config as C
from distmoe.config import ConfigError, parse_run_config
from distmoe.rl.losses import POLICY_LOSSES
from distmoe.rl.rewards import REWARDS


def test_config_lists_match_the_registries():
    assert set(C.POLICY_LOSSES) == set(POLICY_LOSSES)
    assert set(C.REWARDS) == set(REWARDS)


@pytest.mark.parametrize("key,value,needle", [
    ("rl.engine", "fp8", "rl.engine"), ("rl.engine", "bf16+prune-x", "prune-<k>"),
    ("rl.engine", "int9-experts", "int<b>-experts"), ("dpo.reference-engine", "int4x-experts", "int<b>-experts"),
    ("rl.correction", "clip", "icepop"), ("rl.policy-loss", "dpo", "grpo"), ("rl.reward", "bleu", "task"),
    ("rl.group-size", 1, "rl.group-size"), ("rl.minibatches", 99, "rl.prompts-per-step"),
    ("rl.icepop-high", 0.5, "rl.icepop-high"), ("schedule.phases", "rl", "needs a task"),
    ("rl.routing-replay", "yes", "rl.routing-replay"), ("rl.simulator-lb-coef", -0.01, "rl.simulator-lb-coef"),
])
def test_rl_config_errors_name_the_key(key, value, needle):
    with pytest.raises(ConfigError, match=needle.replace("+", r"\+").replace("<", "<")):
        parse_run_config({key: value})


def test_routing_replay_keys_parse_and_exclude_the_simulator():
    d = parse_run_config({})
    assert d.rl.routing_replay is False and d.rl.simulator_lb_coef == 0.01
    for corr in ("none", "tis", "icepop"):  # replay combines with every correction
        r = parse_run_config({"rl.routing-replay": True, "rl.correction": corr}).rl
        assert r.routing_replay and r.correction == corr
    with pytest.raises(ConfigError, match="rl.routing-replay.*rl.simulator"):
        parse_run_config({"rl.routing-replay": True, "rl.simulator": True})
    r = parse_run_config({"rl.routing-replay": True, "rl.simulator-lb-coef": 0.2}).rl  # what run_grpo receives
    assert r.routing_replay and r.simulator_lb_coef == 0.2


def test_expert_quant_engine_parts_parse():
    for value in ("int4-experts", "int2g32-experts", "bf16+int3-experts", "int4-experts+prune-1"):
        assert parse_run_config({"rl.engine": value}).rl.engine == value
    assert parse_run_config({"dpo.reference-engine": "int4-experts"}).dpo.reference_engine == "int4-experts"
