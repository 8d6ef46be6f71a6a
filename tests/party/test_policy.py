"""The data owner's policy against a hostile coordinator: each test sends what a coordinator controls (the run
config, the setup request) to an unmodified party (the ClientApp on real Flower messages, through the party
guard) and asserts the run is refused with the policy key's fixed code before anything else leaves; the
controls show the same attack working on a party without a policy (today's ``distmoe simulate`` behaviour)."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from clients.app import setup, sft
from distmoe.config import ConfigError, NodeConfig, SimConfig, parse_node_config
from distmoe.deploy import pin as code_pin
from distmoe.model.base import base_fingerprint
from distmoe.model.build import build_model
from distmoe.model.trainable import apply_trainable, spec_of, trainable_state
from distmoe.party.policy import OwnerPolicy, owner_policy
from distmoe.wire import codec
from distmoe.wire.at_rest import make_private
from distmoe.wire.errors import ErrorCode, reason_text
from distmoe.wire.schema import KeyAdvertReply, ModelUpdate, SetupRequest, SftInstruction

DEPLOYED = {"policy": "deployed"}
THREE = {"privacy.min-parties": 3, "federation.min-available": 3}  # at the deployed floor


@pytest.fixture(autouse=True)
def task_identity():
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


@pytest.fixture
def data(synth_dirs, tmp_path) -> Path:
    """One party's data, private to its owner (the deployed party's pre-run check requires it)."""
    d = tmp_path / "p0"
    shutil.copytree(synth_dirs[0], d)
    make_private(d)
    return d


def _ctx(data: Path, run_config: dict, policy: dict | None, work: Path, run_id: int = 7) -> Context:
    nc = {"data-path": str(data), "party-name": "p0", "work-dir": str(work), **(policy or {})}
    return Context(run_id=run_id, node_id=1, node_config=nc, state=RecordDict(), run_config=run_config)


def _msg(payload):
    content = codec.with_ledger_head(codec.encode(payload), 5, "ab" * 32)
    return codec.instruction_content(content, 1, codec.message_type_of(payload))


def _setup_request(threshold: int = 3, z: float = 0.0, z_u: float = 0.0) -> SetupRequest:
    return SetupRequest(secagg_run=bytes(16), threshold=threshold, max_length=1 << 20, n_invited=3,
                        noise_multiplier=z, update_noise_multiplier=z_u)


def _ledger(work: Path) -> list[dict]:
    return [json.loads(x) for x in (work / "ledger" / "p0.jsonl").read_text().splitlines() if x]


def _refused(out, code: ErrorCode, work: Path) -> None:
    """Only the policy key's fixed text left, anchored in the ledger; nothing but that error was sent."""
    assert out.has_error(), "the party answered"
    assert out.error.code == int(code), (out.error.code, out.error.reason)
    text, head = codec.split_error(out.error.reason)
    assert text == reason_text(code) and head is not None
    assert text.startswith("policy-")  # names the owner's policy key
    outs = [e for e in _ledger(work) if e["direction"] == "out"]
    assert [e["payload_type"] for e in outs] == ["error"], outs
    assert "owner policy" in (work / "party.log").read_text()


def _sft_instruction(run_config: dict) -> SftInstruction:
    from distmoe.config import parse_run_config

    cfg = parse_run_config(run_config)
    model, _ = build_model(cfg.model)
    model = apply_trainable(model, cfg.model)
    spec = spec_of(model, cfg.model.trainable, base_fingerprint(cfg.model))
    weights = {k: v.numpy() for k, v in trainable_state(model).items()}
    return SftInstruction(round=1, task="lookup", weights=weights, base_hash=spec.base_hash, seed=1, anchor=None,
                          anchor_version=0)


# ------------------------------------------------------------------------------------ the plaintext attack
def test_plaintext_run_config_is_refused_by_a_deployed_party_before_anything_leaves(data, tiny, tmp_path):
    run_config = {**tiny, "privacy.mode": "plaintext", **THREE, "train.local-steps": 1}
    out = sft(_msg(_sft_instruction(run_config)), _ctx(data, run_config, DEPLOYED, tmp_path / "w"))
    _refused(out, ErrorCode.POLICY_PLAINTEXT, tmp_path / "w")
    assert not (tmp_path / "w" / "metrics").exists()  # it never trained


