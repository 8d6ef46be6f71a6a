"""Unit tests: a party's routing probe is a function of the instruction alone (public prompts, received weights),
never of the party's private data; a probe request, stand-alone or carried, on other prompts than the run's public
probe set is refused before any work."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from distmoe.config import parse_node_config
from distmoe.data.synth import write_synthetic
from distmoe.model.adapters import server_model
from distmoe.party.probe import run_probe
from distmoe.party.service import PartyService
from distmoe.routing.probe import default_probe_prompts
from distmoe.wire.schema import ProbeInstruction, ProbeReply, RouterStats


@pytest.fixture(scope="module")
def instruction(make_cfg):
    cfg = make_cfg(**{"privacy.mode": "secagg", "routing.probe-every": 1, "routing.probe-prompts": 6})
    sm = server_model(cfg.model)
    weights = {k: v.numpy() for k, v in sm.weights.items()}
    return cfg, ProbeInstruction(round=3, base_hash=sm.tspec.base_hash,
                                 prompts=default_probe_prompts(cfg.run.seed, 6), weights=weights)


def _node(cfg, tmp, data):
    return parse_node_config({"data-path": str(data), "party-name": "party-0", "work-dir": str(tmp / "work")}, cfg.sim)


def test_probe_ignores_the_party_data(instruction, tmp_path):
    cfg, instr = instruction
    dirs = write_synthetic(tmp_path / "a", parties=1, examples_per_task=24, seed=0)
    first = run_probe(cfg, _node(cfg, tmp_path, dirs[0]), instr)
    # other private data (another seed, other tasks), then none at all: the same reply
    shutil.rmtree(dirs[0])
    write_synthetic(tmp_path / "a", parties=1, examples_per_task=40, seed=5, tasks=("strings",))
    second = run_probe(cfg, _node(cfg, tmp_path, dirs[0]), instr)
    shutil.rmtree(dirs[0])
    dirs[0].mkdir()  # an empty data directory
    third = run_probe(cfg, _node(cfg, tmp_path, dirs[0]), instr)
    for other in (second, third):
        np.testing.assert_array_equal(other.routing, first.routing)
        np.testing.assert_array_equal(other.top1, first.top1)


def test_probe_measures_the_received_weights(instruction, tmp_path):
    cfg, instr = instruction
    node = _node(cfg, tmp_path, tmp_path)
    base = run_probe(cfg, node, instr)
    rng = np.random.default_rng(0)
    moved = {k: (v + rng.normal(0, 0.5, v.shape)).astype(np.float32) if "gate" in k else v
             for k, v in instr.weights.items()}
    other = run_probe(cfg, node, ProbeInstruction(instr.round, instr.base_hash, instr.prompts, moved))
    assert not np.allclose(other.routing, base.routing)


def test_probe_is_answered_in_a_secure_run_without_a_session_or_a_charge(instruction, tmp_path):
    cfg, instr = instruction
    dirs = write_synthetic(tmp_path / "d", parties=1, examples_per_task=24, seed=0)
    svc = PartyService(cfg, _node(cfg, tmp_path, dirs[0]), node_id=7, run_id="r")
    reply, dp = svc.answer("query.probe", instr)
    assert isinstance(reply, ProbeReply) and dp is None and reply.party == "party-0"


# ---------------------------------------------------------------- the probe carried on a phase instruction
def _carried(cfg, weights, base_hash, prompts):
    from distmoe.wire.schema import StatsInstruction

    return StatsInstruction(round=4, task="", weights=weights, base_hash=base_hash, probe=prompts)


def test_a_carried_probe_is_the_probe_of_the_received_weights_before_the_work(make_cfg, tmp_path):
    """In a plaintext run (the cheapest phase reply to look at), a stats instruction that carries the probe request:
    the reply's probe is exactly what a ``query.probe`` of the same weights answers, and its bounds are the party's
    own model's (the outbound guard checks the reply against them)."""
    cfg = make_cfg(**{"privacy.mode": "plaintext", "routing.probe-prompts": 4, "routing.probe-every": 1})
    sm = server_model(cfg.model)
    weights = {k: v.numpy() for k, v in sm.weights.items()}
    dirs = write_synthetic(tmp_path / "d", parties=1, examples_per_task=24, seed=0)
    node = _node(cfg, tmp_path, dirs[0])
    prompts = default_probe_prompts(cfg.run.seed, 4)
    svc = PartyService(cfg, node, node_id=7, run_id="r")
    reply, _ = svc.answer("train.stats", _carried(cfg, weights, sm.tspec.base_hash, prompts))
    alone = run_probe(cfg, node, ProbeInstruction(4, sm.tspec.base_hash, prompts, weights))
    np.testing.assert_array_equal(reply.probe.routing, alone.routing)
    np.testing.assert_array_equal(reply.probe.top1, alone.top1)
    bounds = svc.take_probe_bounds()
    assert (bounds.layers, bounds.experts) == alone.routing.shape and bounds.max_tokens == 4 * cfg.model.max_seq_len
    assert svc.take_probe_bounds() is None  # once


