"""Whole in-process runs with the routing probe: metrics every round under secure aggregation, a resume at a
probe, and the audit of such a run. (The probe's median, its disagreeing party and the routing-health warnings are
the probe step's: ``tests/coordinator/phases/test_public_exchanges.py``; the ``eval.every`` cadence is the
config's: ``tests/config/test_eval_cadence.py``.)

The parties run in this process (``LocalTransport``) through the wire codec, both guards and the ledgers.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from distmoe.audit.engine import audit_run
from distmoe.report.report import write_report
from distmoe.rundir.metrics import read_metrics

SCHEDULE = "sft:arith*2, stats:arith, sft:strings*2, eval"


def _field(line: str, start: str) -> bool:
    """A round line holds a field beginning with ``start``: after `` | ``, or first on a continuation line
    (``distmoe |     probe: ...``: round lines wrap at 100 columns)."""
    return re.search(r"\|\s+" + re.escape(start), line) is not None


def _sent(probes):
    """The rounds whose probe was exchanged: the first, and each after a round that changed the weights."""
    return [p["round"] for p in probes if p["round"] == 1 or p["phase_label"].split(":")[0] in ("sft", "rl", "dpo")]


def _ledger(run_dir):
    return [json.loads(x) for x in (run_dir / "ledger" / "coordinator.jsonl").read_text().splitlines()]


def _carried(entries):
    """The coordinator's accepted "in" entries of phase replies that carried a routing probe."""
    return [e for e in entries if e["direction"] == "in" and e["verdict"] == "accepted" and "probe.routing" in e["keys"]
            and e["payload_type"] != "probe-reply"]


def _rows(run_dir, event):
    return [e for e in read_metrics(run_dir / "metrics.jsonl") if e.get("event") == event]


