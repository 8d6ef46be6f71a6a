"""Crash and resume: a coordinator that dies mid-round or mid-checkpoint, restarted with
``run.resume``, continues the schedule from the last completed round with the same model, anchor versions,
accountants and ledger chain; a corrupted checkpoint falls back to the previous one with a warning; parties
rejoin without cleanup.

Three parties run in process (``LocalTransport``: the exact party code path, ledgers, guards and secure
aggregation). A crash is an exception raised from the transport at a chosen message (the coordinator dies
as in a failure), or a real ``SIGKILL`` of a subprocess (no handler runs: no ``run-end``, ``run.json``
left at ``running``). SFT rounds in secagg mode without update noise are deterministic given the seeds
(the secure sum is exact), so a resumed run must end with exactly the weights of an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from distmoe.audit import audit_run
from distmoe.config import parse_node_config, parse_run_config
from distmoe.coordinator import Coordinator, RunFailed, plane
from distmoe.coordinator.context import RunContext
from distmoe.inprocess import LocalTransport
from distmoe.ledger import verify_ledger
from distmoe.party.session import PartySession, SessionError
from distmoe.privacy import metric_noise
from distmoe.privacy.accountant import Accountant
from distmoe.wire.schema import SetupRequest

# new task at round 3 (reference weights and baseline for retention), eval after the crash point
EXACT = "sft:arith, eval, sft:lookup*2, eval"
ANCHORED = "sft:arith, stats:arith, sft:arith, eval"
SHORT = "sft:arith, eval, sft:lookup, eval"
ROOT = Path(__file__).resolve().parents[2]


class Killed(Exception):
    """The coordinator process dies here (raised from inside the transport)."""


def coordinator(cfg, nodes, run_dir, run_id, lines, *, kill=None):
    """A coordinator over in-process parties; ``kill(message_type, node) -> bool`` raises ``Killed``."""
    transport = LocalTransport(cfg, nodes, run_id)
    if kill is not None:
        def drop(mtype, node):
            if kill(mtype, node):
                raise Killed(f"killed at {mtype} to node {node}")
            return False
        transport.drop = drop
    return Coordinator(cfg, run_dir, transport, run_id, log=lines.append), transport


def at_nth(mtype: str, n: int):
    """A kill switch for the n-th delivery of ``mtype`` (counting every node)."""
    seen = {"k": 0}

    def hit(m, node):
        if m == mtype:
            seen["k"] += 1
            return seen["k"] == n
        return False
    return hit


def resumed_cfg(cfg, run_dir, **changes):
    return parse_run_config({**cfg.as_flat(), "run.resume": str(run_dir), **changes})


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = (run_dir / "checkpoints" / "LATEST").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / "trainable.safetensors"))


def entries(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x]


def coord_ledger(run_dir: Path) -> list[dict]:
    return entries(run_dir / "ledger" / "coordinator.jsonl")


def release_rounds(run_dir: Path) -> list[tuple[str, int]]:
    return [(e["payload_type"], e["round"]) for e in coord_ledger(run_dir) if e["payload_type"].startswith("release:")]


def party_accountant(run_dir: Path, party: str, logical: str) -> Accountant:
    d = json.loads((run_dir / "work" / party / "privacy" / f"{party}-{logical}.accountant.json").read_text())
    return Accountant.from_state_dict(d["accountant"])


def audit_failures(run_dir: Path) -> list[str]:
    res = audit_run(run_dir)
    return [f"{c.name}: {c.details}" for c in res.checks if c.status == "fail"]


# ----------------------------------------------------------------------------- exact: kill mid-round
@pytest.fixture(scope="module")
def exact(tmp_path_factory, lay_out_run):
    """An uninterrupted run, and the same run killed in round 4 at the unmask stage, then resumed under a
    new transport (Flower) run id, as ``flwr run`` gives a resumed run. The evaluation noise is off here (both
    runs' figures are compared; its DP is ``tests/privacy/test_metric_noise.py``'s)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(metric_noise, "skellam_noise", lambda shape, variance, rng=None: np.zeros(shape, np.int64))
    try:
        return _exact(tmp_path_factory, lay_out_run)
    finally:
        mp.undo()


def _exact(tmp_path_factory, lay_out_run):
    # 64-bit words: nearest rounding, so the secure sum is exact and the resumed model equals the uninterrupted one
    # bit for bit (32-bit words round stochastically with fresh randomness: equal to within 2^-f, docs/operations.md)
    exact64 = {"privacy.ring-bits": "64"}
    ref_cfg, ref_nodes, ref_dir, ref_id = lay_out_run(tmp_path_factory.mktemp("ref"), EXACT, **exact64)
    coordinator(ref_cfg, ref_nodes, ref_dir, ref_id, [])[0].run()

    cfg, nodes, run_dir, run_id = lay_out_run(tmp_path_factory.mktemp("crash"), EXACT, data_from=ref_dir, **exact64)
    lines: list[str] = []
    # round 4's unmask: 3 unmask requests each in rounds 1, 3 (sft) and 2 (eval); the 10th is round 4's first
    coord, _ = coordinator(cfg, nodes, run_dir, run_id, lines, kill=at_nth("query.unmask", 10))
    with pytest.raises(Killed):
        coord.run()
    before = {"record": json.loads((run_dir / "run.json").read_text()), "releases": release_rounds(run_dir),
              "ledger_len": len(coord_ledger(run_dir)),
              "party_events": {p: len(party_accountant(run_dir, p, run_id).events)
                               for p in ("party-0", "party-1", "party-2")}}
    lines2: list[str] = []
    rcfg = resumed_cfg(cfg, run_dir, **{"federation.round-timeout": 600.0})  # a key that may change
    coord2, _ = coordinator(rcfg, nodes, run_dir, f"flower-{uuid.uuid4().hex[:6]}", lines2)
    rec = coord2.run()
    return {"ref_dir": ref_dir, "run_dir": run_dir, "run_id": run_id, "before": before, "record": rec,
            "lines": lines, "lines2": lines2, "coord2": coord2}


