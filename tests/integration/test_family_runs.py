"""Every supported MoE family end to end on Flower's Simulation Engine (``flwr run`` + Ray), through
``distmoe simulate``, with ``model.path`` = a fabricated checkpoint of the family (random weights saved with
``save_pretrained``, a real byte-level BPE tokenizer and a ChatML template; ``distmoe.model.fabricate``).

Each run: 2 parties, router statistics, one SFT round with the anchor, evaluation, one RL round, then
``distmoe audit``. Slow: 54-63 s per family alone on 2 cores (48-100 s with the cores shared); Flower's and
Ray's start-up dominate, the run itself is a few seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distmoe.model.build import SUPPORTED_FAMILIES
from distmoe.model.fabricate import write_checkpoint
from distmoe.simulate import SimOptions, processes_with_token, run

MINIMAL = {"schedule.phases": "stats:lookup, sft:lookup*1, eval, rl:lookup*1", "data.synth-examples": 32,
           "train.local-steps": 2, "train.batch-size": 4, "train.warmup-steps": 0, "data.max-eval-examples": 2,
           "eval.max-new-tokens": 2, "eval.batch-size": 4, "rl.steps": 1, "rl.prompts-per-step": 2,
           "rl.group-size": 2, "rl.max-new-tokens": 2, "model.max-seq-len": 64, "model.trainable": "lora"}


@pytest.mark.slow
@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_family_end_to_end_on_flower(family: str, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "outer-home"))  # nothing may land in the caller's home
    (tmp_path / "outer-home").mkdir()
    ckpt = write_checkpoint(family, tmp_path / f"ckpt-{family}")
    code, run_dir = run(SimOptions(overrides={**MINIMAL, "model.path": str(ckpt)}, parties=2,
                                   runs_dir=tmp_path / "runs", run_id=family, timeout=600, report=False, echo=False))
    log = (run_dir / "flower.log").read_text() if (run_dir / "flower.log").exists() else ""
    assert code == 0, f"simulate of {family} failed; log tail:\n{log[-4000:]}"
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["status"] == "completed" and rec["privacy"]["mode"] == "secagg"

    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events if e.get("party") == "all"]
    assert kinds == ["stats", "train", "eval", "rl"], kinds
    train = next(e for e in events if e["event"] == "train")
    assert train["parties"] == 2 and train["contributors"] == 2 and "anchor_kl" not in train  # uniform weights
    final = next(e for e in events if e["event"] == "eval")
    # DP-noised eval sums (noise std ~5 examples against 4 held-out examples here: the noisy count, clamped at 0,
    # may be 0); no routing metrics under secure aggregation
    assert final["n/lookup"] >= 0.0 and "acc/lookup" in final and "routing_kl" not in final
    rl = next(e for e in events if e["event"] == "rl")
    assert rl["parties"] == 2 and "route_disagree_l0" not in rl
    # training and RL metrics stay in each party's own log (docs/privacy.md §3)
    own = [json.loads(x) for p in ("party-0", "party-1")
           for x in (run_dir / "work" / p / "metrics" / f"{p}.jsonl").read_text().splitlines()]
    sft_own = [x for x in own if x["kind"] == "SftInstruction"]
    rl_own = [x for x in own if x["kind"] == "RlInstruction"]
    assert len(sft_own) == 2 and all(x["anchor_kl"] >= 0.0 for x in sft_own)
    assert len(rl_own) == 2 and all("route_disagree_l0" in x for x in rl_own)
    assert list((run_dir / "anchors").glob("round-*.npz"))

    sim = json.loads((run_dir / "simulate.json").read_text())
    assert processes_with_token(sim["token"], sim["session"], sim["ray_dir"]) == [] and sim["remaining"] == []
    assert not (tmp_path / "outer-home" / ".flwr").exists()
    assert "Traceback" not in log, log[-3000:]

    from distmoe.audit import audit_run

    result = audit_run(run_dir)
    assert result.verdict == "pass", [(c.name, c.findings) for c in result.checks if c.status == "fail"]
