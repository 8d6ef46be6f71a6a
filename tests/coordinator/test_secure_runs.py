"""Adversarial and fault cases of whole runs with the privacy plane on, each asserting its outcome.

Three parties run in process (``LocalTransport``: the exact party code path with its outbound guard
and ledger, the codec records, the server guard), then ``distmoe audit`` judges the run directory.
The protocol-level matrix (abort cases, uniform masks, tampered shares) is in ``tests/privacy/secagg/test_secagg.py``.
"""

from __future__ import annotations

import json
import math
import shutil
import tomllib
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord

from distmoe.audit import audit_run
from distmoe.coordinator import PrivacyStop
from distmoe.data.party import load_party
from distmoe.wire import codec, party_guard
from distmoe.wire.errors import ALL_REASONS

pytestmark = pytest.mark.integration  # every test here judges a whole in-process run


def ledger(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x]


@pytest.fixture(scope="module")
def honest(tmp_path_factory, make_run):
    tmp = tmp_path_factory.mktemp("honest")
    coord, transport, run_dir, dirs, lines = make_run(tmp)
    coord.run()
    return run_dir, dirs, lines


# ------------------------------------------------------------------------------------------ honest run
def test_honest_run_passes_the_audit(honest, releases):
    run_dir, dirs, lines = honest
    result = audit_run(run_dir)
    assert result.verdict == "pass", [(c.name, c.findings) for c in result.checks if c.status == "fail"]
    assert {c.name for c in result.checks if c.status == "pass"} == {
        "ledger-integrity", "cross-check", "allow-list", "no-blocked", "no-plaintext", "epsilon", "noise-presence",
        "row-sums", "row-noise", "canary-positions", "min-parties", "canaries", "server-files", "mask-uniformity",
        "run-end", "coordinator-heads", "release-coverage", "schedule-coverage", "release-records"}
    assert result.check("receipts").status == "skipped" and result.unwitnessed == []  # every party ledger is here
    (stats,) = releases(run_dir, "router-stats")
    assert sorted(stats["info"]["included"]) == ["party-0", "party-1", "party-2"]
    assert stats["dp"]["n_active"] == 3 and stats["dp"]["z_eff"] > stats["dp"]["noise_multiplier"]
    # the canary strings are nowhere outside the party side of the run
    for d in dirs:
        secret = (d / "canaries.txt").read_text().strip().encode()
        for f in run_dir.rglob("*"):
            if f.is_file() and "work" not in f.relative_to(run_dir).parts:
                assert secret not in f.read_bytes(), f


def test_coordinator_sees_masked_vectors_only(honest):
    """What the coordinator received from each party: protocol fields and a uint64 masked vector."""
    run_dir, _, _ = honest
    entries = ledger(run_dir / "ledger" / "coordinator.jsonl")
    inbound = [e for e in entries if e["direction"] == "in" and not e["payload_type"].startswith("release")]
    assert {e["payload_type"] for e in inbound} == {
        "key-advert", "share-keys", "masked-input:model-update", "masked-input:router-stats", "masked-input:eval",
        "consistency-response", "unmask-response"}
    for e in inbound:
        assert e["verdict"] == "accepted" and e["anchor"]["node"] == e["peer"]
        assert not any(k.startswith(("arrays.", "stats.", "metrics.")) for k in e["keys"]), e["keys"]


# ------------------------------------------ what the server wrote: schema-checked files
@pytest.mark.parametrize("edit", ["honest", "per-party-row", "training-example", "report-text"])
def test_server_files_of_a_real_run_are_schema_checked(honest, tmp_path, edit, failed_checks):
    from distmoe.report.report import write_report

    src, dirs, _ = honest
    run_dir = tmp_path / "run"
    shutil.copytree(src, run_dir)
    write_report(run_dir)
    if edit == "per-party-row":
        with (run_dir / "metrics.jsonl").open("a") as fh:
            fh.write(json.dumps({"event": "train", "round": 1, "party": "party-1", "loss": 1.2}) + "\n")
    elif edit == "training-example":  # one raw line of a party's data, as a metrics row
        with (run_dir / "metrics.jsonl").open("a") as fh:
            fh.write((dirs[1] / "arith.jsonl").read_text().splitlines()[0] + "\n")
    elif edit == "report-text":
        md = run_dir / "report" / "report.md"
        md.write_text(md.read_text() + "\nparty-1 trained on: What is 17+25? 42\n")
    result = audit_run(run_dir)
    if edit == "honest":
        assert result.verdict == "pass", [(c.name, c.findings) for c in result.checks if c.status == "fail"]
        return
    assert failed_checks(result) == {"server-files"}
    (check,) = [c for c in result.checks if c.name == "server-files"]
    where = {"per-party-row": "metrics.jsonl:", "training-example": "metrics.jsonl:",
             "report-text": "report/report.md:"}[edit]
    assert check.findings and check.findings[0].startswith(where), check.findings