@pytest.mark.integration
def test_killed_mid_round_resumes_to_the_uninterrupted_model(exact):
    ref, got = final_weights(exact["ref_dir"]), final_weights(exact["run_dir"])
    assert set(ref) == set(got)
    for k in ref:
        assert torch.equal(ref[k], got[k]), f"{k} differs from the uninterrupted run"
    rec = exact["record"]
    assert rec["status"] == "completed" and rec["run_id"] == exact["run_id"]  # the logical run id is kept
    assert exact["before"]["record"]["status"] == "failed"
    assert [r["epoch"] for r in rec["resumes"]] == [1]
    assert rec["resumes"][0]["round"] == 3 and rec["resumes"][0]["checkpoint"] == "checkpoints/round-3"
    assert any("resume: checkpoint checkpoints/round-3" in x and "continuing with round 4" in x
               for x in exact["lines2"])
    # the schedule continued at round 4: one round-4 and one round-5 run, nothing of rounds 1-3 again
    rounds = [x for x in exact["lines2"] if x.startswith("distmoe | round ")]
    assert [x.split("|")[1].split(" (")[0].strip() for x in rounds] == ["round 4/5", "round 5/5"]


@pytest.mark.integration
def test_resumed_run_keeps_retention_state_and_metrics(exact):
    """Round 5's evaluation uses the reference weights and the baseline restored from the checkpoint:
    its metrics equal the uninterrupted run's; the lost round's lines moved to metrics.lost.jsonl."""
    def eval_rows(d):
        return [e for e in entries(d / "metrics.jsonl") if e.get("event") == "eval" and e.get("round") == 5]

    ref, got = eval_rows(exact["ref_dir"]), eval_rows(exact["run_dir"])
    assert len(ref) == len(got) == 1
    drop = {"time"}
    assert {k: v for k, v in ref[0].items() if k not in drop} == {k: v for k, v in got[0].items() if k not in drop}
    assert got[0].get("top1_consistency") is None  # routing metrics are not released under secagg
    coord = exact["coord2"]
    assert coord.s.ref_weights is not None and coord.s.current_task == "lookup"
    assert coord.s.trained_tasks == ["arith", "lookup"]
    r2 = next(e for e in entries(exact["run_dir"] / "metrics.jsonl") if e.get("event") == "eval" and e["round"] == 2)
    assert coord.s.baseline["all"]["loss/arith"] == pytest.approx(r2["loss/arith"])  # the restored baseline
    rows = entries(exact["run_dir"] / "metrics.jsonl")
    at = [i for i, e in enumerate(rows) if e.get("event") == "run_resume"]
    # killed before round 4 logged anything: nothing to set aside (the fallback test moves a lost round's lines)
    assert len(at) == 1 and rows[at[0]]["from_round"] == 3 and rows[at[0]]["lost_metric_lines"] == 0
    assert all(e.get("round", 0) <= 3 for e in rows[:at[0]])
    assert [e["round"] for e in rows if e.get("event") == "train"] == [1, 3, 4]


@pytest.mark.integration
def test_ledger_chain_continues_and_the_audit_passes(exact):
    run_dir = exact["run_dir"]
    led = coord_ledger(run_dir)
    pub = (run_dir / "ledger" / "coordinator.pub").read_text().strip()
    assert verify_ledger(run_dir / "ledger" / "coordinator.jsonl", pub), "the chain must verify end to end"
    n0 = exact["before"]["ledger_len"]
    assert led[n0 - 1]["payload_type"] == "run-end" and led[n0 - 1]["info"]["status"] == "failed"
    res = led[n0]
    assert res["payload_type"] == "run-resume" and res["round"] == 3 and res["info"]["epoch"] == 1
    assert res["info"]["previous_head"] == {"seq": led[n0 - 1]["seq"], "hash": led[n0 - 1]["hash"]}
    assert res["info"]["policy_sha256"] == led[0]["sha256"]
    assert sum(1 for e in led if e["payload_type"] == "policy") == 1  # one allow-list for the whole run
    assert audit_failures(run_dir) == []


@pytest.mark.integration
def test_accountants_include_the_releases_before_the_crash(exact):
    """Privacy spent stays spent: the server's and each party's accountant hold every DP release of the
    ledger, before and after the restart (the eval releases carry no DP; the updates none without noise)."""
    run_dir, run_id = exact["run_dir"], exact["run_id"]
    server = json.loads((run_dir / "privacy" / "ledger.json").read_text())
    dp_rel = sum(1 for e in coord_ledger(run_dir) if e["payload_type"].startswith("release:") and e["dp"])
    for party, before in exact["before"]["party_events"].items():
        acc = party_accountant(run_dir, party, run_id)
        assert len(acc.events) >= before
        assert len(server["parties"][party]["events"]) == dp_rel
    # the new session's facts name the logical run and epoch 1; the old session's secret SecAgg state is gone
    work = run_dir / "work" / "party-0"
    facts = [json.loads(p.read_text())["facts"] for p in (work / "privacy").glob("party-0-*.json")
             if not p.name.endswith(".accountant.json")]
    assert sorted((f["logical_run"], f["epoch"]) for f in facts) == [(run_id, 0), (run_id, 1)]
    assert not (work / "secagg" / f"party-0-{run_id}.state").exists()


