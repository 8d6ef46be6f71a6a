"""The ``rl`` phase end to end in-process: coordinator round, party GRPO, wire, report (its config keys:
tests/config/test_rl_keys.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from distmoe.config import NodeConfig, parse_run_config
from distmoe.coordinator import Coordinator
from distmoe.inprocess import LocalTransport
from distmoe.report.report import write_report

pytestmark = pytest.mark.integration  # every test here is a whole in-process run


@pytest.mark.parametrize("mode", ["plaintext", "secagg"])
def test_rl_phase_round_trip(synth_dirs, tmp_path: Path, tiny, mode):
    """Per-party RL metrics reach the server only in the plaintext baseline; under secure aggregation the update sum
    carries the contributor count and the RL training-metric slots, whose means equal the mean of the parties' own
    (clipped) figures."""
    cfg = parse_run_config({**tiny, "schedule.phases": "sft:lookup, rl:lookup*2, eval", "schedule.sft-rounds": 1,
                            "train.local-steps": 4, "rl.steps": 2, "rl.prompts-per-step": 4, "rl.group-size": 2,
                            "rl.max-new-tokens": 4, "rl.engine": "bf16", "checkpoint.keep": 10,
                            "federation.min-available": 2, "privacy.mode": mode})
    nodes = {i: NodeConfig(party=d.name, data_path=d, work_dir=tmp_path / "w", model_path="")
             for i, d in enumerate(synth_dirs)}
    run_dir = tmp_path / "run"
    Coordinator(cfg, run_dir, LocalTransport(cfg, nodes), "t", log=lambda s: None).run()
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [e for e in events if e["event"] == "rl"]
    agg = [e for e in rl if e["party"] == "all"]
    assert [e["round"] for e in agg] == [2, 3]
    if mode == "secagg":
        assert {e["party"] for e in rl} == {"all"}  # secure aggregation: only sums reach the coordinator
        owns = [[json.loads(x) for x in (tmp_path / "w" / "metrics" / f"{d.name}.jsonl").read_text().splitlines()]
                for d in synth_dirs]
        for e in agg:  # uniform weights; the RL slots' means (every other RL figure stays in the parties' logs)
            assert e["engine"] == "bf16" and e["contributors"] == 2 and "num_examples" not in e
            assert "clip_frac" not in e and "route_disagree_l0" not in e
            for k in ("reward", "masked_frac_low", "masked_frac_high", "k3", "logp_diff_mean"):
                mine = [next(x for x in own if x["round"] == e["round"])[f"released_{k}"] for own in owns]
                assert e[k] == pytest.approx(sum(mine) / 2, abs=1e-6), k
        own = owns[0]
        assert [x["round"] for x in own if x["kind"] == "RlInstruction"] == [2, 3]
        assert all(0.0 <= x["reward"] <= 1.0 for x in own if x["kind"] == "RlInstruction")
        # what the server wrote of the RL rounds (engine, correction, contributors) fits the audit's file schemas
        from distmoe.audit.schemas import check_server_files

        findings, _ = check_server_files(run_dir, json.loads((run_dir / "run.json").read_text()), cfg.privacy.mode)
        assert findings == []
        return
    for e in agg:
        assert e["engine"] == "bf16" and e["correction"] == "icepop"
        assert 0.0 <= e["reward"] <= 1.0
        assert e["logp_diff_mean"] > 0  # bf16 really differs from the fp32 trainer
        assert math.isfinite(e["k3"]) and e["k3"] >= 0
        assert "route_disagree_l0" in e and "route_disagree_l1" in e
        assert e["num_examples"] == 2 * 2 * 4 * 2  # summed examples: parties x steps x prompts x group
    # every RL round was checkpointed; the global model moves iff some group had a reward signal
    # (group-relative advantages are exactly zero when every sample of a group scores the same)
    w1 = load_file(str(run_dir / "checkpoints" / "round-1" / "trainable.safetensors"))
    w3 = load_file(str(run_dir / "checkpoints" / "round-3" / "trainable.safetensors"))
    moved = any((w1[k] != w3[k]).any() for k in w1)
    no_signal = all(e["reward"] in (0.0, 1.0) for e in agg)  # every sample of every group scored the same
    if no_signal:
        assert not moved
    ck = run_dir / "checkpoints"
    assert (ck / "round-2").is_dir() and (ck / "LATEST").read_text().strip() == "round-4"  # every round ends saved
    report = write_report(run_dir)
    assert "RL rounds" in report.read_text() and (run_dir / "report" / "rl.png").exists()


def test_rl_phase_with_the_inference_simulator(synth_dirs, tmp_path: Path, tiny):
    cfg = parse_run_config({**tiny, "schedule.phases": "sft:lookup, rl:lookup*1", "schedule.sft-rounds": 1,
                            "train.local-steps": 4, "rl.steps": 2, "rl.prompts-per-step": 4, "rl.group-size": 2,
                            "rl.max-new-tokens": 4, "rl.engine": "prune-1", "rl.simulator": True,
                            "rl.simulator-recalibrate-every": 1, "federation.min-available": 2,
                            "privacy.mode": "plaintext"})
    nodes = {i: NodeConfig(party=d.name, data_path=d, work_dir=tmp_path / "w", model_path="")
             for i, d in enumerate(synth_dirs)}
    Coordinator(cfg, tmp_path / "run", LocalTransport(cfg, nodes), "t", log=lambda s: None).run()
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [e for e in events if e["event"] == "rl" and e["party"] != "all"]
    assert len(rl) == 2
    for e in rl:  # the simulator's diagnostics travel with the update, and fallbacks are counted
        assert "sim_r2" in e and "sim_fallback" in e and 0.0 <= e["sim_fallback"] <= 1.0
        assert e["sim_trusted"] == 1.0 - e["sim_fallback"] and 0.0 <= e["sim_recal_triggered"] <= 1.0


def test_rl_phase_with_routing_replay_reports_it(synth_dirs, tmp_path: Path, tiny):
    """The replay figures reach the server's aggregate in the plaintext baseline (under secure aggregation only
    the RL training-metric slots do)."""
    cfg = parse_run_config({**tiny, "schedule.phases": "sft:lookup, rl:lookup*1", "schedule.sft-rounds": 1,
                            "train.local-steps": 4, "rl.steps": 2, "rl.prompts-per-step": 4, "rl.group-size": 2,
                            "rl.max-new-tokens": 4, "rl.engine": "prune-1", "rl.routing-replay": True,
                            "federation.min-available": 2, "privacy.mode": "plaintext"})
    nodes = {i: NodeConfig(party=d.name, data_path=d, work_dir=tmp_path / "w", model_path="")
             for i, d in enumerate(synth_dirs)}
    Coordinator(cfg, tmp_path / "run", LocalTransport(cfg, nodes), "replay", log=lambda s: None).run()
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (agg,) = [e for e in events if e["event"] == "rl" and e["party"] == "all"]
    # the trainer replays the engine's experts: its log-probs match the engine's far better than natively
    assert 0.0 <= agg["replay_override_frac"] <= 1.0
    assert agg["logp_diff_mean"] < agg["logp_diff_mean_native"]