# --------------------------------------------------------------------------------- leaky clients
def _leak(kind: str):
    def mutate(rd):
        if kind == "text-metric":
            rd["metrics_text"] = ConfigRecord({"note": "patient 4711 has condition X"})
        elif kind == "hidden-state":
            rd["hidden"] = ArrayRecord({"h": Array(np.random.default_rng(0).normal(size=(96, 64)).astype(np.float32))})
        elif kind == "per-sample-grad":
            rd["grads"] = ArrayRecord({"g": Array(np.zeros((4, 4, 64), np.float32))})
        elif kind == "extra-field":
            rd["masked"]["loss"] = 1.25
        elif kind == "shape-lie":
            y = rd.array_records["masked_y"]["y"].numpy()
            rd["masked_y"] = ArrayRecord({"y": Array(np.concatenate([y, np.zeros(8, np.uint64)]))})
        return rd
    return mutate


@pytest.mark.parametrize("kind", ["text-metric", "hidden-state", "per-sample-grad", "extra-field", "shape-lie"])
def test_leaky_client_is_blocked_client_side_and_fails_the_audit(tmp_path, monkeypatch, kind, make_run, releases,
                                                                 failed_checks):
    coord, transport, run_dir, _, lines = make_run(tmp_path, {"schedule.phases": "sft:arith, eval"})
    real = codec.encode
    mutate = _leak(kind)

    def leaky(payload, memo=None):
        rd = real(payload, memo)
        m = getattr(payload, "masked", None)
        if m is not None and m.sender == 101 and payload.release == "model-update":
            rd = mutate(rd)
        return rd

    monkeypatch.setattr(party_guard.codec, "encode", leaky)
    coord.run()
    party1 = ledger(run_dir / "work" / "party-1" / "ledger" / "party-1.jsonl")
    blocked = [e for e in party1 if e["verdict"].startswith("rejected")]
    assert len(blocked) == 1 and blocked[0]["payload_type"] == "masked-input:model-update"
    errors = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
              if json.loads(x).get("event") == "party_error"]
    assert any(e["code"] == "blocked" and e["reason"] == ALL_REASONS["blocked"] for e in errors)
    assert "blocked by the outbound guard" in (run_dir / "work" / "party-1" / "party.log").read_text()
    (upd,) = releases(run_dir, "model-update")
    assert sorted(upd["info"]["included"]) == ["party-0", "party-2"]  # the round went on without it
    # nothing of it arrived: the coordinator logged an error reply, not a payload
    coordl = ledger(run_dir / "ledger" / "coordinator.jsonl")
    from_1 = [e for e in coordl if e["direction"] == "in" and e["peer"] == "party-1" and e["round"] == 1]
    assert [e["payload_type"] for e in from_1] == ["error"]
    result = audit_run(run_dir)
    assert result.verdict == "fail" and "no-blocked" in failed_checks(result)


@pytest.mark.parametrize("kind", ["trailing-bytes", "extra-record", "shape-lie", "raw-update", "wrong-dtype",
                                  "oversized"])