# ----------------------------------------------------------------------------- DP: anchor and budget
@pytest.fixture(scope="module")
def anchored(tmp_path_factory, lay_out_run):
    """Stats with distributed DP, killed in round 3 (sft) after the anchor was built; the latest checkpoint
    (round 2) is then truncated, so the resume falls back to round 1 and re-runs the stats round."""
    # z = 3: two router-stats releases fit in the budget (with the derived z one release spends it all:
    # see test_a_release_lost_in_the_crash_stays_charged_at_the_parties)
    cfg, nodes, run_dir, run_id = lay_out_run(tmp_path_factory.mktemp("anch"), ANCHORED,
                                           **{"privacy.noise-multiplier": 3.0})
    coord, _ = coordinator(cfg, nodes, run_dir, run_id, [], kill=at_nth("train.sft", 5))  # round 3, 2nd party
    with pytest.raises(Killed):
        coord.run()
    server_before = json.loads((run_dir / "privacy" / "ledger.json").read_text())
    ck = run_dir / "checkpoints" / "round-2" / "trainable.safetensors"
    data = ck.read_bytes()
    # truncated: a new file in round 2 only (round 2, a stats round, has round 1's weights, and checkpoints store
    # equal content once, as one file linked from both: damage written into that file damages both rounds, and
    # the resume then falls back past both; tests/test_checkpoint.py)
    ck.unlink()
    ck.write_bytes(data[: len(data) // 2])
    lines: list[str] = []
    coord2, _ = coordinator(resumed_cfg(cfg, run_dir), nodes, run_dir, run_id, lines)  # same transport run id
    rec = coord2.run()
    return {"run_dir": run_dir, "run_id": run_id, "record": rec, "lines": lines, "server_before": server_before,
            "coord": coord2}


@pytest.mark.integration
def test_truncated_checkpoint_falls_back_with_a_warning(anchored):
    run_dir, rec = anchored["run_dir"], anchored["record"]
    assert rec["status"] == "completed"
    warn = [w for w in rec["warnings"] if "checkpoint round 2 is unusable" in w]
    assert warn and "does not match its hash" in warn[0]
    assert any("WARNING: checkpoint round 2 is unusable" in x for x in anchored["lines"])
    assert list(run_dir.joinpath("checkpoints").glob("corrupt-round-2-*")), "the bad checkpoint is kept aside"
    assert rec["resumes"][0]["round"] == 1
    resume = next(e for e in coord_ledger(run_dir) if e["payload_type"] == "run-resume")
    assert any("checkpoint round 2" in w for w in resume["info"]["warnings"])
    # the stats round ran twice (before the crash, and again after the fallback): anchor v1 both times
    stats = [e for e in entries(run_dir / "metrics.jsonl") if e.get("event") == "stats"]
    assert [(e["round"], e["anchor_version"]) for e in stats] == [(2, 1)]  # the lost one moved aside
    lost = [e for e in entries(run_dir / "metrics.lost.jsonl") if e.get("event") == "stats"]
    assert [(e["round"], e["anchor_version"]) for e in lost] == [(2, 1)]
    assert anchored["coord"].s.anchor.meta.version == 1 and anchored["coord"].s.anchor_versions == 1
    state = json.loads((run_dir / "checkpoints" / "round-4" / "state.json").read_text())
    assert state["round"] == 4 and state["anchor"]["version"] == 1 and state["trained_tasks"] == ["arith"]


@pytest.mark.integration
def test_fallback_never_rolls_back_privacy(anchored):
    """Both router-stats releases (before the crash, and the re-run after the fallback) are charged, by the
    server, by every party, and by the audit's own recomputation."""
    run_dir, run_id = anchored["run_dir"], anchored["run_id"]
    assert [r for r in release_rounds(run_dir) if r[0] == "release:router-stats"] == \
        [("release:router-stats", 2), ("release:router-stats", 2)]
    server = json.loads((run_dir / "privacy" / "ledger.json").read_text())
    def stats(events):
        return [e for e in events if str(e["label"] if isinstance(e, dict) else e.label).startswith("router-stats")]

    for party in ("party-0", "party-1", "party-2"):
        assert len(stats(anchored["server_before"]["parties"][party]["events"])) == 1
        assert len(stats(server["parties"][party]["events"])) == 2
        acc = party_accountant(run_dir, party, run_id)
        assert len(stats(acc.events)) == 2 and len(acc.events) == 3  # and the final eval (a DP release)
        assert acc.primary_epsilon() > Accountant.from_state_dict(
            anchored["server_before"]["parties"][party]).primary_epsilon()
    res = audit_run(run_dir)
    assert [f"{c.name}: {c.details}" for c in res.checks if c.status == "fail"] == []
    assert {p: row["releases"] for p, row in res.epsilon.items()} == {f"party-{i}": 3 for i in range(3)}


@pytest.mark.integration
def test_the_anchor_is_restored_from_the_checkpoint(tmp_path, lay_out_run):
    """Killed in the final eval round: the resume restores anchor v1 (probabilities and metadata) from the
    round-3 checkpoint, equal to the saved anchors/round-2 file, and the eval runs against it."""
    from distmoe.routing.anchor import load_anchor

    cfg, nodes, run_dir, run_id = lay_out_run(tmp_path, ANCHORED, **{"privacy.noise-multiplier": 3.0})
    coord, _ = coordinator(cfg, nodes, run_dir, run_id, [], kill=at_nth("evaluate", 2))
    with pytest.raises(Killed):
        coord.run()
    coord2, _ = coordinator(resumed_cfg(cfg, run_dir), nodes, run_dir, run_id, [])
    rec = coord2.run()
    assert rec["status"] == "completed" and rec["resumes"][0]["round"] == 3
    saved = load_anchor(run_dir / "anchors" / "round-2.npz")
    assert coord2.s.anchor.meta == saved.meta and (coord2.s.anchor.probs == saved.probs).all()
    ev = [e for e in entries(run_dir / "metrics.jsonl") if e.get("event") == "eval"]
    assert [(e["round"], e["anchor_version"]) for e in ev] == [(4, 1)]


@pytest.mark.integration
def test_a_release_lost_in_the_crash_stays_charged_at_the_parties(tmp_path, lay_out_run):
    """With the derived noise the schedule's one router-stats release spends the whole budget. The model
    falls back past that release (its checkpoint is corrupted); re-running the stats round is then refused
    by every party before anything leaves: the accountants carried over, privacy spent stays spent."""
    cfg, nodes, run_dir, run_id = lay_out_run(tmp_path, "stats:arith, sft:arith, eval")
    coord, _ = coordinator(cfg, nodes, run_dir, run_id, [], kill=at_nth("train.sft", 2))
    with pytest.raises(Killed):
        coord.run()
    (run_dir / "checkpoints" / "round-1" / "manifest.json").write_text("{ truncated")
    lines: list[str] = []
    rec = coordinator(resumed_cfg(cfg, run_dir), nodes, run_dir, f"flower-{uuid.uuid4().hex[:6]}", lines)[0].run()
    assert rec["status"] == "completed" and rec["resumes"][0]["round"] == 0
    assert any("corrupt manifest" in w for w in rec["warnings"])
    refusals = [x for x in lines if "round 1: party" in x and "privacy budget" in x]
    assert len(refusals) == 3, lines
    assert [r for r in release_rounds(run_dir) if r[0] == "release:router-stats"] == [("release:router-stats", 1)]
    for i in range(3):  # the one router-stats release, and the eval release after the resume
        labels = [e.label for e in party_accountant(run_dir, f"party-{i}", run_id).events]
        assert [x.split(" round")[0] for x in labels] == ["router-stats", "eval"]
    assert audit_failures(run_dir) == []


@pytest.mark.integration
def test_killed_during_the_secure_aggregation_setup(tmp_path, lay_out_run):
    """Killed before the setup finished (no accountant state yet, nothing released): the resume runs the
    whole schedule from round 0 under the same ledger chain, and the audit passes."""
    cfg, nodes, run_dir, run_id = lay_out_run(tmp_path, "sft:arith, eval")
    coord, _ = coordinator(cfg, nodes, run_dir, run_id, [], kill=at_nth("query.directory", 2))
    with pytest.raises(Killed):
        coord.run()
    assert not (run_dir / "privacy" / "ledger.json").exists()
    lines: list[str] = []
    rec = coordinator(resumed_cfg(cfg, run_dir), nodes, run_dir, run_id, lines)[0].run()
    assert rec["status"] == "completed" and rec["resumes"][0]["round"] == 0
    assert any("no accountant state yet" in x for x in lines)
    assert [x.split("|")[1].split(" (")[0].strip() for x in lines
            if x.startswith("distmoe | round ")] == ["round 1/2", "round 2/2"]
    assert audit_failures(run_dir) == []


@pytest.mark.integration
def test_killed_in_the_ledgers_first_append(tmp_path, lay_out_run):
    """Killed while writing the ledger's first entry (the run-start, durable before anything is sent): the ledger holds
    no complete line. The resume starts the wire afresh, as for a session that never opened its ledger, with a
    warning, and the audit passes. Before, it was refused for good (the ledger "does not begin with the run-start
    policy entry")."""
    cfg, nodes, run_dir, run_id = lay_out_run(tmp_path, "sft:arith, eval")
    coord, _ = coordinator(cfg, nodes, run_dir, run_id, [], kill=at_nth("query.setup", 1))  # before any delivery
    with pytest.raises(Killed):
        coord.run()
    lpath = run_dir / "ledger" / "coordinator.jsonl"
    lpath.write_bytes(lpath.read_bytes()[:40])  # the first append, torn
    lines: list[str] = []
    rec = coordinator(resumed_cfg(cfg, run_dir), nodes, run_dir, run_id, lines)[0].run()
    assert rec["status"] == "completed" and rec["resumes"][0]["round"] == 0
    assert any("no complete entry (the interrupted session died in its first append)" in w
               for w in rec["warnings"]), rec["warnings"]
    assert entries(lpath)[0]["phase"] == "run-start"
    assert audit_failures(run_dir) == []


@pytest.mark.integration
def test_a_run_that_fails_before_its_run_start_entry_leaves_no_ledger_and_resumes(tmp_path, lay_out_run, monkeypatch):
    """The pre-run privacy check of the allow-list fails after the ledger is opened, before its ``run-start`` entry:
    nothing was sent, so the run is closed without a ledger entry. Before, ``run-end`` became the ledger's first
    entry, and that ledger was refused for good by the resume ("does not begin with the run-start policy entry")
    and by a new run in the same directory ("exists")."""
    cfg, nodes, run_dir, run_id = lay_out_run(tmp_path, "sft:arith, eval")
    monkeypatch.setattr(plane, "check_allow_list", lambda policy: ["party-x: a free-text field (planted)"])
    with pytest.raises(RunFailed, match="privacy check before the run failed: party-x"):
        coordinator(cfg, nodes, run_dir, run_id, [])[0].run()
    lpath = run_dir / "ledger" / "coordinator.jsonl"
    assert not lpath.exists() or lpath.read_bytes() == b""
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"
    monkeypatch.undo()
    rec = coordinator(resumed_cfg(cfg, run_dir), nodes, run_dir, run_id, [])[0].run()
    assert rec["status"] == "completed"
    assert entries(lpath)[0]["phase"] == "run-start" and entries(lpath)[-1]["info"]["status"] == "completed"
    assert audit_failures(run_dir) == []


@pytest.mark.integration
def test_a_lora_run_resumes_from_its_adapter_checkpoint(tmp_path, lay_out_run):
    """``lora``: the server holds only the adapters and checkpoints them in peft's format; killed in the final
    eval round, the resume restores the adapters of round 3 (the final eval leaves them as they are) and
    refuses a checkpoint whose base fingerprint is not the base of the resumed run."""
    cfg, nodes, run_dir, run_id = lay_out_run(tmp_path, SHORT, **{"model.trainable": "lora"})
    coord, _ = coordinator(cfg, nodes, run_dir, run_id, [], kill=at_nth("evaluate", 4))
    with pytest.raises(Killed):
        coord.run()
    ck3 = run_dir / "checkpoints" / "round-3"
    manifest = json.loads((ck3 / "manifest.json").read_text())
    assert manifest["layout"] == "adapter" and "adapter/adapter_model.safetensors" in manifest["files"]
    assert not (ck3 / "model").exists()
    saved = load_file(str(ck3 / "trainable.safetensors"))
    lines: list[str] = []
    coord2, _ = coordinator(resumed_cfg(cfg, run_dir), nodes, run_dir, run_id, lines)
    rec = coord2.run()
    assert rec["status"] == "completed" and rec["resumes"][0]["round"] == 3
    assert {p.device.type for p in coord2.model.module.parameters()} == {"meta"}
    got = final_weights(run_dir)
    assert set(got) == set(saved) and all(torch.equal(got[k], saved[k]) for k in saved)
    assert [x.split("|")[1].split(" (")[0].strip() for x in lines
            if x.startswith("distmoe | round ")] == ["round 4/4"]
    assert audit_failures(run_dir) == []
    # a checkpoint of adapters trained on another base is refused (the manifest's fingerprint, as written)
    ck4 = run_dir / "checkpoints" / "round-4"
    m4 = json.loads((ck4 / "manifest.json").read_text())
    (ck4 / "manifest.json").write_text(json.dumps({**m4, "base_fingerprint": "0" * 64}))
    rec_dir = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**rec_dir, "status": "failed"}))
    with pytest.raises(RunFailed, match="another base model"):
        coordinator(resumed_cfg(cfg, run_dir), nodes, run_dir, run_id, [])[0].run()


