"""Unit tests: the coordinator's schedule over the in-process transport, and weighted averaging.

The parties run in this process (``LocalTransport``), but every instruction and reply still goes
through the wire codec.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import uuid

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import distmoe.party.work as work_mod
from distmoe.aggregate import AggregationError, weighted_average
from distmoe.checkpoint import CheckpointError, latest, verify_checkpoint
from distmoe.config import load_override_file, parse_node_config, parse_run_config
from distmoe.coordinator import Coordinator, RunFailed
from distmoe.inprocess import LocalTransport
from distmoe.model.build import build_model, hash_tensors
from distmoe.model.trainable import apply_trainable, load_trainable, spec_of, trainable_state
from distmoe.privacy import metric_noise
from distmoe.rundir.metrics import read_metrics
from distmoe.wire.errors import ALL_REASONS, ErrorCode, reason_text

SCHEDULE = "sft:arith*2, eval, stats:arith, sft:strings, eval"
RUN = {"schedule.phases": SCHEDULE, "schedule.sft-rounds": 1, "train.local-steps": 3, "train.batch-size": 4,
       "data.max-eval-examples": 3, "eval.max-new-tokens": 3, "eval.batch-size": 8,
       "federation.wait-timeout": 1.0, "checkpoint.keep": 2}


def _nodes(cfg, dirs):
    return {100 + i: parse_node_config({"data-path": str(d)}, cfg.sim) for i, d in enumerate(dirs)}


def _coordinator(cfg, dirs, run_dir, lines=None):
    run_id = f"test-{uuid.uuid4().hex[:8]}"  # parties keep per-run state in their work directories
    transport = LocalTransport(cfg, _nodes(cfg, dirs), run_id)
    log = (lines.append if lines is not None else (lambda _s: None))
    return Coordinator(cfg, run_dir, transport, run_id=run_id, log=log), transport


def _events(run_dir, event):
    return [e for e in read_metrics(run_dir / "metrics.jsonl") if e.get("event") == event]


@pytest.fixture(scope="module")
def full_run(synth_dirs, make_cfg, tmp_path_factory):
    """One run of the whole schedule with deterministic per-example correctness (the tiny model learns
    nothing in 9 local steps, and retention is only defined against a non-zero baseline). The evaluation
    noise is off (exact figures are asserted; its DP is ``tests/privacy/test_metric_noise.py``'s)."""
    cfg = make_cfg(**RUN)
    run_dir = tmp_path_factory.mktemp("run") / "run"
    calls = {"arith": 0}
    real = work_mod.example_scores

    def fake_scores(model, tok, task, examples, max_len, ecfg):
        loss = real(model, tok, task, examples[:1], max_len, ecfg)[0][1]  # the real generation path still runs
        if task == "arith":
            calls["arith"] += 1  # first eval (2 parties): all correct; then the last eval: the first only
            return [(calls["arith"] <= 2 or i == 0, loss) for i in range(len(examples))]
        return [(i < 2, loss) for i in range(len(examples))]

    mp = pytest.MonkeyPatch()
    mp.setattr(work_mod, "example_scores", fake_scores)
    mp.setattr(metric_noise, "skellam_noise", lambda shape, variance, rng=None: np.zeros(shape, np.int64))
    lines: list[str] = []
    nodes = _nodes(cfg, synth_dirs)
    own = {n.party: n.work_dir / "metrics" / f"{n.party}.jsonl" for n in nodes.values()}  # each party's own log
    seen = {p: len(f.read_text().splitlines()) if f.exists() else 0 for p, f in own.items()}
    try:
        coord, _ = _coordinator(cfg, synth_dirs, run_dir, lines)
        record = coord.run()
    finally:
        mp.undo()
    party_rows = {p: [json.loads(x) for x in f.read_text().splitlines()[seen[p]:]] for p, f in own.items()}
    return {"cfg": cfg, "dir": run_dir, "record": record, "lines": lines, "arith_calls": calls["arith"],
            "party_rows": party_rows}


# ------------------------------------------------------------------------------------------ full run
@pytest.mark.integration
def test_run_record_and_config(full_run):
    run_dir, cfg = full_run["dir"], full_run["cfg"]
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["status"] == "completed" and rec["error"] is None
    assert rec["finished"] >= rec["started"]
    assert rec["schedule"] == ["sft:arith*2", "eval", "stats:arith", "sft:strings", "eval"]
    assert cfg.schedule.total_rounds == 6
    assert rec["model"]["router_spec"]["num_experts"] == 4
    assert parse_run_config(load_override_file(run_dir / "config.toml")) == cfg
    ends = _events(run_dir, "run_end")
    assert len(ends) == 1 and ends[0]["status"] == "completed"
    assert ends[0]["rounds"] == cfg.schedule.total_rounds
    assert full_run["arith_calls"] == 4  # two parties x two evaluations


@pytest.mark.integration
def test_train_events_are_secure_sums_only(full_run):
    run_dir, cfg = full_run["dir"], full_run["cfg"]
    train = _events(run_dir, "train")
    # rounds: sft:arith (1, 2), eval (3), stats:arith (4), sft:strings (5), eval (6)
    sft_rounds = [1, 2, 5]
    assert sorted({e["round"] for e in train}) == sft_rounds
    assert {e["task"] for e in train if e["round"] < 5} == {"arith"}
    assert {e["task"] for e in train if e["round"] == 5} == {"strings"}
    for r in sft_rounds:  # secure aggregation: the coordinator never sees a single party's numbers
        parties = sorted(e["party"] for e in train if e["round"] == r)
        assert parties == ["all"], (r, parties)
    for e in train:  # uniform weights: the weight sum is the contributor count; only the task-loss slot's mean
        assert e["parties"] == 2 and e["contributors"] == 2 and "num_examples" not in e
        assert not {"loss", "steps", "anchor_kl"} & set(e) and 0.0 < e["task_loss"] <= 16.0
        assert "skipped_steps" not in e  # not even the NaN/Inf step count: it stays at the parties (docs/privacy.md §3)
    # after the stats phase the anchor reaches the parties, whose own metrics log records its KL
    before = [e for e in train if e["round"] < 4]
    after = [e for e in train if e["round"] > 4]
    assert all(e["anchor_version"] == 0 for e in before) and all(e["anchor_version"] == 1 for e in after)
    for own in full_run["party_rows"].values():
        assert [x["round"] for x in own] == sft_rounds
        assert all(x["steps"] == cfg.train.local_steps and math.isfinite(x["task_loss"]) for x in own)
        assert all(math.isfinite(x["anchor_kl"]) for x in own if x["round"] > 4)


@pytest.mark.integration
def test_stats_event_and_anchor_file(full_run):
    run_dir = full_run["dir"]
    stats = _events(run_dir, "stats")
    assert len(stats) == 1
    s = stats[0]
    assert s["round"] == 4 and s["anchor_version"] == 1 and s["parties"] == 2 and s["task"] == "arith"
    anchor_file = run_dir / "anchors" / "round-4.npz"
    assert anchor_file.exists()
    with np.load(anchor_file) as z:
        probs = z["probs"]
    assert probs.shape == (2, 4)
    np.testing.assert_allclose(probs.sum(1), np.ones(2), atol=1e-5)
    meta = json.loads(anchor_file.with_suffix(".json").read_text())
    assert meta["round"] == 4 and meta["router_spec"]["moe_layers"] == [0, 1]
    # every train example of both parties contributed one sequence
    assert meta["num_sequences"] == pytest.approx(s["num_sequences"]) and s["num_sequences"] > 10


@pytest.mark.integration
def test_eval_events_accuracy_and_retention(full_run):
    run_dir = full_run["dir"]
    evals = _events(run_dir, "eval")
    rounds = sorted({e["round"] for e in evals})
    assert rounds == [3, 6]
    first = [e for e in evals if e["round"] == 3]
    last = [e for e in evals if e["round"] == rounds[-1]]
    assert sorted(e["party"] for e in first) == sorted(e["party"] for e in last) == ["all"]
    for e in first:
        assert e["acc/arith"] == pytest.approx(1.0) and "retention/arith" not in e
        assert "acc/strings" not in e  # strings not trained yet
    for e in last:
        assert e["acc/arith"] == pytest.approx(1 / 3)
        assert e["acc/strings"] == pytest.approx(2 / 3)
        # retention is undefined: the baseline 1.0 of 6 held-out examples is within its noise scale of 0 (the
        # noise is off here, its scale is not: ~5.2 examples per sum at z_m = 3, so 1.0 +- 1.2)
        assert "retention/arith" in e and e["retention/arith"] is None  # written as null: undefined
        assert not any(k.startswith(("acc_sd/", "loss_sd/")) for k in e)
        assert e["new_task"] == "strings"
        assert e["n/arith"] > 0 and 0 <= e["loss/arith"] <= 16.0
        assert not {"top1_consistency", "routing_kl", "load_cv"} & set(e)  # not released under secagg
    assert last[0]["n/arith"] == 6  # the noise is off here: 2 parties x 3 examples
    releases = [json.loads(x) for x in (run_dir / "ledger" / "coordinator.jsonl").read_text().splitlines()]
    evals = [r for r in releases if r.get("payload_type") == "release:eval"]
    assert [r["round"] for r in evals] == [3, 6]
    assert all(r["dp"]["mechanism"] == "skellam" and r["dp"]["z_eff"] > 0 for r in evals)  # charged as DP


@pytest.mark.integration
def test_checkpoints(full_run, tmp_path):
    run_dir, cfg = full_run["dir"], full_run["cfg"]
    root = run_dir / "checkpoints"
    final_round, prev_round = 6, 5  # every completed round ends with a checkpoint (the resume point); keep = 2
    assert (root / "LATEST").read_text().strip() == f"round-{final_round}"
    ck = latest(root)
    assert ck == root / f"round-{final_round}" and ck.is_dir()
    manifest = verify_checkpoint(ck)
    assert manifest["round"] == final_round
    rounds = sorted(p.name for p in root.iterdir() if p.is_dir())
    # checkpoint.keep newest round dirs, plus the pinned initial model (0) and the model before strings (4)
    assert rounds == ["round-0", "round-4", "round-5", "round-6"]  # no temporary dirs
    assert verify_checkpoint(root / "round-0")["kept"] == "initial model"
    assert verify_checkpoint(root / "round-4")["kept"] == "before task strings"
    assert "kept" not in manifest
    assert sorted(p.name for p in root.iterdir() if p.is_file()) == ["LATEST"]
    final = load_file(str(ck / "trainable.safetensors"))
    assert manifest["trainable_hash"] == hash_tensors({k: torch.from_numpy(v) for k, v in final.items()})
    # round 0 is the deterministic initial model (kept on disk): training moved the weights
    model0 = apply_trainable(build_model(cfg.model)[0], cfg.model)
    init = {k: v.numpy() for k, v in trainable_state(model0).items()}
    assert sorted(init) == sorted(final)
    kept0 = load_file(str(root / "round-0" / "trainable.safetensors"))
    assert all(np.array_equal(init[k], kept0[k]) for k in init)
    assert any(not np.array_equal(init[k], final[k]) for k in init)
    verify_checkpoint(root / f"round-{prev_round}")
    prev = load_file(str(root / f"round-{prev_round}" / "trainable.safetensors"))
    assert all(np.array_equal(prev[k], final[k]) for k in prev)  # the final eval round leaves the model as is
    assert json.loads((ck / "state.json").read_text())["round"] == final_round
    # the exported model loads with model.path and carries exactly the checkpointed weights
    loaded, tok = build_model(cfg.model, model_path=str(ck / "model"))
    loaded_state = trainable_state(apply_trainable(loaded, cfg.model))
    for k, v in final.items():
        np.testing.assert_array_equal(loaded_state[k].numpy(), v, err_msg=k)
    assert tok.pad_token_id == 0
    # corruption is detected
    copy = tmp_path / "ck"
    shutil.copytree(ck, copy)
    f = copy / "trainable.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="trainable.safetensors"):
        verify_checkpoint(copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest"):
        verify_checkpoint(copy)


@pytest.mark.integration
def test_log_lines(full_run):
    text = "\n".join(full_run["lines"])
    assert "secure aggregation on every reply" in text and "plaintext" not in text
    assert "run completed" in text


@pytest.mark.integration
def test_plaintext_baseline_warns_and_keeps_per_party_rows(synth_dirs, make_cfg, tmp_path):
    cfg = make_cfg(**{**RUN, "schedule.phases": "sft:arith*1, eval", "privacy.mode": "plaintext"})
    lines: list[str] = []
    coord, _ = _coordinator(cfg, synth_dirs, tmp_path / "run", lines)
    coord.run()
    assert "privacy.mode = plaintext" in "\n".join(lines)
    rec = json.loads((tmp_path / "run" / "run.json").read_text())
    assert rec["privacy"]["mode"] == "plaintext" and rec["warnings"]
    train = _events(tmp_path / "run", "train")
    assert sorted(e["party"] for e in train) == ["all", "party-0", "party-1"]
    for e in train:
        if e["party"] != "all":
            assert e["steps"] == cfg.train.local_steps and e["num_examples"] > 0


# ------------------------------------------------------------------------------------------ failures
@pytest.mark.integration
def test_dropout_round_completes_with_other_party(synth_dirs, make_cfg, tmp_path):
    """Plaintext baseline (2 parties); secure-mode dropouts are in tests/coordinator/test_secure_runs.py."""
    cfg = make_cfg(**{**RUN, "schedule.phases": "sft:arith*1", "privacy.mode": "plaintext"})
    run_dir = tmp_path / "run"
    coord, transport = _coordinator(cfg, synth_dirs, run_dir)
    transport.down = {101}
    coord.run()
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"
    errors = _events(run_dir, "party_error")
    assert len(errors) == 1 and errors[0]["node"] == "101" and errors[0]["code"] == "no-reply"
    assert errors[0]["reason"] == ALL_REASONS["no-reply"]
    train = _events(run_dir, "train")
    assert sorted(e["party"] for e in train) == ["all", "party-0"]
    agg = next(e for e in train if e["party"] == "all")
    assert agg["parties"] == 1 and "skipped" not in agg
    assert latest(run_dir / "checkpoints").name == "round-1"


@pytest.mark.integration
def test_corrupt_party_data_reaches_the_server_as_a_code_only(synth_dirs, make_cfg, tmp_path):
    """A data-file error names file and line at the party (its own log); the server learns the code."""
    cfg = make_cfg(**{**RUN, "schedule.phases": "sft:arith*1", "privacy.mode": "plaintext"})
    bad = tmp_path / "party-bad"
    shutil.copytree(synth_dirs[1], bad)
    arith = bad / "arith.jsonl"
    n_lines = len(arith.read_text().splitlines())
    with arith.open("a") as fh:
        fh.write('{"instruction": "Compute", "input": "1+1", "output": \n')
    run_dir = tmp_path / "run"
    lines: list[str] = []
    coord, _ = _coordinator(cfg, [synth_dirs[0], bad], run_dir, lines)
    coord.run()
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"
    errors = _events(run_dir, "party_error")
    assert len(errors) == 1
    assert errors[0]["code"] == "data" and errors[0]["reason"] == reason_text(ErrorCode.DATA)
    assert not re.search(r"\d", errors[0]["reason"]) and "arith" not in errors[0]["reason"]
    said = [x for x in lines if "left out of" in x]
    assert said and "[data]" in said[0] and "see the party's log" in said[0] and "arith.jsonl" not in said[0]
    (log,) = [f.read_text() for f in tmp_path.glob("*-work/party.log")]  # the party's own log
    assert f"arith.jsonl:{n_lines + 1}" in log and "JSON" in log, log
    assert sorted(e["party"] for e in _events(run_dir, "train")) == ["all", "party-0"]


def test_too_few_parties_fails_after_the_wait_timeout(synth_dirs, make_cfg, tmp_path):
    """Two parties for ``min-parties = 3``: the run gives up once ``federation.wait-timeout`` has passed, before
    any round starts, and says which setting it waited for."""
    cfg = make_cfg(**{**RUN, "federation.min-available": 3, "federation.wait-timeout": 1.0})
    run_dir = tmp_path / "run"
    coord, _ = _coordinator(cfg, synth_dirs, run_dir)
    with pytest.raises(RunFailed, match=r"only 2 of federation.min-available = 3 .* federation.wait-timeout = 1.0 s"):
        coord.run()
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["status"] == "failed" and "min-available" in rec["error"]
    ends = _events(run_dir, "run_end")
    assert ends and ends[-1]["status"] == "failed"
    assert not _events(run_dir, "train")


# ------------------------------------------------------------------------------------------ averaging
def test_weighted_average_exact():
    a = {"w": np.array([1.0, 2.0], np.float32), "b": np.array([[0.0]], np.float32)}
    b = {"w": np.array([3.0, -2.0], np.float32), "b": np.array([[4.0]], np.float32)}
    out = weighted_average([(a, 1.0), (b, 3.0)])
    np.testing.assert_allclose(out["w"], [2.5, -1.0], rtol=1e-7)
    np.testing.assert_allclose(out["b"], [[3.0]], rtol=1e-7)
    assert out["w"].dtype == np.float32
    assert np.array_equal(a["w"], [1.0, 2.0])  # inputs untouched


def test_weighted_average_zero_weights():
    a = {"w": np.array([1.0], np.float32)}
    b = {"w": np.array([100.0], np.float32)}
    out = weighted_average([(a, 2.0), (b, 0.0)])
    np.testing.assert_allclose(out["w"], [1.0])
    # a zero-weight update is ignored even when its keys differ
    assert weighted_average([(a, 2.0), ({"other": np.zeros(1)}, 0)])["w"][0] == 1.0
    assert weighted_average([(a, 0.0), (b, 0)]) is None
    assert weighted_average([]) is None


def test_weighted_average_mismatches_raise():
    a = {"w": np.zeros(2, np.float32)}
    with pytest.raises(AggregationError, match="keys"):
        weighted_average([(a, 1.0), ({"v": np.zeros(2, np.float32)}, 1.0)])
    with pytest.raises(AggregationError, match="shape"):
        weighted_average([(a, 1.0), ({"w": np.zeros(3, np.float32)}, 1.0)])


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["lora", "router+experts"])
def test_run_with_partial_trainable_modes(synth_dirs, make_cfg, tmp_path, mode):
    cfg = make_cfg(**{**RUN, "schedule.phases": "sft:arith*1, stats:arith", "model.trainable": mode})
    run_dir = tmp_path / "run"
    coord, _ = _coordinator(cfg, synth_dirs, run_dir)
    coord.run()
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"
    assert not _events(run_dir, "party_error")  # every party shares the server's frozen base
    agg = next(e for e in _events(run_dir, "train") if e["party"] == "all")
    assert agg["parties"] == 2
    ck = latest(run_dir / "checkpoints")
    assert ck.name == "round-2"  # the stats round ends with a checkpoint too (same model, new anchor)
    verify_checkpoint(ck)
    final = load_file(str(ck / "trainable.safetensors"))
    model0 = apply_trainable(build_model(cfg.model)[0], cfg.model)
    init = {k: v.numpy() for k, v in trainable_state(model0).items()}
    assert sorted(init) == sorted(final)
    assert any(not np.array_equal(init[k], final[k]) for k in init)
    manifest = verify_checkpoint(ck)
    if mode != "lora":
        loaded, _ = build_model(cfg.model, model_path=str(ck / "model"))  # the full model loads
        assert loaded.config.model_type == "qwen3_moe" and "base_fingerprint" not in manifest
        return
    # lora: the server held the adapters only; the checkpoint is peft's format beside the base fingerprint
    from transformers import AutoModelForCausalLM

    from distmoe.export import export_run

    assert {p.device.type for p in coord.model.module.parameters()} == {"meta"}
    assert json.loads((run_dir / "run.json").read_text())["model"]["server_holds"] == "adapters"
    assert not (ck / "model").exists() and manifest["layout"] == "adapter"
    assert manifest["base_fingerprint"] == coord.tspec.base_hash
    assert sorted(p.name for p in (ck / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    out = export_run(run_dir)  # merged into the tiny base: a standalone checkpoint with the adapted logits
    assert out == run_dir / "export" / ck.name
    party = apply_trainable(build_model(cfg.model)[0], cfg.model)
    load_trainable(party, {k: torch.from_numpy(v) for k, v in final.items()}, spec_of(party, "lora"))
    ids = torch.randint(6, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(out)(input_ids=ids).logits,
                                   party.eval()(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.integration
def test_a_sigmoid_router_run_trains_its_own_correction_bias_and_exports_it(synth_dirs, make_cfg, tmp_path):
    """DeepSeek-V3 with ``routing.balance = "bias"``: the parties move the checkpoint's own ``e_score_correction_bias``,
    FedAvg aggregates it, and ``distmoe export`` writes it into the router's own slot without --drop-routing-bias."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from distmoe.export import export_run
    from distmoe.model.fabricate import write_checkpoint

    ckpt = write_checkpoint("deepseek_v3", tmp_path / "v3", seed=5)
    cfg = make_cfg(**{**RUN, "schedule.phases": "sft:arith*1, stats:arith", "model.path": str(ckpt),
                      "model.trainable": "router+experts", "routing.balance": "bias", "model.max-seq-len": 64})
    run_dir = tmp_path / "run"
    coord, _ = _coordinator(cfg, synth_dirs, run_dir)
    coord.run()
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"
    assert not _events(run_dir, "party_error")
    ck = latest(run_dir / "checkpoints")
    final = load_file(str(ck / "trainable.safetensors"))
    (key,) = [k for k in final if k.endswith("e_score_correction_bias")]
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as sf:
        start = sf.get_tensor(key)
    moved = torch.from_numpy(np.asarray(final[key])) - start
    assert moved.abs().max() > 0  # the parties' sign-rule steps, averaged
    assert moved.abs().max() <= cfg.routing.balance_rate * cfg.train.local_steps + 1e-6
    out = export_run(run_dir)  # no --drop-routing-bias
    torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(out).get_buffer(key),
                               torch.from_numpy(np.asarray(final[key])))