def test_client_bypassing_its_guard_is_rejected_server_side(tmp_path, kind, make_run, releases, failed_checks):
    """What a modified client could send without its guard: the server guard rejects it."""
    coord, transport, run_dir, _, _ = make_run(tmp_path, {"schedule.phases": "sft:arith, eval"})

    def tamper(node, mtype, rd):
        if node != 102 or mtype != codec.MSG_SFT:
            return rd
        if kind == "trailing-bytes":
            a = rd.array_records["masked_y"]["y"]
            rd.array_records["masked_y"]["y"] = Array(dtype=a.dtype, shape=a.shape, stype=a.stype,
                                                      data=a.data + b"smuggled" * 75)
        elif kind == "extra-record":
            rd["leak"] = ConfigRecord({"text": "a line of private data"})
        elif kind == "shape-lie":
            a = rd.array_records["masked_y"]["y"].numpy()
            rd.array_records["masked_y"]["y"] = Array(a[:-1].copy())
        elif kind == "raw-update":  # a plaintext update instead of a masked vector
            rd["arrays"] = ArrayRecord({"w": Array(np.ones((64, 64), np.float32))})
        elif kind == "wrong-dtype":  # the same numbers as float64: twice the bytes, the wrong type
            a = rd.array_records["masked_y"]["y"].numpy()
            rd.array_records["masked_y"]["y"] = Array(a.astype(np.float64))
        elif kind == "oversized":  # a second vector the size of the first beside it
            a = rd.array_records["masked_y"]["y"].numpy()
            rd.array_records["masked_y"]["y2"] = Array(np.concatenate([a, a]))
        return rd

    transport.tamper = tamper
    coord.run()
    coordl = ledger(run_dir / "ledger" / "coordinator.jsonl")
    rejected = [e for e in coordl if e["verdict"].startswith("rejected")]
    assert len(rejected) == 1 and rejected[0]["peer"] == "party-2", rejected
    (upd,) = releases(run_dir, "model-update")
    assert sorted(upd["info"]["included"]) == ["party-0", "party-1"]
    result = audit_run(run_dir)
    assert result.verdict == "fail" and "no-blocked" in failed_checks(result)


# ---------------------------------------------------------------------------------------- noise
def test_client_that_skips_its_noise_share_fails_noise_presence(tmp_path, monkeypatch, make_run, failed_checks):
    coord, _, run_dir, _, _ = make_run(tmp_path, {"schedule.phases": "stats:arith", "privacy.noise-canaries": 1024})
    from distmoe.privacy import dp

    real = dp.client_share
    calls = {"n": 0}

    def lazy(int_stats, spec, n, rng=None):
        calls["n"] += 1
        if calls["n"] == 1:  # the first party of the round "forgets" its noise
            return dp.pack(int_stats, spec.n_canaries)
        return real(int_stats, spec, n, rng)

    monkeypatch.setattr(dp, "client_share", lazy)
    coord.run()
    result = audit_run(run_dir)
    assert result.verdict == "fail" and failed_checks(result) == {"noise-presence"}


def test_audit_matches_each_party_canary_scan_to_its_own_list(honest, tmp_path):
    """The party's outbound scans must have covered every canary string of its data (node files name the
    party with ``party-name``)."""
    run_dir = tmp_path / "run"
    shutil.copytree(honest[0], run_dir)
    assert audit_run(run_dir).verdict == "pass"
    node_file = run_dir / "nodes" / "node-0.toml"
    data = Path(tomllib.loads(node_file.read_text())["data-path"])
    copy = run_dir / data.relative_to(honest[0])  # point the copied node file at the copied data
    node_file.write_text(node_file.read_text().replace(json.dumps(str(data)), json.dumps(str(copy))))
    with (copy / "canaries.txt").open("a") as fh:
        fh.write("a canary the party never scanned for\n")
    result = audit_run(run_dir)
    (can,) = [c for c in result.checks if c.name == "canaries"]
    assert can.status == "fail" and any("party-0 has 2" in f for f in can.findings)


# --------------------------------------------------------------------------------------- ledgers
def test_edited_party_ledger_fails_the_audit(honest, tmp_path, failed_checks):
    run_dir = tmp_path / "run"
    shutil.copytree(honest[0], run_dir)
    path = run_dir / "work" / "party-0" / "ledger" / "party-0.jsonl"
    lines = path.read_text().splitlines()
    e = json.loads(lines[3])
    e["bytes"] += 1
    lines[3] = json.dumps(e, sort_keys=True, separators=(",", ":"))
    path.write_text("\n".join(lines) + "\n")
    result = audit_run(run_dir)
    assert result.verdict == "fail" and "ledger-integrity" in failed_checks(result)


def test_truncated_party_ledger_fails_the_audit(honest, tmp_path, failed_checks):
    run_dir = tmp_path / "run"
    shutil.copytree(honest[0], run_dir)
    path = run_dir / "work" / "party-1" / "ledger" / "party-1.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-2]) + "\n")  # a clean cut: the chain itself still verifies
    result = audit_run(run_dir)
    assert result.verdict == "fail" and "ledger-integrity" in failed_checks(result)


