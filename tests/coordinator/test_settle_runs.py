"""Whole in-process runs with the bias settle (``routing.balance-settle-steps``): every party settles the routing
bias of each aggregated model on public prompts and the median becomes the global bias before the checkpoint;
lying parties are outvoted or, beyond the schedule's total step ``U``, refused (that rule on hand-made replies:
``tests/coordinator/phases/test_public_exchanges.py``).

The parties run in this process (``LocalTransport``) through the wire codec, both guards and the ledgers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from distmoe.audit.engine import audit_run
from distmoe.rundir.metrics import read_metrics

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


def test_the_settle_exchange_is_on_the_allow_list_only_when_configured():  # no run: the policy built from facts
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
