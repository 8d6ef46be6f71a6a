"""A phase defined here, in the test, runs a whole secure round: adding a phase that reuses a release is one
``PhaseStep`` (``configure``, ``request``, ``aggregate``) and its entry in ``PHASES`` (plus its kind in the
schedule grammar, ``distmoe/config/schedule.py``, for a kind of its own), with no privacy code: the secure sum,
its DP and bound checks and the party's encoding come from the release table (``distmoe.privacy.releases``).

Here the step replaces ``sft`` for one run (so the schedule grammar is unchanged): it asks for the same
``model-update`` release and applies half of the released mean update.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distmoe.audit.engine import audit_run
from distmoe.coordinator.phases import PHASES, Sft
from distmoe.coordinator.phases.update import contributors

pytestmark = pytest.mark.integration  # a whole in-process run (three parties, LocalTransport)


class HalfStep(Sft):
    """Local SFT everywhere (``sft``'s instruction and release), then half the released mean update."""

    seen: list = []

    def aggregate(self, ctx, index, phase, instr, out):
        before = ctx.s.weights
        self.seen.append((before, {k: np.array(d) for k, d in out.delta.items()}, out))
        new = ctx.s.with_weights({k: before[k] + 0.5 * torch.from_numpy(d) for k, d in out.delta.items()})
        return new, contributors(out) + " | half step"


def test_a_phase_defined_in_a_test_runs_a_secure_round(make_run, tmp_path, monkeypatch, releases, failed_checks):
    monkeypatch.setitem(PHASES, "sft", HalfStep())
    coord, _, run_dir, _, lines = make_run(tmp_path, {"schedule.phases": "sft:arith, eval"})
    assert coord.run()["status"] == "completed"
    [(before, delta, out)] = HalfStep.seen
    assert out.parties == 3 and set(delta) == set(before)
    for k, d in delta.items():  # exactly half the released mean moved the global model
        torch.testing.assert_close(coord.s.weights[k], before[k] + 0.5 * torch.from_numpy(d))
    [rel] = releases(run_dir, "model-update")
    assert rel["info"]["applied"] and sorted(rel["info"]["included"]) == ["party-0", "party-1", "party-2"]
    assert any("half step" in line for line in lines)
    assert failed_checks(audit_run(run_dir)) == set()  # the ledgers of the new phase pass the audit as they are