def test_plaintext_attack_works_on_a_party_without_a_policy(data, tiny, tmp_path):
    """The control (the defence removed): the same run config makes the party send its plain update."""
    run_config = {**tiny, "privacy.mode": "plaintext", **THREE, "train.local-steps": 1}
    out = sft(_msg(_sft_instruction(run_config)), _ctx(data, run_config, None, tmp_path / "w"))
    assert not out.has_error()
    assert codec.decode(out.content, ModelUpdate).num_examples > 0  # one party's exact count, in the clear


def test_plaintext_is_accepted_with_the_owners_explicit_opt_in(data, tiny, tmp_path):
    run_config = {**tiny, "privacy.mode": "plaintext", **THREE, "train.local-steps": 1,
                  "schedule.phases": "sft:lookup, eval"}
    policy = {**DEPLOYED, "policy-allow-plaintext": True}
    out = sft(_msg(_sft_instruction(run_config)), _ctx(data, run_config, policy, tmp_path / "w"))
    assert not out.has_error(), out.error.reason if out.has_error() else ""
    assert stat.S_IMODE((tmp_path / "w").stat().st_mode) == 0o700


# ------------------------------------------------------------------------ floors checked at setup
@pytest.mark.parametrize("run, req, policy, code", [
    # the coordinator lowers privacy.min-parties (the run config's default, 2, is below the floor 3)
    ({}, {}, {}, ErrorCode.POLICY_MIN_PARTIES),
    # it keeps min-parties but asks for a SecAgg threshold of 2 in the setup request
    (THREE, {"threshold": 2}, {}, ErrorCode.POLICY_MIN_PARTIES),
    # it raises the budget: the derived router-statistics noise falls below the floor
    ({**THREE, "privacy.epsilon": 200.0}, {}, {}, ErrorCode.POLICY_NOISE),
    # it gives the router-statistics noise directly (and a budget that affords it)
    ({**THREE, "privacy.epsilon": 200.0,
      "privacy.noise-multiplier": 0.2}, {}, {}, ErrorCode.POLICY_NOISE),
    # it lowers the evaluation noise
    ({**THREE, "privacy.epsilon": 200.0, "privacy.noise-multiplier": 1.0,
      "privacy.metric-noise-multiplier": 0.3}, {}, {}, ErrorCode.POLICY_METRIC_NOISE),
    # an owner floor on update noise, a run without it
    (THREE, {}, {"policy-min-update-noise-multiplier": 4.0}, ErrorCode.POLICY_UPDATE_NOISE),
    # phases and rounds
    (THREE, {}, {"policy-phases": "sft,eval"}, ErrorCode.POLICY_PHASES),
    (THREE, {}, {"policy-max-rounds": 4}, ErrorCode.POLICY_ROUNDS),
])
def test_a_run_below_an_owner_floor_is_refused_at_setup(data, tiny, tmp_path, run, req, policy, code):
    run_config = {**tiny, **run}
    out = setup(_msg(_setup_request(**req)), _ctx(data, run_config, {**DEPLOYED, **policy}, tmp_path / "w"))
    _refused(out, code, tmp_path / "w")
    assert not list((tmp_path / "w").glob("secagg/*.state"))  # no SecAgg key was made


def test_setup_within_the_floors_records_the_policy_and_code_pin_in_the_ledger(data, tiny, tmp_path, monkeypatch):
    """The control for every row above: at the floors the party joins, and its signed ledger holds the policy it
    checked (canonical JSON and digest) and the code pin its launcher matched, in the key advert's entry."""
    monkeypatch.setattr(code_pin, "_ACTIVE", {"digest": "c0" * 32})
    run_config = {**tiny, **THREE}
    out = setup(_msg(_setup_request()), _ctx(data, run_config, DEPLOYED, tmp_path / "w"))
    assert not out.has_error(), out.error.reason if out.has_error() else ""
    advert = codec.decode(out.content, KeyAdvertReply)
    assert advert.epsilon_max == 8.0  # the deployed default cap, declared to the coordinator
    (entry,) = [e for e in _ledger(tmp_path / "w") if e["direction"] == "out"]
    assert entry["payload_type"] == "key-advert"
    recorded = entry["info"]["owner_policy"]
    assert recorded["policy"] == OwnerPolicy().as_dict() and recorded["sha256"] == OwnerPolicy().digest()
    assert entry["info"]["code_pin"] == "c0" * 32
    assert stat.S_IMODE((tmp_path / "w").stat().st_mode) == 0o700  # made private at setup
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in (tmp_path / "w").rglob("*"))