@pytest.fixture(scope="module")
def probe_run(make_run, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe")
    coord, transport, run_dir, dirs, lines = make_run(tmp, {"schedule.phases": SCHEDULE, "routing.probe-every": 1,
                                                            "routing.probe-prompts": 6,
                                                            "routing.load-cv-warn": 0.01, "eval.every": 2})
    record = coord.run()
    return {"coord": coord, "transport": transport, "dir": run_dir, "record": record, "lines": lines}


@pytest.mark.integration
def test_probe_metrics_every_round_under_secagg(probe_run):
    run_dir, coord = probe_run["dir"], probe_run["coord"]
    assert coord.cfg.privacy.secure and probe_run["record"]["status"] == "completed"
    probes = _rows(run_dir, "probe")
    total = coord.cfg.schedule.total_rounds
    assert [p["round"] for p in probes] == list(range(1, total + 1))  # every round, whatever its phase
    L, E = coord.mspec.num_moe_layers, coord.mspec.num_experts
    for p in probes:
        assert p["parties"] == 3 and p["disagreeing"] == 0  # honest parties agree exactly on public inputs
        assert math.isfinite(p["load_cv"]) and p["load_cv"] >= 0
        counts = p["expert_counts"]
        assert len(counts) == L and all(len(r) == E for r in counts)
        assert len({sum(r) for r in counts}) == 1 and sum(counts[0]) > 0  # every layer routes the same tokens
    assert probes[0]["top1_consistency"] is None  # no earlier probe
    sent = _sent(probes)  # a probe not sent again (stats, eval: no weight changed) has no top-1 consistency
    assert all(0.0 <= p["top1_consistency"] <= 1.0 for p in probes[1:] if p["round"] in sent)
    assert all(p["top1_consistency"] is None for p in probes if p["round"] not in sent)
    stats_round = next(e["round"] for e in _rows(run_dir, "stats"))
    kl = {p["round"]: p["routing_kl"] for p in probes}
    assert all(kl[r] is None for r in kl if r < stats_round)  # no anchor yet
    assert all(kl[r] is not None and kl[r] >= 0 for r in kl if r >= stats_round)
    # a probe after a round that changed no weight (stats, eval) is not sent again: the last probe's median stands;
    # the others rode on the next round's instruction (every round here has a next one that sends the same weights)
    assert len(_sent(probes)) < total and probe_run["transport"].sent.get("query.probe", 0) == 0
    assert len(_carried(_ledger(run_dir))) == 3 * len(_sent(probes))
    lines = probe_run["lines"]
    assert any(_field(x, "probe of round ") and "load CV" in x for x in lines)
    # a probe not sent again adds to the progress line only a KL to an anchor built since the last probe: never the
    # same load CV again nor a top-1 consistency of 1 with itself (it read as a second, improved probe)
    repeated = [x for x in lines if _field(x, "probe: ")]
    assert repeated and all("load CV" not in x and "top-1" not in x and "KL" in x for x in repeated)
    # every line of the stream fits 100 columns as the terminal shows it ("  " + text), the load-CV warnings
    # (about 250 characters each, routing.load-cv-warn = 0.01 fires them) and the privacy header included
    assert any(x.startswith("distmoe | WARNING: round ") for x in lines)
    assert all(len("  " + x.removeprefix("distmoe | ")) <= 100 for x in lines), max(lines, key=len)


@pytest.mark.integration
def test_a_probe_not_sent_again_reads_what_the_parties_would_answer(probe_run):
    """The last round (eval) changed no weight, so its probe was not sent: its row is an honest party's own probe of
    the final model, exactly, and the same as the probe before it; it has no top-1 consistency (a 1 with itself
    read, in metrics.jsonl, the report's routing table and TensorBoard, as an improvement at a round that trained
    nothing)."""
    from distmoe.party.probe import run_probe
    from distmoe.routing.probe import expert_counts
    from distmoe.wire.schema import ProbeInstruction

    coord, transport = probe_run["coord"], probe_run["transport"]
    last, before = _rows(probe_run["dir"], "probe")[-1], _rows(probe_run["dir"], "probe")[-2]
    assert last["phase_label"] == "eval" and last["top1_consistency"] is None
    honest = run_probe(coord.cfg, transport.nodes[100], ProbeInstruction(
        last["round"], coord.tspec.base_hash, coord.probe_prompts, coord.np_weights(coord.s.weights)))
    assert last["expert_counts"] == expert_counts(honest.top1, coord.mspec.num_experts).tolist()
    assert last["expert_counts"] == before["expert_counts"] and last["parties"] == 3


@pytest.mark.integration
def test_probe_run_passes_the_audit(probe_run, failed_checks):
    run_dir = probe_run["dir"]
    write_report(run_dir)
    result = audit_run(run_dir)
    assert failed_checks(result) == set(), [c for c in result.checks if c.status == "fail"]
    sent = _sent(_rows(run_dir, "probe"))
    assert len(sent) == 4  # of 7 rounds, the 4 sft rounds changed the weights (not the stats and eval rounds)
    assert len(_carried(_ledger(run_dir))) == 3 * len(sent)  # declared in the signed allow-list: the audit passed


def test_a_bad_probe_file_stops_the_run_before_any_round(make_run, tmp_path):
    from distmoe.coordinator import RunFailed

    bad = tmp_path / "probe.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    coord, transport, run_dir, _, _ = make_run(tmp_path, {"routing.probe-every": 1, "routing.probe-path": str(bad)})
    with pytest.raises(RunFailed, match=r"routing.probe-path.*probe\.jsonl:2: expected an object"):
        coord.run()
    assert not transport.sent


class _Killed(Exception):
    """The coordinator process dies here (raised from inside the transport)."""


@pytest.mark.integration
def test_a_run_killed_at_a_probe_resumes_and_keeps_probing(lay_out_run, tmp_path, failed_checks):
    import uuid

    from distmoe.config import parse_run_config
    from distmoe.coordinator import Coordinator
    from distmoe.inprocess import LocalTransport

    cfg, nodes, run_dir, run_id = lay_out_run(tmp_path, "sft:arith*2, stats:arith, eval",
                                              **{"routing.probe-every": 1, "routing.probe-prompts": 4})
    seen = {"k": 0}

    def drop(mtype, node):  # the coordinator dies sending round 3's instruction, which carries round 2's probe
        seen["k"] += mtype == "train.stats"
        if mtype == "train.stats" and seen["k"] == 1:
            raise _Killed("killed at the probe of round 2")
        return False

    transport = LocalTransport(cfg, nodes, run_id)
    transport.drop = drop
    with pytest.raises(_Killed):
        Coordinator(cfg, run_dir, transport, run_id, log=lambda _s: None).run()
    rcfg = parse_run_config({**cfg.as_flat(), "run.resume": str(run_dir)})
    lines: list[str] = []
    rec = Coordinator(rcfg, run_dir, LocalTransport(rcfg, nodes, run_id), f"flower-{uuid.uuid4().hex[:6]}",
                      log=lines.append).run()
    assert rec["status"] == "completed"
    rounds = [p["round"] for p in _rows(run_dir, "probe")]
    assert rounds == [1, 2, 3, 4]  # round 2 was checkpointed before its probe: the resumed run carries it on round 3
    assert _rows(run_dir, "probe")[1]["top1_consistency"] is None  # starts afresh after a resume
    assert any(_field(x, "probe: ") for x in lines)
    assert failed_checks(audit_run(run_dir)) == set()


def _stages(entries, rnd):
    """The message stages of a round: the payload types the coordinator sent in it."""
    return sorted({e["payload_type"] for e in entries if e["direction"] == "out" and e["round"] == rnd})


@pytest.mark.integration
def test_a_carried_probe_measures_exactly_what_its_own_stage_measured(lay_out_run, tmp_path, monkeypatch):
    """The same seeded run on the same party data twice: the probe carried on the next round's instruction, and
    (``defer`` off) on its own message stage after each round as before. The probe rows are identical (the same
    weights are probed), and a training round is three message stages instead of four. (64-bit update sums, rounded
    to nearest: the default 32-bit ring rounds stochastically with fresh randomness, so no two runs are identical.)"""
    from distmoe.coordinator import Coordinator
    from distmoe.coordinator.phases import probe
    from distmoe.inprocess import LocalTransport

    over = {"routing.probe-every": 1, "routing.probe-prompts": 6, "privacy.ring-bits": "64"}

    def run(tmp, data_from=None):
        cfg, nodes, run_dir, run_id = lay_out_run(tmp, "sft:arith*3, eval", data_from=data_from, **over)
        transport = LocalTransport(cfg, nodes, run_id)
        assert Coordinator(cfg, run_dir, transport, run_id, log=lambda _s: None).run()["status"] == "completed"
        return transport, run_dir

    transport, run_dir = run(tmp_path / "carried")
    monkeypatch.setattr(probe, "defer", lambda co, keeps: False)
    transport2, run_dir2 = run(tmp_path / "alone", data_from=run_dir)
    carried, alone = ([{k: v for k, v in p.items() if k != "time"} for p in _rows(d, "probe")]
                      for d in (run_dir, run_dir2))
    assert [p["round"] for p in carried] == [1, 2, 3, 4] and carried == alone
    assert transport.sent.get("query.probe", 0) == 0 and transport2.sent["query.probe"] == 9
    c, a = _ledger(run_dir), _ledger(run_dir2)
    assert len(_carried(c)) == 9
    for rnd in (1, 2, 3):  # the training rounds
        assert _stages(c, rnd) == ["consistency-request", "sft-instruction", "unmask-request"]
        assert _stages(a, rnd) == ["consistency-request", "probe-instruction", "sft-instruction", "unmask-request"]


def test_the_probe_key_hashes_a_round_states_weights_once_and_a_new_state_again(monkeypatch):
    """The key of what a probe measures (``_measured``) is kept for the very weights dict it hashed: asked twice at
    a round's end, the 28.5 MB are hashed once; a new round state's dict (equal or not) and another base are hashed
    again, so a changed model never keeps an old key."""
    from types import SimpleNamespace

    import torch

    from distmoe.coordinator.phases import probe as P

    calls = []
    real = P.hash_tensors
    monkeypatch.setattr(P, "hash_tensors", lambda w: calls.append(1) or real(w))
    w1 = {"a": torch.ones(3)}
    co = SimpleNamespace(s=SimpleNamespace(weights=w1), tspec=SimpleNamespace(base_hash="b0"), probe_key_memo=None)
    k1 = P._measured(co)
    assert P._measured(co) == k1 and len(calls) == 1
    co.s = SimpleNamespace(weights={"a": torch.ones(3)})  # the next round's state, the same values
    assert P._measured(co) == k1 and len(calls) == 2
    co.s = SimpleNamespace(weights={"a": torch.zeros(3)})
    assert P._measured(co) != k1 and len(calls) == 3
    co.tspec = SimpleNamespace(base_hash="b1")
    assert P._measured(co).startswith("b1:") and len(calls) == 4