# ----------------------------------------------------------------------------- a real kill (SIGKILL)
KILL_SCRIPT = """
import json, os, signal, tomllib
from pathlib import Path
import torch
torch.set_num_threads(1)
import distmoe.checkpoint as ck
from distmoe.config import parse_node_config, parse_run_config
from distmoe.coordinator import Coordinator
from distmoe.inprocess import LocalTransport
cfg = parse_run_config(json.loads({flat!r}))
run_dir, run_id = Path({run_dir!r}), {run_id!r}
nodes = {{nid: parse_node_config(tomllib.loads(f.read_text()), cfg.sim)
         for nid, f in zip({ids!r}, sorted((run_dir / "nodes").glob("node-*.toml")), strict=True)}}
real = ck._fsync_tree
def fsync_then_die(root):
    if root.name.startswith(".tmp-round-{kill_round}-"):
        os.kill(os.getpid(), signal.SIGKILL)  # every file of the checkpoint written, nothing renamed yet
    real(root)
ck._fsync_tree = fsync_then_die
Coordinator(cfg, run_dir, LocalTransport(cfg, nodes, run_id), run_id, log=lambda s: None).run()
"""


@pytest.mark.integration
def test_sigkill_during_a_checkpoint_write_then_resume(tmp_path, lay_out_run):
    """A SIGKILL inside the round-3 checkpoint write (after its files, before the rename): no handler
    runs, so run.json still says running and the ledger has no run-end; the resume removes the half-written
    directory, continues from round 2 and the audit passes."""
    cfg, nodes, run_dir, run_id = lay_out_run(tmp_path, SHORT)
    script = KILL_SCRIPT.format(flat=json.dumps(cfg.as_flat()), run_dir=str(run_dir), run_id=run_id,
                                ids=sorted(nodes), kill_round=3)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads((run_dir / "run.json").read_text())["status"] == "running"
    assert list((run_dir / "checkpoints").glob(".tmp-round-3-*")), "the kill left a half-written checkpoint"
    assert coord_ledger(run_dir)[-1]["payload_type"] != "run-end"
    lines: list[str] = []
    rec = coordinator(resumed_cfg(cfg, run_dir), nodes, run_dir, run_id, lines)[0].run()
    assert rec["status"] == "completed" and rec["resumes"][0]["round"] == 2
    assert rec["resumes"][0]["interrupted_status"] == "running"
    assert not list((run_dir / "checkpoints").glob(".tmp-round-*"))
    assert any("interrupted checkpoint write" in w for w in rec["warnings"])
    assert [x.split("|")[1].split(" (")[0].strip() for x in lines
            if x.startswith("distmoe | round ")] == ["round 3/4", "round 4/4"]
    assert audit_failures(run_dir) == []


