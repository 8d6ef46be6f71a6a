"""The ``dpo`` phase: local DPO at every party on its preference pairs of the task, then the aggregated update,
exactly like an SFT update (``docs/algorithms.md``, DPO).

``configure`` sends the ``SftInstruction`` with ``objective = "dpo"``. The first round of a ``dpo`` phase begins
(``begin``) a new stage (``RoundState.begin_task``, even when the task is the one just tuned): the global model then
is kept as ``ref_weights``, which are the reference of the whole phase (``dpo.reference = phase``; sent with every
later round of the phase, and kept in the checkpoint for a resume) and the retention baseline of the next
evaluation. With ``dpo.reference = round`` no reference travels: each party's reference is the global model as
received. The anchor goes along as in ``sft`` (the party adds the anchor KL to its DPO loss). ``request`` and
``aggregate`` are ``sft``'s.

Must not: import ``flwr``, or see one party's update.
"""

from __future__ import annotations

from distmoe.config import Phase
from distmoe.coordinator.context import RunContext
from distmoe.coordinator.phases.sft import Sft
from distmoe.coordinator.state import RoundState, position
from distmoe.wire.schema import SftInstruction


class Dpo(Sft):
    kind = "dpo"

    def begin(self, co: RunContext, phase: Phase) -> RoundState:
        s = co.s
        stage = _phase_first(co) or phase.task != s.current_task or s.ref_weights is None
        return s.begin_task(phase.task) if stage else s

    def configure(self, co: RunContext, phase: Phase) -> SftInstruction:
        s, cfg = co.s, co.cfg
        use_anchor = s.anchor is not None and cfg.routing.anchor_kl_coef > 0
        # from the phase's second round (a stage begun later has ref = the model sent: the same reference)
        send_ref = cfg.dpo.reference == "phase" and not _phase_first(co)
        return SftInstruction(round=s.round, task=phase.task, weights=co.np_weights(s.weights),
                              base_hash=co.tspec.base_hash, seed=cfg.run.seed * 100_003 + s.round,
                              anchor=s.anchor.probs if use_anchor else None,
                              anchor_version=s.anchor.meta.version if use_anchor else 0, objective="dpo",
                              ref_weights=co.np_weights(s.ref_weights) if send_ref else None)


def _phase_first(co: RunContext) -> bool:
    """Round ``co.s.round`` is its phase's first."""
    return (position(co.cfg.schedule.phases, co.s.round) or {}).get("round_in_phase") == 1
