"""The fence each key declares (may it change on resume, is it privacy-relevant, is it experimental) and the
load-balancing mode as an enum: what the resume check, the ledger's run-start entry and ``config show`` read."""

from __future__ import annotations

import tomllib

import pytest

from distmoe.config import (
    DEFAULTS,
    EXPERIMENTAL_KEYS,
    KEYS,
    PRIVACY_KEYS,
    RESUME_MAY_CHANGE,
    Balance,
    ConfigError,
    flatten,
    parse_run_config,
    to_toml,
)
from distmoe.config_sync import render_key_table
from distmoe.coordinator.resume import config_differences


def test_resume_fence_is_what_the_keys_declare_and_what_the_resume_check_allows():
    assert RESUME_MAY_CHANGE == {s.name for s in KEYS if s.resume}
    assert {"run.resume", "run.dir", "federation.round-timeout", "train.threads", "checkpoint.keep"} \
        <= RESUME_MAY_CHANGE
    # nothing that shapes the model, the data or a release may change on resume
    assert not {k for k in RESUME_MAY_CHANGE if k.split(".")[0] in ("model", "privacy", "schedule", "rl", "dpo")}
    before = dict(DEFAULTS)
    after = {**before, "federation.round-timeout": 5.0, "train.threads": 3}
    assert config_differences(before, after) == {}
    assert set(config_differences(before, {**after, "privacy.epsilon": 4.0})) == {"privacy.epsilon"}


def test_privacy_fence_covers_every_privacy_key_and_the_canary_file():
    assert PRIVACY_KEYS == {s.name for s in KEYS if s.privacy}
    assert {k for k in DEFAULTS if k.startswith("privacy.")} | {"data.canary-file"} == PRIVACY_KEYS


def test_research_knobs_are_experimental_and_marked_where_users_read_keys():
    assert {"rl.simulator", "rl.simulator-bound", "routing.public-balance-coef", "routing.balance-settle-steps",
            "retention.expand-experts"} <= EXPERIMENTAL_KEYS
    assert not {"privacy.epsilon", "train.lr", "schedule.phases", "routing.balance"} & EXPERIMENTAL_KEYS
    text = to_toml(DEFAULTS)
    marked = {line.split(" = ")[0] for line in text.splitlines() if line.endswith("# experimental")}
    assert len(marked) == len(EXPERIMENTAL_KEYS)
    assert parse_run_config(flatten(tomllib.loads(text))) == parse_run_config()  # the marks are comments
    table = render_key_table()
    main, experimental = table.split("Experimental keys", 1)
    assert "`rl.simulator-bound`" in experimental and "`rl.simulator-bound`" not in main
    assert "`privacy.epsilon`" in main and "`privacy.epsilon`" not in experimental.split("Retired keys")[0]


@pytest.mark.parametrize("mode,aux,bias", [("aux", True, False), ("bias", False, True), ("aux+bias", True, True)])
def test_balance_is_an_enum_asked_by_its_parts(mode, aux, bias):
    cfg = parse_run_config({"routing.balance": mode})
    assert isinstance(cfg.routing.balance, Balance) and cfg.routing.balance == mode
    assert (cfg.routing.balance.aux, cfg.routing.balance.bias) == (aux, bias)
    assert f"{cfg.routing.balance!r} {cfg.routing.balance}" == f"{mode!r} {mode}"  # messages name the value
    assert cfg.model.balance_bias == bias


def test_an_unknown_balance_mode_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="routing.balance.*'biased'.*aux, bias, aux\\+bias"):
        parse_run_config({"routing.balance": "biased"})