# ----------------------------------------------------------------------------- refusals
@pytest.mark.integration
def test_resume_refuses_a_completed_run_and_a_changed_config(exact, tiny_run):
    run_dir = exact["run_dir"]
    cfg = parse_run_config({**tiny_run, "schedule.phases": EXACT, "privacy.ring-bits": "64",
                            "run.resume": str(run_dir)})
    with pytest.raises(RunFailed, match="already completed"):
        Coordinator(cfg, run_dir, LocalTransport(cfg, {}, "x"), "x", log=lambda s: None).run()
    rec = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**rec, "status": "failed"}))
    try:
        for change, key in (({"privacy.epsilon": 4.0}, "privacy.epsilon"),
                            ({"schedule.phases": "sft:arith, eval"}, "schedule.phases"),
                            ({"train.lr": 0.5}, "train.lr")):
            bad = parse_run_config({**cfg.as_flat(), **change})
            with pytest.raises(RunFailed, match=rf"config differs .* in {key} \(was .*, now "):
                Coordinator(bad, run_dir, LocalTransport(bad, {}, "x"), "x", log=lambda s: None).run()
        other = parse_run_config({**cfg.as_flat(), "run.resume": str(run_dir.parent)})
        with pytest.raises(RunFailed, match="is not the run directory"):
            Coordinator(other, run_dir, LocalTransport(other, {}, "x"), "x", log=lambda s: None).run()
        assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"  # refusals change nothing
    finally:
        (run_dir / "run.json").write_text(json.dumps(rec))