def test_a_party_without_a_policy_keeps_todays_behaviour(data, tiny, tmp_path, monkeypatch):
    """``distmoe simulate`` and the in-process transport: no policy key, the run config decides."""
    monkeypatch.setattr(code_pin, "_ACTIVE", {})  # not started by the pinned launcher
    out = setup(_msg(_setup_request(threshold=2)), _ctx(data, dict(tiny), None, tmp_path / "w"))
    assert not out.has_error(), out.error.reason if out.has_error() else ""
    (entry,) = [e for e in _ledger(tmp_path / "w") if e["direction"] == "out"]
    assert entry["info"]["owner_policy"] is None and entry["info"]["code_pin"] is None


def test_the_number_of_runs_is_capped(data, tiny, tmp_path):
    """Each run config a coordinator tries is a new run: the owner caps how many this work directory sets up."""
    run_config = {**tiny, **THREE}
    policy = {**DEPLOYED, "policy-max-runs": 2}
    for run_id in (11, 12, 11):  # a run counts once
        out = setup(_msg(_setup_request()), _ctx(data, run_config, policy, tmp_path / "w", run_id))
        assert not out.has_error() or out.error.code == int(ErrorCode.SECAGG)  # run 11 twice: a second setup
    out = setup(_msg(_setup_request()), _ctx(data, run_config, policy, tmp_path / "w", 13))
    assert out.has_error() and out.error.code == int(ErrorCode.POLICY_RUNS)


def test_an_exposed_data_directory_is_refused_at_setup(synth_dirs, tiny, tmp_path):
    """The deployed party runs the pre-run privacy check itself: data readable by others is refused."""
    d = tmp_path / "p0"
    shutil.copytree(synth_dirs[0], d)
    make_private(d)
    os.chmod(d, 0o755)
    out = setup(_msg(_setup_request()), _ctx(d, {**tiny, **THREE}, DEPLOYED, tmp_path / "w"))
    assert out.has_error() and out.error.code == int(ErrorCode.CONFIG)
    assert "readable or writable by group/others" in (tmp_path / "w" / "party.log").read_text()


# ------------------------------------------------------------------------------------ parsing
def _node(tmp_path: Path, **policy) -> NodeConfig:
    (tmp_path / "d").mkdir(exist_ok=True)
    return parse_node_config({"data-path": str(tmp_path / "d"), **policy}, SimConfig())


def test_policy_keys_are_parsed_and_bad_ones_named(tmp_path):
    assert owner_policy(_node(tmp_path)) is None
    pol = owner_policy(_node(tmp_path, **{"policy": "deployed", "policy-min-parties": 5, "policy-phases": "eval, sft",
                                         "policy-min-update-noise-multiplier": 2, "epsilon-max": 3.0}))
    assert (pol.min_parties, pol.phases, pol.min_update_noise_multiplier, pol.epsilon_max) == (5, ("eval", "sft"),
                                                                                                2.0, 3.0)
    assert owner_policy(_node(tmp_path, **{"policy-max-runs": 9})).max_runs == 9  # any policy key turns it on
    for key, value in (("policy", "off"), ("policy-min-parties", 1), ("policy-min-parties", "3"),
                       ("policy-phases", "sft,train"), ("policy-allow-plaintext", "yes"),
                       ("policy-min-noise-multiplier", -1.0), ("policy-typo", 1)):
        with pytest.raises(ConfigError, match=f"node config key '{key}'"):
            owner_policy(_node(tmp_path, **{key: value}))
