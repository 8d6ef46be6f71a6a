"""End to end on Flower's Simulation Engine (``flwr run`` + Ray), through ``distmoe simulate``.

Slow (about a minute): a real local SuperLink, a real simulation process with Ray, 3 virtual
SuperNodes, a tiny model, 2 SFT rounds then stats and eval.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from distmoe.simulate import SimOptions, processes_with_token, run

TINY = {"model.hidden-size": 64, "model.moe-intermediate-size": 64, "model.layers": 2, "model.heads": 2,
        "model.kv-heads": 1, "model.head-dim": 32, "train.local-steps": 8, "data.synth-examples": 40,
        "schedule.phases": "sft:lookup*2, stats:lookup, eval, rl:lookup*1", "checkpoint.keep": 10,
        "rl.steps": 2, "rl.prompts-per-step": 4, "rl.group-size": 2, "rl.max-new-tokens": 4,
        "train.lr": 5e-3, "train.lr-experts": 5e-3, "train.lr-router": 5e-3}


@pytest.mark.slow
def test_simulate_three_parties_two_rounds(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "outer-home"))  # nothing may land in the caller's home
    (tmp_path / "outer-home").mkdir()
    code, run_dir = run(SimOptions(overrides=dict(TINY), parties=3, runs_dir=tmp_path / "runs",
                                   run_id="it", timeout=600, echo=True))
    log = (run_dir / "flower.log").read_text() if (run_dir / "flower.log").exists() else ""
    assert code == 0, f"simulate failed; log tail:\n{log[-4000:]}"
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["status"] == "completed"
    # a tiny random model routes unevenly: the probe's routing-health warnings are expected; nothing else warns
    assert [w for w in rec["warnings"] if "on the probe set" not in w] == [] and rec["privacy"]["mode"] == "secagg"
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    probed = sorted(e["round"] for e in events if e.get("event") == "probe")
    assert probed == [1, 2, 3, 4, 5]  # every round of the 5-round schedule, on the Simulation Engine
    assert rec["privacy"]["threshold"] == 2 and sorted(rec["parties"]) == ["party-0", "party-1", "party-2"]

    # each virtual SuperNode got exactly one party directory
    nodes = sorted((run_dir / "nodes").glob("node-*.toml"))
    assert [n.name for n in nodes] == ["node-0.toml", "node-1.toml", "node-2.toml"]

    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [e for e in events if e["event"] == "train"]
    parties = {e["party"] for e in train}
    assert parties == {"all"}  # secure aggregation: the coordinator sees only sums
    agg = [e for e in train if e["party"] == "all"]
    assert all(e["parties"] == 3 for e in agg)
    assert [e["round"] for e in agg] == [1, 2]
    # uniform weights, no training metric at the server (secure aggregation); each party's own log has its losses
    assert all(e["contributors"] == 3 and "loss_last" not in e for e in agg)
    own = {p: [json.loads(x) for x in (run_dir / "work" / p / "metrics" / f"{p}.jsonl").read_text().splitlines()]
           for p in ("party-0", "party-1", "party-2")}
    sft = [[x for x in rows if x["kind"] == "SftInstruction"] for rows in own.values()]
    first = sum(rows[0]["loss_first"] for rows in sft) / 3
    last = sum(rows[-1]["loss_last"] for rows in sft) / 3
    assert last < first, "the task loss did not fall"
    assert any(e["event"] == "stats" for e in events)
    rl = [e for e in events if e["event"] == "rl" and e["party"] == "all"]
    assert [e["round"] for e in rl] == [5] and rl[0]["parties"] == 3  # the train.rl handler ran at every party
    rl_own = [x for rows in own.values() for x in rows if x["kind"] == "RlInstruction"]
    assert len(rl_own) == 3 and all(x["logp_diff_mean"] > 0 and "route_disagree_l0" in x for x in rl_own)
    final = [e for e in events if e["event"] == "eval" and e["party"] == "all"][-1]
    # a noised count (fresh noise each run), clamped at 0; the accuracy is NaN (null in metrics.jsonl) while that
    # count is below 1/2 (``distmoe.privacy.metric_noise``): on this tiny evaluation set the noise can cover it all
    n, acc = final["n/lookup"], final.get("acc/lookup")
    assert n >= 0.0 and (0.0 <= acc <= 1.0 if n >= 0.5 else acc is None or acc != acc), (n, acc)
    assert "routing_kl" not in final  # routing metrics are not released under secure aggregation

    # parameters changed: round-0 vs round-2 checkpoints; manifest-hashed, atomic names only
    ck = run_dir / "checkpoints"
    assert (ck / "LATEST").read_text().strip() == "round-5"
    w0 = load_file(str(ck / "round-0" / "trainable.safetensors"))
    w2 = load_file(str(ck / "round-2" / "trainable.safetensors"))
    changed = sum(int((w0[k] != w2[k]).any()) for k in w0)
    assert changed > len(w0) // 2
    assert not list(ck.glob(".tmp-*"))
    assert list((run_dir / "anchors").glob("round-*.npz"))

    # Flower's and Ray's state stayed inside the run directory; every process was stopped
    assert (run_dir / "flwr").is_dir()
    assert not (tmp_path / "outer-home" / ".flwr").exists()
    assert (run_dir / "report" / "report.md").exists()
    sim = json.loads((run_dir / "simulate.json").read_text())
    assert sim["stopped_pids"], "simulate must have stopped the SuperLink it started"
    # Ray's dashboard and runtime-env agents drop the token but stay in the session flwr run was started in
    assert processes_with_token(sim["token"], sim["session"]) == [] and sim["remaining"] == []
    leftovers = [line for line in log.splitlines() if "Traceback" in line]
    assert not leftovers, log[-3000:]

    # the privacy audit passes on this run: every ledger, anchor, allow-list, epsilon and canary check
    from distmoe.audit import audit_run

    result = audit_run(run_dir)
    assert result.verdict == "pass", [(c.name, c.findings) for c in result.checks if c.status == "fail"]
    for name in ("ledger-integrity", "cross-check", "allow-list", "epsilon", "noise-presence", "row-noise",
                 "canary-positions", "canaries"):
        assert result.check(name).status == "pass", (name, result.check(name).details)
    assert len(list((run_dir / "work").glob("*/ledger/*.jsonl"))) == 3


def test_simulate_fails_cleanly_on_bad_party_data(tmp_path: Path):
    from distmoe.data.formats import DataError

    data = tmp_path / "data"
    (data / "a").mkdir(parents=True)
    (data / "b").mkdir()
    (data / "a" / "lookup.jsonl").write_text('{"instruction": "k1", "output": "ABC"}\n')
    bad = '{"instruction": "k1", "output": "ABC"}\n{"instruction": 3, "output": "x"}\n'
    (data / "b" / "lookup.jsonl").write_text(bad)
    with pytest.raises(DataError, match=r"lookup.jsonl:2: field 'instruction'"):
        run(SimOptions(overrides=dict(TINY), data=data, runs_dir=tmp_path / "runs", run_id="bad", echo=False))
    assert not (tmp_path / "runs" / "bad").exists(), "nothing may be created before validation passes"


@pytest.mark.slow
def test_simulate_exits_nonzero_with_the_reason_when_the_run_fails(tmp_path: Path, capsys):
    over = {**TINY, "model.path": str(tmp_path / "no-such-checkpoint")}
    code, run_dir = run(SimOptions(overrides=over, parties=2, runs_dir=tmp_path / "runs", run_id="fail",
                                   timeout=300, report=False))
    assert code == 1
    err = capsys.readouterr().err  # one stream for progress (stdout), one for errors (stderr)
    assert "distmoe simulate: run FAILED" in err and "no-such-checkpoint" in err  # the reason, not a bare status
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["status"] == "failed" and "not a directory" in rec["error"]
    sim = json.loads((run_dir / "simulate.json").read_text())
    assert processes_with_token(sim["token"]) == []