@pytest.mark.integration
def test_resume_refuses_a_ledger_that_does_not_verify_or_a_foreign_key(exact, tmp_path, tiny_run):
    """Checked before anything is written: an edited ledger entry, or a coordinator key that is not the one
    that signed the chain, refuses the resume and leaves the run directory as it was."""
    from distmoe.ledger import generate_signing_key

    run_dir = tmp_path / "run"
    shutil.copytree(exact["run_dir"], run_dir)
    rec = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**rec, "status": "failed"}))
    cfg = parse_run_config({**tiny_run, "schedule.phases": EXACT, "privacy.ring-bits": "64",
                            "run.resume": str(run_dir)})
    lpath = run_dir / "ledger" / "coordinator.jsonl"
    good = lpath.read_text()
    lines = good.splitlines(keepends=True)
    lines[5] = lines[5].replace('"bytes":', '"bytes":1', 1)  # an edited entry: its hash no longer matches
    lpath.write_text("".join(lines))
    with pytest.raises(RunFailed, match="ledger does not verify .*hash mismatch"):
        Coordinator(cfg, run_dir, LocalTransport(cfg, {}, "x"), "x", log=lambda s: None).run()
    lpath.write_text(good)
    generate_signing_key(run_dir / "keys" / "coordinator.key", force=True)
    with pytest.raises(RunFailed, match="is not the key published"):
        Coordinator(cfg, run_dir, LocalTransport(cfg, {}, "x"), "x", log=lambda s: None).run()
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"
    assert not list((run_dir / "checkpoints").glob("corrupt-*")) and lpath.read_text() == good


def test_resume_refuses_a_directory_that_is_not_a_run(tmp_path, tiny_run):
    cfg = parse_run_config({**tiny_run, "run.resume": str(tmp_path)})
    with pytest.raises(RunFailed, match="run.json does not exist"):
        Coordinator(cfg, tmp_path, LocalTransport(cfg, {}, "x"), "x", log=lambda s: None).run()


def test_a_new_run_refuses_a_directory_that_holds_a_run_and_changes_nothing(tmp_path, tiny_run):
    """A new run (no ``run.resume``) pointed at a directory whose coordinator ledger exists refuses before it writes
    anything there. Before, it rewrote ``run.json`` and ``config.toml``, saved its round-0 checkpoint there and
    replaced the coordinator's signing key, and only then refused (at the ledger), so the run there could no longer
    be resumed (its key no longer matched its ``.pub``)."""
    from distmoe.ledger import Ledger, generate_signing_key, public_key_hex
    from distmoe.rundir import RunDir

    files = RunDir(tmp_path)
    key = generate_signing_key(files.ledger_key)
    Ledger(files.ledger, key).append(run="1", round=0, phase="run-start", direction="out", payload_type="policy",
                                     keys=[], shapes={}, bytes=0, sha256="0" * 64, verdict="accepted", peer="all")
    files.ledger_pub.write_text(public_key_hex(key) + "\n")
    files.record.write_text(json.dumps({"run_id": "1", "status": "interrupted", "config": dict(tiny_run)}))
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    cfg = parse_run_config(dict(tiny_run))
    with pytest.raises(RunFailed, match=rf"{files.ledger} exists: {tmp_path} holds a run already .*run.resume"):
        Coordinator(cfg, tmp_path, LocalTransport(cfg, {}, "x"), "x", log=lambda s: None).run()
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