def test_edited_coordinator_release_fails_the_audit(honest, tmp_path, failed_checks):
    run_dir = tmp_path / "run"
    shutil.copytree(honest[0], run_dir)
    path = run_dir / "ledger" / "coordinator.jsonl"
    text = path.read_text().replace('"n_active":3', '"n_active":30', 1)
    path.write_text(text)
    result = audit_run(run_dir)
    assert result.verdict == "fail" and "ledger-integrity" in failed_checks(result)


# -------------------------------------------------------------------------------------- dropouts
def _train_sequences(d: Path, cfg) -> int:
    return len(load_party(d, cfg.data).train("arith"))


@pytest.mark.parametrize("stage,included,responders", [
    (codec.MSG_SETUP, ["party-0", "party-1"], ["party-0", "party-1"]),
    (codec.MSG_DIRECTORY, ["party-0", "party-1"], ["party-0", "party-1"]),
    (codec.MSG_STATS, ["party-0", "party-1"], ["party-0", "party-1"]),
    (codec.MSG_CONSISTENCY, ["party-0", "party-1", "party-2"], ["party-0", "party-1"]),  # did not sign: not asked
    (codec.MSG_UNMASK, ["party-0", "party-1", "party-2"], ["party-0", "party-1"]),
])
def test_dropout_at_each_stage_leaves_the_survivors_sum_and_a_passing_audit(tmp_path, stage, included, responders,
                                                                            make_run, releases):
    coord, transport, run_dir, dirs, lines = make_run(tmp_path, {"schedule.phases": "stats:arith"})
    transport.drop = lambda mtype, node: mtype == stage and node == 102
    coord.run()
    (rel,) = releases(run_dir, "router-stats")
    assert sorted(rel["info"]["included"]) == included
    assert sorted(rel["info"]["responders"]) == responders
    # the anchor's sequence count (free post-processing of the noisy rows) matches the survivors' data
    cfg = coord.cfg
    n_true = sum(_train_sequences(d, cfg) for d in dirs if d.name in included)
    meta = json.loads(next((run_dir / "anchors").glob("round-*.json")).read_text())
    dp = rel["dp"]
    L, E = 2, 4
    count_std = math.sqrt(E / L) * dp["sigma_int"] / dp["scale"]
    assert abs(meta["num_sequences"] - n_true) < 6 * count_std + 2, (meta["num_sequences"], n_true, count_std)
    result = audit_run(run_dir)
    assert result.verdict == "pass", [(c.name, c.findings) for c in result.checks if c.status == "fail"]
    eps = result.epsilon
    assert dp["n_active"] == len(included)
    for p in included:  # accounted with the survivors actually present
        assert eps[p]["releases"] == 1 and eps[p]["epsilon"] <= cfg.privacy.epsilon
    if len(included) == 2:
        assert "party-2" not in eps or eps["party-2"]["releases"] == 0


def test_each_stage_waits_for_its_own_timeout(tmp_path, make_run):
    coord, transport, _, _, _ = make_run(tmp_path, {"schedule.phases": "stats:arith, eval",
                                                    "federation.setup-timeout": 33.0,
                                                    "federation.round-timeout": 44.0,
                                                    "federation.unmask-timeout": 55.0})
    coord.run()
    assert transport.timeouts == {codec.MSG_SETUP: 33.0, codec.MSG_DIRECTORY: 33.0, codec.MSG_STATS: 44.0,
                                  codec.MSG_EVAL: 44.0, codec.MSG_CONSISTENCY: 55.0, codec.MSG_UNMASK: 55.0}


