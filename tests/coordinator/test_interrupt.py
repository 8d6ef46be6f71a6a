"""A stop signal while the run goes on in another thread (Flower's Simulation Engine runs the ServerApp in a
worker thread; the signal reaches Flower's handler in the main thread, which calls ``Coordinator.interrupt``).

The ledger must end with ``run-end`` (status ``interrupted``), the run thread must not write after it nor turn
the record into ``failed``, and the run stays resumable.
"""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest

from distmoe.audit import audit_run
from distmoe.coordinator import check_resumable

pytestmark = pytest.mark.integration


def test_interrupt_from_another_thread_closes_the_ledger_once(tmp_path, make_run):
    coord, _, run_dir, _, lines = make_run(tmp_path, {"schedule.phases": "sft:arith*2, eval"})
    real = coord.play_round

    def play_round(index, phase):
        if coord.s.round == 1:  # a signal arrives mid-run: handled on another thread, as Flower does
            t = threading.Thread(target=coord.interrupt, args=("stopped by SIGTERM (test)",))
            t.start()
            t.join()
        return real(index, phase)

    coord.play_round = play_round
    with pytest.raises(Exception) as info:
        coord.run()
    assert "sealed" in str(info.value)  # the run thread's next ledger write was refused
    entries = [json.loads(x) for x in (run_dir / "ledger" / "coordinator.jsonl").read_text().splitlines()]
    ends = [e for e in entries if e["phase"] == "run-end"]
    assert len(ends) == 1 and entries[-1]["phase"] == "run-end"
    assert ends[0]["info"]["status"] == "interrupted"
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["status"] == "interrupted" and "SIGTERM" in rec["error"]  # not overwritten as "failed"
    assert any("INTERRUPTED" in line for line in lines)
    assert audit_run(run_dir).check("run-end").status == "pass"
    coord.interrupt("a second signal")  # idempotent: nothing more is written
    assert len((run_dir / "ledger" / "coordinator.jsonl").read_text().splitlines()) == len(entries)
    resumed = dataclasses.replace(coord.cfg, run=dataclasses.replace(coord.cfg.run, resume=str(run_dir)))
    assert check_resumable(run_dir, resumed)["status"] == "interrupted"