# ----------------------------------------------------------------------------- parties
@pytest.mark.integration
def test_party_refuses_a_repeated_setup_epoch_and_keeps_its_accountant(anchored, tmp_path, tiny_run):
    """A setup for an epoch this session already agreed to is refused (keys are agreed once per epoch); a
    higher epoch of the same logical run, under a new Flower run id, keeps the accountant."""
    run_dir, run_id = anchored["run_dir"], anchored["run_id"]
    cfg = parse_run_config({**tiny_run, "schedule.phases": ANCHORED, "privacy.noise-multiplier": 3.0})
    work = tmp_path / "work" / "party-1"
    shutil.copytree(run_dir / "work" / "party-1", work)  # the fixture's run stays untouched
    node = parse_node_config({"data-path": str(run_dir / "work" / "data" / "party-1"), "party-name": "party-1",
                              "work-dir": str(work)}, cfg.sim)
    sess = PartySession(cfg, node, run_id)  # the session of the resume (epoch 1; same Flower run id)
    assert sess.facts.epoch == 1
    with pytest.raises(SessionError, match="second setup request"):
        sess.setup(SetupRequest(bytes(16), 2, 64, 3, 1.0, 0.0, run_id, 1), 101)
    with pytest.raises(SessionError, match="second setup request"):
        sess.setup(SetupRequest(bytes(16), 2, 64, 3, 1.0, 0.0, "another-run", 5), 101)
    n = len(party_accountant(tmp_path, "party-1", run_id).events)
    assert n == 3  # both router-stats releases and the final eval release
    fresh = PartySession(cfg, node, "flower-new-session")
    fresh.setup(SetupRequest(bytes(16), 2, 64, 3, 1.0, 0.0, run_id, 7), 101)
    assert len(fresh.accountant.events) == n and fresh.facts.epoch == 7
    assert not (work / "secagg" / f"party-1-{run_id}.state").exists()  # the replaced session's secret state
    other = PartySession(cfg, node, "flower-other-run")  # another logical run starts its own count
    other.setup(SetupRequest(bytes(16), 2, 64, 3, 1.0, 0.0, "another-run", 0), 101)
    assert len(other.accountant.events) == 0


@pytest.mark.integration
def test_a_party_that_restarts_rejoins_without_cleanup(tmp_path, lay_out_run):
    """A party down for round 2 (its process died; its state files stay) is left out of that round only
    and is included again from round 3 on, with nothing removed by hand."""
    cfg, nodes, run_dir, run_id = lay_out_run(tmp_path, "sft:arith*4", **{"federation.min-available": 2})
    lines: list[str] = []
    coord, transport = coordinator(cfg, nodes, run_dir, run_id, lines)

    def drop(mtype, node):  # node 101's process dies before round 2 and is back for round 3
        if mtype == "train.sft" and node == 100:  # node 100 is asked first in every round
            if transport.sent.get("train.sft", 0) == 3:
                transport.down.add(101)
            elif transport.sent.get("train.sft", 0) == 5:
                transport.down.discard(101)
        return False
    transport.drop = drop
    rec = coord.run()
    assert rec["status"] == "completed"
    included = [(e["round"], tuple(e["info"]["included"])) for e in coord_ledger(run_dir)
                if e["payload_type"] == "release:model-update"]
    assert included[0] == (1, ("party-0", "party-1", "party-2"))
    assert "party-1" not in included[1][1]
    assert included[-1] == (4, ("party-0", "party-1", "party-2")), included
    assert audit_failures(run_dir) == []