@pytest.mark.parametrize("stage,in_round_1", [
    (codec.MSG_STATS, ["party-0", "party-1"]),  # trained and masked, the reply too late: not in U2
    (codec.MSG_CONSISTENCY, ["party-0", "party-1", "party-2"]),  # its input is in the sum, it did not sign in time
    (codec.MSG_UNMASK, ["party-0", "party-1", "party-2"]),  # its input is in the sum, its shares came too late
])
def test_straggler_at_a_stage_is_left_out_then_rejoins(tmp_path, stage, in_round_1, make_run, releases):
    """A party whose reply misses a stage's timeout (its own state moved on) is left out of that stage;
    the survivors' sum is complete and correct, and the straggler is back in the next round."""
    coord, transport, run_dir, dirs, lines = make_run(tmp_path, {"schedule.phases": "stats:arith, eval, eval"})
    transport.late = lambda mtype, node: mtype == stage and node == 102 and coord.s.round == 1
    coord.run()
    (rel,) = releases(run_dir, "router-stats")
    assert sorted(rel["info"]["included"]) == in_round_1 and rel["dp"]["n_active"] == len(in_round_1)
    cfg = coord.cfg
    n_true = sum(_train_sequences(d, cfg) for d in dirs if d.name in in_round_1)
    meta = json.loads(next((run_dir / "anchors").glob("round-*.json")).read_text())
    count_std = math.sqrt(4 / 2) * rel["dp"]["sigma_int"] / rel["dp"]["scale"]
    assert abs(meta["num_sequences"] - n_true) < 6 * count_std + 2
    evals = releases(run_dir, "eval")
    # the straggler has no keys for round 2 if its masked input was lost; by round 3 everyone is back
    assert sorted(evals[-1]["info"]["included"]) == ["party-0", "party-1", "party-2"]
    assert any("too late" in x for x in lines)
    result = audit_run(run_dir)
    assert result.verdict == "pass", [(c.name, c.findings) for c in result.checks if c.status == "fail"]


def test_too_many_dropouts_release_nothing_and_stop_nothing(tmp_path, make_run, releases):
    coord, transport, run_dir, _, lines = make_run(tmp_path, {"schedule.phases": "stats:arith, eval, eval"})
    transport.drop = lambda mtype, node: mtype == codec.MSG_STATS and node in (101, 102)
    coord.run()
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"
    assert releases(run_dir, "router-stats") == []
    assert not list((run_dir / "anchors").glob("*.npz"))
    assert "nothing released" in "\n".join(lines)
    # round 2: the two who dropped have no keys for it (they answer with keys for round 3) -> no sum;
    # round 3: everyone is back
    (ev,) = releases(run_dir, "eval")
    assert ev["round"] == 3 and sorted(ev["info"]["included"]) == ["party-0", "party-1", "party-2"]


# ---------------------------------------------------------------------------------------- budgets
def _ignore_declared_caps(monkeypatch) -> None:
    """A coordinator that ignores the caps the parties declare at setup (its own check,
    ``SecureRounds._check_caps``, removed): what is left is each party's own refusal."""
    from distmoe.coordinator import secagg as rounds

    monkeypatch.setattr(rounds.SecureRounds, "_check_caps", lambda self: None)


def test_party_budget_refuses_its_release_before_anything_leaves(tmp_path, monkeypatch, make_run, releases):
    """The party's own defence, behind a coordinator that ignores its declared cap (an honest coordinator
    refuses to start this run: ``test_epsilon_caps.py``)."""
    _ignore_declared_caps(monkeypatch)
    coord, _, run_dir, _, _ = make_run(tmp_path, {"schedule.phases": "stats:arith"},
                                       node_extra={"party-0": {"epsilon-max": 0.5}})
    coord.run()
    (rel,) = releases(run_dir, "router-stats")
    assert sorted(rel["info"]["included"]) == ["party-1", "party-2"]
    errors = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
              if json.loads(x).get("event") == "party_error"]
    assert [e["reason"] for e in errors] == [ALL_REASONS["budget"]]  # the code, not the party's figures
    log = (run_dir / "work" / "party-0" / "party.log").read_text()
    assert "[budget]" in log and "0.5" in log, log
    p0 = ledger(run_dir / "work" / "party-0" / "ledger" / "party-0.jsonl")
    assert not any(e["payload_type"].startswith("masked-input") for e in p0)
    assert audit_run(run_dir).verdict == "pass"


def test_server_stops_before_a_release_over_budget(tmp_path, monkeypatch, make_run, releases):
    coord, _, run_dir, _, _ = make_run(tmp_path, {"schedule.phases": "sft:arith, stats:arith"})
    from distmoe.coordinator import secagg as rounds
    from distmoe.privacy.accountant import Accountant

    real = rounds.SecureRounds.setup

    def tight(self, nodes, max_length, **kw):
        real(self, nodes, max_length, **kw)
        self.accountants = {k: Accountant(self.cfg.privacy.delta, 0.05) for k in self.accountants}

    monkeypatch.setattr(rounds.SecureRounds, "setup", tight)
    with pytest.raises(PrivacyStop, match="privacy budget"):
        coord.run()
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["status"] == "failed" and "privacy budget" in rec["error"] and "0.05" in rec["error"]
    assert releases(run_dir, "router-stats") == []  # never unmasked
    assert len(releases(run_dir, "model-update")) == 1
    last = ledger(run_dir / "ledger" / "coordinator.jsonl")[-1]
    assert last["payload_type"] == "run-end" and last["info"]["status"] == "failed"


