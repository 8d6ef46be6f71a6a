"""Hostile or broken updates and anomalies, on whole in-process runs: the server rejects
what no honest party can produce, logs it in its ledger, leaves the global model untouched and goes on
(or stops, as configured). (Anomalous aggregate losses, flagged in the run record and the report, are the ``sft``
step's: ``tests/coordinator/phases/test_phase_sft.py``.)

Under secure aggregation the server cannot see one party's update, so a party that skips its own
clipping is caught on the decoded sum (``distmoe.aggregate.aggregate_problem``); in plaintext mode the
per-update norm-ratio screen applies (``divergent_updates``)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from distmoe.aggregate import aggregate_problem, divergent_updates, stats_sum_problem
from distmoe.audit import audit_run
from distmoe.coordinator import RunFailed
from distmoe.party import service as party_service
from distmoe.party import work as P
from distmoe.privacy.metric_noise import EvalSpec
from distmoe.privacy.ring import from_ring, to_ring
from distmoe.privacy.vectors import UpdateLayout, to_ring64
from distmoe.wire.errors import ErrorCode, reason_text
from distmoe.wire.schema import ModelUpdate, SftInstruction


# ------------------------------------------------------------------------------------------- units
def test_norm_ratio_screen_rejects_only_the_outlier():
    rng = np.random.default_rng(0)
    ups = {n: {"w": rng.normal(0, 1, 50)} for n in (1, 2, 3, 4)}
    ups[3] = {"w": ups[3]["w"] * 40}
    bad = divergent_updates(ups, 10.0)
    assert list(bad) == [3] and "round median" in bad[3] and "federation.max-norm-ratio" in bad[3]
    assert divergent_updates(ups, 0.0) == {}  # off
    assert divergent_updates({1: ups[1], 3: ups[3]}, 10.0) == {}  # no median of two


def test_aggregate_bounds_hold_for_honest_sums_and_catch_broken_ones():
    lay = UpdateLayout.build({"w": (4,)}, 3, clip=1.0)
    honest = {"w": np.array([0.5, -0.5, 0.5, 0.0])}
    assert aggregate_problem(lay, honest, 3.0, 3) is None
    assert "norm" in aggregate_problem(lay, {"w": np.array([3.0, 0, 0, 0])}, 3.0, 3)
    assert "total weight" in aggregate_problem(lay, honest, 4.0, 3)  # uniform weights: at most one per party
    assert "not finite" in aggregate_problem(lay, {"w": np.array([np.nan, 0, 0, 0])}, 3.0, 3)
    priv = UpdateLayout.build({"w": (4,)}, 3, clip=1.0, private=True)
    noisy = {"w": honest["w"] + np.random.default_rng(1).normal(0, 2.0 * math.sqrt(3 / 2) / 3, 4)}
    assert aggregate_problem(priv, noisy, 3.0, 3, update_noise_multiplier=2.0, threshold=2) is None
    assert "total weight" in aggregate_problem(priv, noisy, 4.0, 3, update_noise_multiplier=2.0, threshold=2)


def test_stats_and_eval_sum_bounds():
    ints = np.array([[300, 340], [320, 320]])  # rows 640 = N*s with N = 10, s = 64
    assert stats_sum_problem(ints, 64, 3, 100, sigma_int=5.0) is None
    assert "outside" in stats_sum_problem(np.array([[2**40, 0], [0, 0]]), 64, 3, 100, 5.0)
    assert "rows differ" in stats_sum_problem(np.array([[300, 340], [900, 320]]), 64, 3, 100, 5.0)
    spec = EvalSpec(("a", "b"), 1.0, 3, 1, 100, 16.0)
    honest = to_ring64(spec.sums({"a": [(True, 1.0)] * 40}) * 2)
    assert spec.problem(honest, 2) is None
    assert "outside" in spec.problem(to_ring64(np.array([0, 0, 64 * 10**6, 0, 0, 0])), 2)


# --------------------------------------------------------------------------------- whole runs
def _blow_up(monkeypatch, party: str, factor: float, clip: bool):
    """``party`` returns a delta ``factor`` times too large; with ``clip=False`` it also skips the clipping
    its honest layout would apply (a party that bypasses its own code, not its outbound guard)."""
    real_sft, real_encode = P.run_sft, UpdateLayout.encode

    def sft(cfg, node, instr, loaded=None):
        upd = real_sft(cfg, node, instr, loaded)
        if node.party != party:
            return upd
        return ModelUpdate(upd.party, {k: v * factor for k, v in upd.delta.items()}, upd.num_examples, upd.metrics)

    def encode(self, delta, num_examples, rng=None):
        vec, facts = real_encode(self, delta, num_examples, rng)
        if clip:
            return vec, facts
        # the same fixed-point layout, but the delta block unclipped
        flat = np.concatenate([np.asarray(delta[k], np.float64).ravel() for k, _ in self.shapes])
        signed = from_ring(vec).astype(np.int64)  # in the release's word width (32 or 64 bits)
        signed[:self.numel] = np.rint(flat * self.weight_of(num_examples) * 2.0**self.frac_bits).astype(np.int64)
        if self.bits == 32:  # the unclipped block wraps in Z_2^32 as it would on the wire
            signed = ((signed + 2**31) % 2**32) - 2**31
        return to_ring(signed, self.bits), facts

    monkeypatch.setattr(P, "run_sft", sft)
    monkeypatch.setitem(party_service._PLAIN, SftInstruction, sft)  # the plaintext path's bound reference
    monkeypatch.setattr(UpdateLayout, "encode", encode)


def _weights_of(coord) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in coord.s.weights.items()}


@pytest.mark.integration
def test_unclipped_update_under_secagg_is_rejected_and_the_model_untouched(tmp_path, monkeypatch, make_run, releases,
                                                                           failed_checks):
    coord, _, run_dir, _, lines = make_run(tmp_path, {"schedule.phases": "sft:arith, eval",
                                                      "privacy.update-clip": 1.0})
    _blow_up(monkeypatch, "party-1", 1e4, clip=False)
    before = {}
    real_start = coord.start_plane

    def start(nodes):
        real_start(nodes)
        before.update(_weights_of(coord))

    coord.start_plane = start
    coord.run()
    (upd,) = releases(run_dir, "model-update")
    assert upd["info"]["applied"] is False and upd["verdict"].startswith("rejected: average update norm")
    for k, v in coord.s.weights.items():  # never touched by the rejected sum
        assert torch.equal(v, before[k]), k
    assert any("rejected" in x and "model-update" in x for x in lines)
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["status"] == "completed"  # the run went on: the eval round ran
    assert len(releases(run_dir, "eval")) == 1
    assert "no-blocked" in failed_checks(audit_run(run_dir))


@pytest.mark.integration
def test_rejected_round_stops_the_run_when_configured(tmp_path, monkeypatch, make_run, releases):
    coord, _, run_dir, _, _ = make_run(tmp_path, {"schedule.phases": "sft:arith, eval", "privacy.update-clip": 1.0,
                                                  "federation.on-round-failure": "stop"})
    _blow_up(monkeypatch, "party-1", 1e4, clip=False)
    with pytest.raises(RunFailed, match="federation.on-round-failure"):
        coord.run()
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["status"] == "failed" and "aggregate rejected" in rec["error"]
    assert releases(run_dir, "eval") == []


@pytest.mark.integration
def test_too_many_dropouts_stop_the_run_when_configured(tmp_path, make_run, releases):
    coord, transport, run_dir, _, _ = make_run(tmp_path, {"schedule.phases": "stats:arith, eval",
                                                          "federation.on-round-failure": "stop"})
    from distmoe.wire import codec

    transport.drop = lambda mtype, node: mtype == codec.MSG_STATS and node in (101, 102)
    with pytest.raises(RunFailed, match="no secure sum"):
        coord.run()
    assert releases(run_dir, "router-stats") == []


@pytest.mark.integration
def test_plaintext_outlier_update_is_rejected_by_the_norm_ratio(tmp_path, monkeypatch, make_run, releases):
    coord, _, run_dir, _, _ = make_run(tmp_path, {"schedule.phases": "sft:arith", "privacy.mode": "plaintext"})
    _blow_up(monkeypatch, "party-2", 1e3, clip=True)
    coord.run()
    (upd,) = releases(run_dir, "model-update")
    assert sorted(upd["info"]["included"]) == ["party-0", "party-1"]
    assert "party-2" in upd["info"]["rejected"] and "round median" in upd["info"]["rejected"]["party-2"]
    errors = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
              if json.loads(x).get("event") == "party_error"]
    assert any(e["party"] == "party-2" and e["code"] == "screened" and "max-norm-ratio" in e["reason"]
               for e in errors)


# ------------------------------------------------------------------------------------------ bad data
@pytest.mark.integration
@pytest.mark.parametrize("content,needle", [
    ('{"instruction": "Compute", "input": "1+1", "output": "2"}\n{"instruction": "x", "output": 3}\n',
     "arith.jsonl:2: field 'output': expected a string"),
    ('{"messages": [{"role": "wizard", "content": "hi"}]}\n', "arith.jsonl:1: field 'messages[0].role'"),
    ("not json at all\n", "arith.jsonl:1"),
    ("", "arith.jsonl"),
])
def test_bad_party_data_is_refused_at_setup_naming_file_line_and_field(tmp_path, content, needle, make_run, releases):
    coord, _, run_dir, dirs, _ = make_run(tmp_path, {"schedule.phases": "sft:arith, eval",
                                                     "federation.min-available": 2})
    (dirs[2] / "arith.jsonl").write_text(content)
    coord.run()
    errors = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
              if json.loads(x).get("event") == "party_error"]
    (err,) = [e for e in errors if e["node"] == "102"]  # no party name yet: it never joined
    assert err["phase_label"] == "setup" and err["code"] == "data" and err["reason"] == reason_text(ErrorCode.DATA)
    log = (run_dir / "work" / "party-2" / "party.log").read_text()  # file, line and field stay at the party
    assert "invalid data" in log and needle in log, log
    p2 = [json.loads(x) for x in (run_dir / "work" / "party-2" / "ledger" / "party-2.jsonl").read_text().splitlines()]
    assert not any(e["payload_type"].startswith("masked-input") for e in p2)  # never trained, never sent
    (upd,) = releases(run_dir, "model-update")
    assert sorted(upd["info"]["included"]) == ["party-0", "party-1"]


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["nan", "inf", "wrong-shape", "wrong-dtype", "trailing-bytes", "oversized"])
def test_broken_plaintext_update_is_rejected_logged_and_never_applied(tmp_path, kind, make_run, releases):
    """Plaintext mode (the baseline): a party that bypasses its guard sends a broken update; the server
    rejects it (guard or update check), logs it, aggregates the others and goes on."""
    from flwr.app import Array

    from distmoe.wire import codec

    coord, transport, run_dir, _, _ = make_run(tmp_path, {"schedule.phases": "sft:arith, eval",
                                                          "privacy.mode": "plaintext"})

    def tamper(node, mtype, rd):
        if node != 102 or mtype != codec.MSG_SFT:
            return rd
        rec = rd.array_records["arrays"]
        name = sorted(rec.keys())[0]
        a = rec[name].numpy().copy()
        if kind == "nan":
            a.flat[0] = np.nan
            rec[name] = Array(a)
        elif kind == "inf":
            a.flat[-1] = np.inf
            rec[name] = Array(a)
        elif kind == "wrong-shape":
            rec[name] = Array(a.reshape(-1)[:-1].copy())
        elif kind == "wrong-dtype":
            rec[name] = Array(a.astype(np.float64))
        elif kind == "trailing-bytes":
            rec[name] = Array(dtype=rec[name].dtype, shape=rec[name].shape, stype=rec[name].stype,
                              data=rec[name].data + b"x" * 64)
        elif kind == "oversized":
            rec["extra"] = Array(np.zeros(8_000_000, np.float32))
        return rd

    transport.tamper = tamper
    coord.run()
    (upd,) = releases(run_dir, "model-update")
    assert sorted(upd["info"]["included"]) == ["party-0", "party-1"]
    errors = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
              if json.loads(x).get("event") == "party_error"]
    assert any(e["node"] == "102" for e in errors)
    coordl = [json.loads(x) for x in (run_dir / "ledger" / "coordinator.jsonl").read_text().splitlines() if x]
    # a range of the packed message that is not one well-formed array (trailing bytes) fails in the unpacking,
    # before the payload's type is read: logged as "unknown"
    kinds = ("model-update", "unknown") if kind == "trailing-bytes" else ("model-update",)
    bad = [e for e in coordl if e["direction"] == "in" and e["peer"] in ("party-2", "node-102")
           and e["payload_type"] in kinds]
    assert bad and bad[0]["verdict"].startswith("rejected"), [(e["peer"], e["payload_type"], e["verdict"])
                                                              for e in coordl if e["direction"] == "in"]
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"