# ----------------------------------------------------------------------------- Simulation Engine
@pytest.mark.slow
def test_simulate_resume_continues_an_interrupted_simulation(tmp_path, tiny_run):
    """``distmoe simulate`` interrupted in round 2 (SIGINT: it stops every Flower/Ray process it started, so
    the ServerApp dies mid-round), then ``distmoe simulate --resume RUN_DIR`` on a fresh local SuperLink
    (a new Flower run id) finishes the schedule; the audit passes on the resumed run. A tiny round takes about
    1.5 s and a round line reaches the terminal through Flower's log stream (0.2 s uploads, 0.5 s stream reads,
    longer on a loaded machine), so the schedule has 12 update rounds: the stop lands with about 15 s of rounds
    still to go (with 3, the run had once ended before the stop arrived)."""
    from distmoe.config import to_toml
    from distmoe.simulate import SimOptions, SimulationError, processes_with_token, run

    conf = tmp_path / "tiny.toml"
    conf.write_text(to_toml({**{k: v for k, v in tiny_run.items() if k != "federation.wait-timeout"},
                             "schedule.phases": "sft:arith*12, eval", "data.synth-examples": 20,
                             "federation.wait-timeout": 60.0}))
    exe = Path(sys.executable).parent / "distmoe"
    env = {**os.environ, "HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    (tmp_path / "home").mkdir()
    proc = subprocess.Popen([str(exe), "simulate", "--parties", "3", "--runs-dir", str(tmp_path / "runs"),
                             "--run-id", "sim", "--no-report", "--config", str(conf), "--timeout", "600"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if "round 1/13 (" in line and "| sft" in line:  # round 1 completed: stop it during round 2
                os.kill(proc.pid, signal.SIGINT)
                break
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    run_dir = tmp_path / "runs" / "sim"
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["status"] != "completed", "".join(seen[-20:])
    token = json.loads((run_dir / "simulate.json").read_text())["token"] if (run_dir / "simulate.json").exists() \
        else None
    if token:
        assert processes_with_token(token) == []
    with pytest.raises(SimulationError, match="come from the run"):
        run(SimOptions(overrides={}, parties=3, resume=run_dir))
    code, _ = run(SimOptions(overrides={}, resume=run_dir, timeout=600, report=False))
    log = (run_dir / "flower.log").read_text()
    assert code == 0, log[-4000:]
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["status"] == "completed"
    assert len(rec["resumes"]) == 1 and rec["resumes"][0]["round"] >= 1
    assert rec["resumes"][0]["session"] != rec["run_id"]  # a new Flower run id, the same logical run
    assert "---- distmoe simulate --resume" in log
    rounds = [e["round"] for e in entries(run_dir / "metrics.jsonl") if e.get("event") == "train"]
    assert rounds == list(range(1, 13))
    assert audit_failures(run_dir) == []
    with pytest.raises(SimulationError, match="already completed"):
        run(SimOptions(overrides={}, resume=run_dir))


# ----------------------------------------------------------------------------- checkpoint cadence
@pytest.mark.integration
def test_a_crash_between_checkpoints_repeats_the_rounds_since_the_last_one(tmp_path, lay_out_run):
    """``checkpoint.every = 2``: rounds 2 (the cadence), 3 (its phase's last) and 4 (an evaluation: DP-charged) are
    resume points, round 1 is not. Killed in round 3, the run resumes from round 2, repeats round 3 with the same
    seeds and ends with exactly the uninterrupted run's model."""
    sched, over = "sft:arith*3, eval", {"privacy.ring-bits": "64", "checkpoint.every": 2, "checkpoint.keep": 10}
    ref_cfg, ref_nodes, ref_dir, ref_id = lay_out_run(tmp_path / "ref", sched, **over)
    coordinator(ref_cfg, ref_nodes, ref_dir, ref_id, [])[0].run()
    written = sorted(p.name for p in (ref_dir / "checkpoints").glob("round-*"))
    assert written == ["round-0", "round-2", "round-3", "round-4"]
    cfg, nodes, run_dir, run_id = lay_out_run(tmp_path / "crash", sched, data_from=ref_dir, **over)
    coord, _ = coordinator(cfg, nodes, run_dir, run_id, [], kill=at_nth("query.unmask", 7))  # round 3's first
    with pytest.raises(Killed):
        coord.run()
    lines2: list[str] = []
    rec = coordinator(resumed_cfg(cfg, run_dir), nodes, run_dir, f"flower-{uuid.uuid4().hex[:6]}", lines2)[0].run()
    assert rec["status"] == "completed" and rec["resumes"][0]["checkpoint"] == "checkpoints/round-2"
    ref, got = final_weights(ref_dir), final_weights(run_dir)
    assert set(ref) == set(got) and all(torch.equal(ref[k], got[k]) for k in ref)


def test_checkpoint_due_always_at_phase_ends_and_charged_releases(make_cfg):
    """The cadence skips only uncharged update rounds inside a phase: never the initial model, a phase's last round,
    a statistics or evaluation round, or an update round under client-level DP."""
    from types import SimpleNamespace

    def due(rnd, kind, end=False, **over):
        co = SimpleNamespace(cfg=make_cfg(**{"checkpoint.every": 3, **over}), s=SimpleNamespace(round=rnd),
                             phase_end=end)
        return RunContext.checkpoint_due(co, kind)

    assert [due(r, "sft") for r in range(0, 7)] == [True, False, False, True, False, False, True]
    assert due(4, "sft", end=True) and due(4, "eval") and due(4, "stats") and not due(4, "rl")
    assert due(4, "sft", **{"privacy.update-noise-multiplier": 0.5})
    assert due(4, "sft", **{"checkpoint.every": 1})


@pytest.mark.parametrize("error", [
    "the SuperLink stopped (its SuperExec is gone): continue the run with run.resume",
    "round 3 failed: " + "party-1 sent a reply the guard refused (byte budget exceeded); " * 4
    + "\nTraceback (most recent call last):\n  File \"loop.py\", line 1\n\tRuntimeError: \u00e9chec",
    None,
])
def test_a_resume_records_the_interrupted_error_in_the_form_the_audit_accepts(tmp_path, tiny_run, error):
    """``run.json``'s ``resumes[].interrupted_error`` holds the interrupted session's error bounded to one printable
    line within the audit's schema (its start kept), so a long or multi-line error never fails ``server-files``."""
    from distmoe.audit.schemas import SHORT_MAX, check_server_files
    from distmoe.coordinator import resume

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = parse_run_config({**tiny_run, "run.resume": str(run_dir)})
    (run_dir / "run.json").write_text(json.dumps({"run_id": "7001", "status": "interrupted", "error": error,
                                                  "config": json.loads(json.dumps(cfg.as_flat()))}))
    said: list[str] = []
    ctx = RunContext(cfg, run_dir, "7002", log=said.append)
    assert resume.begin(ctx) == ("7001", 1)
    meta = json.loads((run_dir / "run.json").read_text())
    stored = meta["resumes"][0]["interrupted_error"]
    assert meta["error"] is None and meta["resumes"][0]["session"] == "7002"
    if error is None:
        assert stored is None
    else:
        assert len(stored) <= resume.REASON_MAX <= SHORT_MAX and stored.isascii() and stored.isprintable()
        assert stored == error if len(error) <= SHORT_MAX else stored.endswith("...") and error.startswith(stored[:-3])
        assert any(error in line for line in said)  # the whole error stays in the resume's log line
    findings, _ = check_server_files(run_dir, meta, "secagg")
    assert not [f for f in findings if "resumes" in f], findings