@pytest.mark.parametrize("case", ["not-public", "wrong-size", "run-does-not-probe"])
def test_a_hostile_carried_probe_request_is_refused_before_any_work(make_cfg, tmp_path, case, monkeypatch):
    """A coordinator that asks, on a phase instruction, for a probe on other prompts than the run's public probe set
    (text of its choosing, or another number of them), or in a run that does not probe: the party refuses the whole
    instruction, with nothing computed (neither the probe nor the phase's work)."""
    from distmoe.party import service
    from distmoe.wire.errors import Refused

    cfg = make_cfg(**{"privacy.mode": "plaintext", "routing.probe-prompts": 4,
                      "routing.probe-every": 0 if case == "run-does-not-probe" else 1})
    public = default_probe_prompts(cfg.run.seed, 4)
    prompts = {"not-public": ("What is the secret of party-0?",) + public[1:], "wrong-size": public[:3]}.get(case,
                                                                                                         public)
    sm = server_model(cfg.model)
    weights = {k: v.numpy() for k, v in sm.weights.items()}
    ran = []  # the phase's work, replaced by a stand-in that records the call
    monkeypatch.setattr(service, "_PLAIN", {k: lambda *a: ran.append(a) or RouterStats(np.zeros((1, 1)))
                                            for k in service._PLAIN})
    svc = PartyService(cfg, _node(cfg, tmp_path, tmp_path), node_id=7, run_id="r")
    with pytest.raises(Refused, match="PartyError"):
        svc.answer("train.stats", _carried(cfg, weights, sm.tspec.base_hash, prompts))
    assert not ran and svc.take_probe_bounds() is None  # no probe, no work


# ---------------------------------------------------------------- a hostile coordinator's probe request, at the guard
HOSTILE = {  # a hostile coordinator's prompts in place of the run's 4 public ones (the wire's bounds admit them all)
    "private-looking": lambda public: ("Patient record of party-0: diagnosis",) + public[1:],
    "many-varied": lambda public: tuple(f"Prompt {i}: what does party-0's data say about topic {i}?"
                                        for i in range(256)),
    "fewer": lambda public: public[:3],
    "run-does-not-probe": lambda public: public,
}


def _serve_probe(cfg, tmp_path, instr, monkeypatch):
    """``instr`` sent as a hostile coordinator would, past its own guard (encoded with a ledger head), to a real
    party through its outbound guard; -> (the reply or the ``Refused``, the party's ledger, its base loads)."""
    import json

    from distmoe.party import probe
    from distmoe.wire import codec
    from distmoe.wire.errors import Refused
    from distmoe.wire.party_guard import serve
    from distmoe.wire.schema import MSG_PROBE

    loads = []  # every load of the base a probe's forward pass needs (the real one, recorded)
    real = probe.prepare_model
    monkeypatch.setattr(probe, "prepare_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    svc = PartyService(cfg, _node(cfg, tmp_path, tmp_path), node_id=7, run_id="r")
    try:
        out = serve(MSG_PROBE, codec.with_ledger_head(codec.encode(instr), 1, "0" * 64), svc, "r")
    except Refused as exc:
        out = exc
    ledger = [json.loads(x) for x in open(svc.ledger.path).read().splitlines() if x]
    return out, ledger, loads, svc


def test_the_public_stand_alone_probe_request_passes_the_party_guard(make_cfg, tmp_path, monkeypatch):
    """The honest request (the run's public prompts) is measured: the recording below sees the forward pass."""
    cfg = make_cfg(**{"privacy.mode": "plaintext", "routing.probe-every": 1, "routing.probe-prompts": 4})
    sm = server_model(cfg.model)
    instr = ProbeInstruction(9, sm.tspec.base_hash, default_probe_prompts(cfg.run.seed, 4),
                             {k: v.numpy() for k, v in sm.weights.items()})
    out, ledger, loads, _ = _serve_probe(cfg, tmp_path, instr, monkeypatch)
    assert len(loads) == 1 and ledger[-1]["payload_type"] == "probe-reply" and ledger[-1]["verdict"] == "accepted"


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_stand_alone_probe_request_is_refused_before_any_forward_pass(make_cfg, tmp_path, monkeypatch,
                                                                                case):
    """The stand-alone probe (``query.probe``, after a run's last round or before a round that grows the model)
    with prompts of the coordinator's choosing (text that reads routing on private-looking inputs, or many varied
    prompts), another number of them, or in a run that does not probe: the party refuses it with code ``refused``
    before its base is loaded (no forward pass), logs the refusal in its signed ledger as it does a carried one,
    and names the request and its round in its own log."""
    from distmoe.wire.errors import ErrorCode, Refused
    from distmoe.wire.party_guard import party_log

    cfg = make_cfg(**{"privacy.mode": "plaintext", "routing.probe-prompts": 4,
                      "routing.probe-every": 0 if case == "run-does-not-probe" else 1})
    sm = server_model(cfg.model)
    prompts = HOSTILE[case](default_probe_prompts(cfg.run.seed, 4))
    instr = ProbeInstruction(9, sm.tspec.base_hash, prompts, {k: v.numpy() for k, v in sm.weights.items()})
    out, ledger, loads, svc = _serve_probe(cfg, tmp_path, instr, monkeypatch)
    assert isinstance(out, Refused) and out.code == ErrorCode.REFUSED and not loads
    assert [e["direction"] for e in ledger] == ["in", "out"] and ledger[0]["verdict"] == "accepted"
    assert ledger[1]["payload_type"] == "error" and ledger[1]["info"]["code"] == int(ErrorCode.REFUSED)
    detail = party_log(svc.ledger).read_text()
    assert "round 9: a stand-alone routing probe request (query.probe)" in detail and "refused" in detail