# ------------------------------------------------------------------------------------- plaintext
def test_plaintext_run_fails_the_audit(tmp_path, make_run, failed_checks):
    coord, _, run_dir, _, _ = make_run(tmp_path, {"schedule.phases": "sft:arith, stats:arith",
                                                  "privacy.mode": "plaintext"})
    coord.run()
    result = audit_run(run_dir)
    assert result.verdict == "fail" and "no-plaintext" in failed_checks(result)


def test_client_level_dp_on_updates_is_accounted_and_audited(tmp_path, make_run, releases):
    coord, _, run_dir, _, _ = make_run(tmp_path, {"schedule.phases": "sft:arith, stats:arith",
                                                  "privacy.update-noise-multiplier": 5.0})
    coord.run()
    (upd,) = releases(run_dir, "model-update")
    assert upd["dp"]["unit"] == "party" and upd["dp"]["n_active"] == 3
    # nothing data-dependent beside the noise: the weight sum is the party count, the metrics inside the noised block
    assert upd["dp"]["weights"] == "uniform" and upd["dp"]["metrics"] == "in-noised-block"
    assert upd["info"]["weight_sum"] == pytest.approx(3.0)
    assert upd["dp"]["sensitivity"] == pytest.approx(upd["dp"]["clip"])
    result = audit_run(run_dir)
    assert result.verdict == "pass", [(c.name, c.findings) for c in result.checks if c.status == "fail"]
    assert all(v["releases"] == 2 for v in result.epsilon.values())  # the update and the statistics


def test_dp_update_with_data_dependent_weights_fails_the_audit(tmp_path, monkeypatch, make_run, releases,
                                                               failed_checks):
    """A build that weights DP updates by dataset size again (the weight sum then leaves exact)."""
    from distmoe.privacy.vectors import UpdateLayout

    monkeypatch.setattr(UpdateLayout, "weight_of", lambda self, n: int(max(n, 0)))
    coord, _, run_dir, _, _ = make_run(tmp_path, {"schedule.phases": "sft:arith",
                                                  "privacy.update-noise-multiplier": 5.0})
    coord.run()
    (upd,) = releases(run_dir, "model-update")
    assert upd["info"]["weight_sum"] > 3
    # the server refuses to apply a sum whose weight no honest private layout can produce ...
    assert upd["info"]["applied"] is False and upd["verdict"].startswith("rejected: total weight")
    # ... and the audit names both the uncovered release and the rejection
    result = audit_run(run_dir)
    assert result.verdict == "fail" and failed_checks(result) == {"epsilon", "no-blocked"}
    (eps,) = [c for c in result.checks if c.name == "epsilon"]
    assert any("weight sum" in f for f in eps.findings)


# ----------------------------------------------------------------------------------- error replies
def _errors_of(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(x).get("event") == "party_error"]


def test_a_refusal_travels_as_guarded_text_anchored_in_the_coordinator_ledger(tmp_path, monkeypatch, make_run):
    _ignore_declared_caps(monkeypatch)
    coord, _, run_dir, _, _ = make_run(tmp_path, {"schedule.phases": "stats:arith"},
                                       node_extra={"party-0": {"epsilon-max": 0.5}})
    coord.run()
    (err,) = [e for e in ledger(run_dir / "ledger" / "coordinator.jsonl")
              if e["payload_type"] == "error" and e["peer"] == "party-0"]
    assert err["verdict"] == "accepted" and err["anchor"]["node"] == "party-0"
    sent = ledger(run_dir / "work" / "party-0" / "ledger" / "party-0.jsonl")[err["anchor"]["seq"]]
    assert sent["payload_type"] == "error" and sent["sha256"] == err["sha256"] and sent["hash"] == err["anchor"]["hash"]
    (reason,) = [e["reason"] for e in _errors_of(run_dir)]
    assert reason == ALL_REASONS["budget"] and "ledger-head" not in reason
    result = audit_run(run_dir)
    assert result.verdict == "pass"
    (cross,) = [c for c in result.checks if c.name == "cross-check"]
    assert cross.status == "pass"


