"""Dynamic expert expansion over a whole in-process run (``retention.expand-experts``): the coordinator grows the
model at the second task, the parties follow from the weights' shapes, the rounds after it aggregate under secure
aggregation with the longer layout, the earlier experts stay exact through task B, a coordinator killed after the
expansion resumes into the expanded shape, and the audit passes."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from distmoe.audit import audit_run
from distmoe.config import parse_run_config
from distmoe.coordinator import Coordinator
from distmoe.inprocess import LocalTransport

SCHEDULE = "sft:arith, stats:arith, sft:lookup*2, eval"  # the expansion is at round 3 (task lookup)
K = 2


class Killed(Exception):
    """The coordinator dies here (raised from inside the transport)."""


def _weights(run_dir: Path, rnd: int) -> dict:
    return load_file(str(run_dir / "checkpoints" / f"round-{rnd}" / "trainable.safetensors"))


def _ledger(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "ledger" / "coordinator.jsonl").read_text().splitlines() if x]


@pytest.fixture(scope="module")
def crashed_and_resumed(tmp_path_factory, lay_out_run):
    cfg, nodes, run_dir, run_id = lay_out_run(tmp_path_factory.mktemp("expand"), SCHEDULE,
                                              **{"retention.expand-experts": K, "checkpoint.keep": 20})
    transport = LocalTransport(cfg, nodes, run_id)
    seen = {"n": 0}

    def drop(mtype, node):  # 3 unmask requests each in rounds 1-3: the 10th is round 4's first
        if mtype == "query.unmask":
            seen["n"] += 1
            if seen["n"] == 10:
                raise Killed("killed in round 4")
        return False
    transport.drop = drop
    lines: list[str] = []
    coord = Coordinator(cfg, run_dir, transport, run_id, log=lines.append)
    with pytest.raises(Killed):
        coord.run()
    crashed = {"experts": coord.mspec.num_experts, "expansions": [dict(e) for e in coord.s.expansions]}
    rcfg = parse_run_config({**cfg.as_flat(), "run.resume": str(run_dir)})
    lines2: list[str] = []
    session = f"flower-{uuid.uuid4().hex[:6]}"  # the resumed session's Flower run id, as the parties see it
    coord2 = Coordinator(rcfg, run_dir, LocalTransport(rcfg, nodes, session), session, log=lines2.append)
    record = coord2.run()
    return {"cfg": cfg, "run_dir": run_dir, "coord": coord2, "record": record, "crashed": crashed,
            "lines": lines, "lines2": lines2}


@pytest.mark.integration
def test_expansion_run_crashes_resumes_and_keeps_the_earlier_experts(crashed_and_resumed):
    r = crashed_and_resumed
    run_dir, coord, rec = r["run_dir"], r["coord"], r["record"]
    assert rec["status"] == "completed", r["lines2"][-5:]
    assert r["cfg"].privacy.mode == "secagg"
    E0 = r["cfg"].model.experts
    # the crash came after the expansion (round 3): the resumed coordinator replayed it from the checkpoint
    assert r["crashed"]["experts"] == E0 + K and len(r["crashed"]["expansions"]) == 1
    assert coord.mspec.num_experts == E0 + K and coord.s.expansions == r["crashed"]["expansions"]
    exp = coord.s.expansions[0]
    assert (exp["round"], exp["task"], exp["from"], exp["to"]) == (3, "lookup", E0, E0 + K)
    assert any("expanded to 6 experts" in x for x in r["lines"])
    assert any("continuing with round 4" in x for x in r["lines2"])
    # checkpoints: round 2 has the old shape, rounds 3.. the new one; the anchor of task arith was padded
    w2, w3, w5 = _weights(run_dir, 2), _weights(run_dir, 3), _weights(run_dir, 5)
    routers = [k for k in w5 if k.endswith(".mlp.gate.weight")]
    experts = [k for k in w5 if ".mlp.experts." in k]
    assert routers and experts
    for k in routers + experts:
        assert w2[k].shape[0] == E0 and w3[k].shape[0] == E0 + K and w5[k].shape[0] == E0 + K
        # every earlier expert and router row is exactly as task arith left it, after two rounds of task lookup
        assert np.array_equal(w5[k][:E0].numpy(), w2[k].numpy()), k
    moved = [k for k in routers + experts if not np.array_equal(w5[k][E0:].numpy(), w3[k][E0:].numpy())]
    assert len(moved) == len(routers + experts)  # the new experts and router rows trained on task lookup
    assert coord.s.task_anchors["arith"].probs.shape == (coord.mspec.num_moe_layers, E0 + K)
    assert not coord.s.task_anchors["arith"].probs[:, E0:].any()
    # the secure sums after the expansion have the longer layout; the audit checks every message
    ledger = _ledger(run_dir)
    lengths = {e["round"]: e["shapes"]["sum"][0] for e in ledger if e["payload_type"] == "release:model-update"}
    assert set(lengths) == {1, 3, 4} and lengths[3] == lengths[4] > lengths[1]
    start = ledger[0]["info"]["policy"]
    assert "shape_choices" in start["masked-input:model-update"]
    assert [e["payload_type"] for e in ledger].count("run-resume") == 1
    failures = [f"{c.name}: {c.details}" for c in audit_run(run_dir).checks if c.status == "fail"]
    assert failures == []


def test_an_unsupported_family_is_refused_when_the_run_starts(tmp_path):
    from distmoe.coordinator import RunFailed
    from distmoe.model.fabricate import write_checkpoint

    path = write_checkpoint("gpt_oss", tmp_path / "ckpt")  # its router has a bias
    cfg = parse_run_config({"model.path": str(path), "model.trainable": "router+experts",
                            "retention.expand-experts": 1})
    lines: list[str] = []
    with pytest.raises(RunFailed, match=r"retention.expand-experts.*not 'gpt_oss'"):
        Coordinator(cfg, tmp_path / "run", LocalTransport(cfg, {}, "x"), "x", log=lines.append).run()
    assert not (tmp_path / "run" / "checkpoints").exists()  # before round 0 was saved or anyone was contacted
