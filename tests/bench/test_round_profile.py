"""``bench/round_profile.py``'s reading of a real run's ledgers (``--ledger``): each message stage's span at the
coordinator and, for its slowest party, the wait for the message, the work and the way back, on ledgers laid out
as ``distmoe simulate`` writes them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "bench" / "round_profile.py"
_spec = importlib.util.spec_from_file_location("round_profile_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _write(path: Path, entries: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))


def test_stage_spans_and_the_slowest_partys_share_from_the_ledgers(tmp_path, capsys):
    run = tmp_path / "run"
    c = lambda t, d, p, peer: {"round": 1, "time": t, "direction": d, "payload_type": p, "peer": peer}  # noqa: E731
    _write(run / "ledger" / "coordinator.jsonl", [
        c(10.0, "out", "sft-instruction", "a"), c(10.1, "out", "sft-instruction", "b"),
        c(16.0, "in", "masked-input:model-update", "a"), c(16.2, "in", "masked-input:model-update", "b"),
        c(16.3, "out", "consistency-request", "a"), c(16.3, "out", "consistency-request", "b"),
        c(16.5, "in", "consistency-response", "a"), c(16.5, "in", "consistency-response", "b"),
        c(16.6, "in", "release:model-update", "all")])
    p = lambda s, t, d, kind: {"round": 1, "seq": s, "time": t, "direction": d, "payload_type": kind}  # noqa: E731
    _write(run / "work" / "a" / "ledger" / "a.jsonl", [
        p(0, 10.5, "in", "sft-instruction"), p(1, 15.0, "out", "masked-input:model-update"),
        p(2, 16.35, "in", "consistency-request"), p(3, 16.36, "out", "consistency-response")])
    _write(run / "work" / "b" / "ledger" / "b.jsonl", [
        p(0, 12.0, "in", "sft-instruction"), p(1, 16.1, "out", "masked-input:model-update"),
        p(2, 16.40, "in", "consistency-request"), p(3, 16.41, "out", "consistency-response")])
    bench.ledger_stages(run)
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("round 1:")][0]
    # the sft stage: 10.0 -> 16.2; its slowest party is b (2.0 s to reach it + 4.1 s work), back 16.2 - 16.1
    assert "sft-instruction 6.200 (coord nan, to party 2.000, work 4.100, back 0.100)" in line
    # the consistency stage: 0.1 s of coordinator time after the last masked input; b again the slowest
    assert "consistency-request 0.200 (coord 0.100, to party 0.100, work 0.010, back 0.090)" in line
    assert line.endswith("release at +6.600")