def _replace_reply(monkeypatch, transport, node: int, mtype: str, reply):
    real = transport._send

    def send(out, timeout, memo=None):
        got = real(out, timeout, memo)
        if node in got and out[node][0] == mtype:
            got[node] = reply
        return got

    monkeypatch.setattr(transport, "_send", send)


@pytest.mark.parametrize("kind", ["oversized", "unanchored", "forged-head", "free-text"])
def test_error_text_that_did_not_pass_a_party_guard_is_not_kept(tmp_path, monkeypatch, kind, make_run, releases,
                                                                failed_checks):
    """An error reply is the only free text a party sends: oversized or non-ASCII text (with a head) is
    rejected, and text without a ledger head is logged by size and hash only; a canary in it never
    reaches a file on the server side."""
    coord, transport, run_dir, dirs, _ = make_run(tmp_path, {"schedule.phases": "stats:arith"})
    canary = (dirs[1] / "canaries.txt").read_text().split()[0]
    head = " [ledger-head 3 " + "ab" * 32 + "]"
    text = {"oversized": "x" * 3000 + canary + head, "unanchored": f"ValueError: bad row {canary}",
            "forged-head": f"bad row \u00e9 {canary}{head}",
            "free-text": f"rl.prompts-per-step = 8 exceeds its 4 training prompts {canary}{head}"}[kind]
    _replace_reply(monkeypatch, transport, 101, codec.MSG_STATS, codec.ErrorReply(text, 1))
    coord.run()
    (rel,) = releases(run_dir, "router-stats")
    assert sorted(rel["info"]["included"]) == ["party-0", "party-2"]  # the round went on without it
    (err,) = [e for e in ledger(run_dir / "ledger" / "coordinator.jsonl")
              if e["payload_type"] == "error" and e["peer"] == "party-1"]
    assert "anchor" not in err
    if kind == "unanchored":
        assert err["verdict"] == "accepted" and err["info"]["anchored"] is False
    else:
        assert err["verdict"].startswith("rejected")
    (reason,) = [e["reason"] for e in _errors_of(run_dir)]
    assert canary not in reason and reason == ALL_REASONS["withheld"]
    result = audit_run(run_dir)
    (can,) = [c for c in result.checks if c.name == "canaries"]
    assert can.status == "pass", can.findings  # no server-side file holds the canary
    assert ("no-blocked" in failed_checks(result)) == (kind != "unanchored")


@pytest.mark.parametrize("code,kept", [(5, True), (1, False)])
def test_the_superlinks_own_node_unavailable_error_is_kept_a_party_text_is_not(tmp_path, monkeypatch, code, kept,
                                                                               make_run):
    from flwr.server.superlink.linkstate.utils import NODE_UNAVAILABLE_ERROR_REASON

    coord, transport, run_dir, _, _ = make_run(tmp_path, {"schedule.phases": "stats:arith"})
    _replace_reply(monkeypatch, transport, 101, codec.MSG_STATS, codec.ErrorReply(NODE_UNAVAILABLE_ERROR_REASON, code))
    coord.run()
    (err,) = _errors_of(run_dir)
    assert err["code"] == ("unavailable" if kept else "withheld") and err["reason"] == ALL_REASONS[err["code"]]
    assert audit_run(run_dir).verdict == "pass"


