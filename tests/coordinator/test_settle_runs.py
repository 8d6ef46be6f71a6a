"""Whole in-process runs with the bias settle (``routing.balance-settle-steps``): every party settles the routing
bias of each aggregated model on public prompts and the median becomes the global bias before the checkpoint;
lying parties are outvoted or, beyond the schedule's total step ``U``, refused.

The parties run in this process (``LocalTransport``) through the wire codec, both guards and the ledgers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from distmoe.audit.engine import audit_run
from distmoe.report.metrics_log import read_metrics

K, U = 20, 0.02
SETTLE = {"schedule.phases": "sft:arith*2, eval", "routing.balance": "aux+bias", "routing.balance-count": "first",
          "routing.balance-source": "public", "routing.balance-settle-steps": K, "routing.balance-settle-rate": U,
          "routing.balance-settle-schedule": "constant",
          "routing.probe-prompts": 4, "train.local-steps": 4, "checkpoint.keep": 10}


def _rows(run_dir, event):
    return [e for e in read_metrics(run_dir / "metrics.jsonl") if e.get("event") == event]


def _spy(monkeypatch, lie=None):
    """Record every settle exchange (the instruction's pre-settle bias, each party's reply); ``lie(party, reply)``
    may replace a reply."""
    import distmoe.party.service as service
    from distmoe.coordinator.phases.settle import bias_keys

    real, seen = service.run_settle, []

    def spy(cfg, node, instr):
        rep = real(cfg, node, instr)
        keys = bias_keys(instr.weights)
        seen.append((instr.round, node.party, np.stack([instr.weights[k] for k in keys]).astype(np.float64),
                     rep.bias))
        return lie(node.party, rep) if lie is not None else rep

    monkeypatch.setattr(service, "run_settle", spy)
    return seen


def _checkpoint_bias(run_dir, rnd):
    from distmoe.checkpoint import load_trainable_file

    t = load_trainable_file(run_dir / "checkpoints" / f"round-{rnd}")
    keys = [k for k in t if k.endswith(".balance_bias")]
    return np.stack([np.asarray(t[k], np.float64) for k in keys])


@pytest.fixture(scope="module")
def settle_run(make_run, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    seen = _spy(mp)
    try:
        coord, transport, run_dir, _, lines = make_run(tmp_path_factory.mktemp("settle"), SETTLE)
        record = coord.run()
    finally:
        mp.undo()
    return {"coord": coord, "transport": transport, "dir": run_dir, "record": record, "seen": seen}


@pytest.mark.integration
def test_every_update_is_settled_and_the_checkpoint_holds_the_parties_settled_bias(settle_run):
    run_dir, seen = settle_run["dir"], settle_run["seen"]
    assert settle_run["record"]["status"] == "completed" and settle_run["coord"].cfg.privacy.secure
    rows = _rows(run_dir, "settle")
    assert [r["round"] for r in rows] == [1, 2]  # the sft rounds; the eval round changes no weight
    assert settle_run["transport"].sent["query.settle"] == 3 * 2
    for r in rows:
        replies = [b for rnd, _, _, b in seen if rnd == r["round"]]
        before = next(w for rnd, _, w, _ in seen if rnd == r["round"])
        assert len(replies) == 3 and all(np.array_equal(b, replies[0]) for b in replies)  # public inputs only
        assert r["parties"] == 3 and r["disagreeing"] == 0
        moved = np.abs(replies[0] - before).max()
        assert 0 < moved <= K * U + 1e-6 and abs(r["moved"] - moved) < 1e-6
        # the round's checkpoint holds the settled bias (float32 on the wire and at rest)
        assert np.allclose(_checkpoint_bias(run_dir, r["round"]), replies[0], atol=1e-6)


@pytest.mark.integration
def test_a_settled_run_passes_the_audit(settle_run, failed_checks):
    run_dir = settle_run["dir"]
    result = audit_run(run_dir)
    assert failed_checks(result) == set(), [c for c in result.checks if c.status == "fail"]
    ledger = [json.loads(x) for x in (run_dir / "ledger" / "coordinator.jsonl").read_text().splitlines()]
    assert sum(e["payload_type"] == "settle-reply" and e["verdict"] == "accepted" for e in ledger) == 3 * 2


@pytest.mark.integration
def test_lying_parties_are_outvoted_below_the_bound_and_refused_beyond_it(make_run, tmp_path, monkeypatch):
    """Round 1: party-1 reports a bias off by half the bound (outvoted by the median, named). Round 2: party-1 and
    party-2, a majority, report the bias pushed 5 beyond the bound: both refused, the honest party's value holds,
    so even a dishonest majority moves the bias by at most ``K * u_s``."""
    from distmoe.wire.schema import SettleReply

    def lie(party, rep):
        if party == "party-1" and lie.round == 1:
            return SettleReply(party, rep.bias + 0.5 * K * U)
        if party in ("party-1", "party-2") and lie.round == 2:
            return SettleReply(party, rep.bias + 5.0)
        return rep

    import distmoe.party.service as service

    seen = _spy(monkeypatch, lie)
    spied = service.run_settle

    def with_round(cfg, node, instr):
        lie.round = instr.round
        return spied(cfg, node, instr)

    monkeypatch.setattr(service, "run_settle", with_round)
    coord, _, run_dir, _, _ = make_run(tmp_path, {**SETTLE, "privacy.mode": "plaintext"})
    assert coord.run()["status"] == "completed"
    rows = {r["round"]: r for r in _rows(run_dir, "settle")}
    assert rows[1]["parties"] == 3 and rows[1]["disagreeing"] == 1
    assert rows[2]["parties"] == 1 and rows[2]["disagreeing"] == 2
    for rnd in (1, 2):
        honest = next(b for r, p, _, b in seen if r == rnd and p == "party-0")
        before = next(w for r, p, w, _ in seen if r == rnd and p == "party-0")
        assert np.allclose(_checkpoint_bias(run_dir, rnd), honest, atol=1e-6)
        assert np.abs(_checkpoint_bias(run_dir, rnd) - before).max() <= K * U + 1e-5
    warns = [w["detail"] for w in _rows(run_dir, "routing_warning") if w["kind"] == "settle"]
    assert len(warns) == 2  # once per party
    assert "party party-1's settled routing bias" in warns[0] and "party party-2's" in warns[1]


def test_the_settle_exchange_is_on_the_allow_list_only_when_configured():
    from distmoe.wire.server_guard import build_policy

    facts = {"secure": True, "n_parties": 3, "trainable": {"w": (4, 2)}, "layers": 2, "experts": 4,
             "update_length": 8, "stats_length": 8, "rl_update_length": 8, "tasks": ("arith",), "eval_length": 3}
    assert "settle-reply" not in build_policy(**facts)
    pol = build_policy(**facts, settle=True)
    assert pol["settle-reply"]["shapes"] == {"bias.bias": [2, 4]}
    assert set(pol["settle-instruction"]["keys"]) >= {"arrays.w", "meta.round", "meta.base_hash"}


def test_the_bound_is_the_schedules_total_step(make_cfg):
    """``U``: ``K u_s`` for the constant schedule, ``u_s (K + 1) / 2`` for the linear one, so a reply 0.75 K u_s
    away (within reach of a constant settle, not of a linear one) is refused under the linear schedule."""
    from distmoe.coordinator.phases.settle import move_bound, usable

    keys = {**SETTLE, "routing.balance-settle-steps": 10, "routing.balance-settle-rate": 0.02}
    const = make_cfg(**keys).routing
    lin = make_cfg(**{**keys, "routing.balance-settle-schedule": "linear"}).routing
    assert move_bound(const) == pytest.approx(0.2, abs=1e-5) and move_bound(lin) == pytest.approx(0.11, abs=1e-5)
    cur, far = np.zeros((2, 4)), np.full((2, 4), 0.15)
    assert usable(far, cur, move_bound(const)) and not usable(far, cur, move_bound(lin))