def test_single_holder_task_is_refused_before_anything_is_unmasked(tmp_path, make_run, releases):
    """The contributor count, the single-holder task: only party-0 holds task 'arith', the others send a
    zero vector with weight 0, so the "sum over 3 parties" would be party-0's own update. Defence: the
    contributor count of the consistency check (each party's bit, Shamir-shared; only the sum is
    learned): 1 < privacy.min-parties = 2, so the coordinator refuses the release before any unmask
    request, records the refusal, and every party would refuse to unmask too."""
    coord, transport, run_dir, dirs, lines = make_run(tmp_path, {"schedule.phases": "sft:arith"})
    for d in dirs[1:]:
        (d / "arith.jsonl").unlink()
    w0 = {k: v.clone() for k, v in coord.s.weights.items()} if getattr(coord.s, "weights", None) else None
    coord.run()
    assert releases(run_dir, "model-update") == []
    assert transport.sent.get(codec.MSG_CONSISTENCY) == 3 and codec.MSG_UNMASK not in transport.sent
    refused = json.loads((run_dir / "privacy" / "ledger.json").read_text())["refused"]
    assert refused == [{"round": 1, "release": "model-update", "reason": "too-few-contributors", "contributors": 1,
                        "survivors": 3, "min_parties": 2}]
    assert any("1 of the 3 survivors contributed data" in x for x in lines)
    for d in dirs:  # no party sent an unmask response
        entries = ledger(run_dir / "work" / d.name / "ledger" / f"{d.name}.jsonl")
        assert not any(e["payload_type"] == "unmask-response" for e in entries)
        assert any(e["payload_type"] == "consistency-response" and e["direction"] == "out" for e in entries)
    if w0 is not None:
        assert all(np.array_equal(w0[k].numpy(), coord.s.weights[k].numpy()) for k in w0)  # model unchanged
    prints = set()  # each party pinned the same key directory: one fingerprint to compare out of band
    for d in dirs:
        (facts,) = (run_dir / "work" / d.name / "privacy").glob(f"{d.name}-{transport.run_id}.json")
        prints.add(json.loads(facts.read_text())["facts"]["directory_sha256"])
    assert len(prints) == 1 and len(next(iter(prints))) == 64
    result = audit_run(run_dir)  # a refused round is an honest run: the audit passes
    assert result.verdict == "pass", [(c.name, c.findings) for c in result.checks if c.status == "fail"]


def test_single_holder_task_is_refused_by_the_parties_when_the_coordinator_skips_its_check(tmp_path, monkeypatch,
                                                                                          make_run, releases):
    """The same single-holder task with a coordinator that skips its own contributor-count check and asks
    for the shares anyway. Defence: every party interpolates the count from the signed share-sums itself
    and refuses (``TooFewContributors``) before revealing a share; the refusal reaches the server as the
    fixed code ``secagg`` (1008) only, and nothing is released."""
    from distmoe.privacy.secagg import SecAggServer

    skip = SecAggServer.receive_consistency
    monkeypatch.setattr(SecAggServer, "receive_consistency", lambda self, r, msgs, **kw: skip(self, r, msgs))
    coord, transport, run_dir, dirs, lines = make_run(tmp_path, {"schedule.phases": "sft:arith"})
    for d in dirs[1:]:
        (d / "arith.jsonl").unlink()
    coord.run()
    assert transport.sent.get(codec.MSG_UNMASK) == 3
    assert releases(run_dir, "model-update") == []
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    errs = [r for r in rows if r.get("event") == "party_error" and r["phase_label"].endswith("unmask")]
    assert len(errs) == 3 and {r["code"] for r in errs} == {"secagg"}
    assert {r["reason"] for r in errs} == {ALL_REASONS["secagg"]}
    for d in dirs:
        entries = ledger(run_dir / "work" / d.name / "ledger" / f"{d.name}.jsonl")
        assert not any(e["payload_type"] == "unmask-response" for e in entries)
        log = (run_dir / "work" / d.name / "party.log").read_text()
        assert "contributed data, below privacy.min-parties = 2" in log


# ------------------------------------------- the update's masks expanded while the party trains (premask)
@pytest.mark.parametrize("premask", [True, False])
def test_update_masks_expanded_while_training_sum_to_the_same_release(tmp_path, monkeypatch, make_run, premask):
    """With ``privacy.secagg-premask`` each party expands its model-update masks in a second thread while it
    trains (``SecAggClient.premask``) and adds them after; the release decodes to exactly the contributing
    parties (a mask that did not cancel would make the decoded weight sum garbage) and the audit passes.
    Off, the masks are expanded after training, as before."""
    import threading

    from distmoe.privacy.secagg import primitives
    from distmoe.privacy.secagg.client import SecAggClient

    monkeypatch.setattr(primitives, "MASK_THREADS", 2)  # as on a 2-core machine, whatever this one has
    calls: list[str] = []
    orig = SecAggClient.premask

    def spy(self, start):
        calls.append(threading.current_thread().name)
        return orig(self, start)

    monkeypatch.setattr(SecAggClient, "premask", spy)
    coord, _, run_dir, _, _ = make_run(tmp_path, {"privacy.secagg-premask": premask})
    coord.run()
    assert len(calls) == (3 if premask else 0)  # one sft round, three parties
    assert all(name.startswith("distmoe-premask-") for name in calls)
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    (train,) = [e for e in events if e.get("event") == "train" and e.get("party") == "all"]
    assert train["contributors"] == 3 and train["parties"] == 3
    assert audit_run(run_dir).verdict == "pass"
