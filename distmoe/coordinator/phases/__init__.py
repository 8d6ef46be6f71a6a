"""One module per schedule phase, each written once against the ``Aggregator`` interface.

Each phase module has ``configure(co, phase) -> instruction`` (what every party is sent this round, in
the style of Flower strategies' ``configure_*``) and ``aggregate(co, index, phase, instr) -> str`` (ask the
aggregator for the round's sum, apply it to the global model or anchor, log it; returns the round's
progress line, like ``aggregate_*``). ``run_round`` dispatches on the phase kind; ``update.apply_update`` is the part
``sft``, ``rl`` and ``dpo`` share (``dpo`` sends an ``sft`` instruction with ``objective = "dpo"``).

Must not: branch on the privacy mode (the aggregator does), or import ``flwr``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distmoe.config import Phase
from distmoe.coordinator.phases import dpo, evaluate, rl, sft, stats

if TYPE_CHECKING:
    from distmoe.coordinator.loop import Coordinator

PHASES = {"sft": sft, "rl": rl, "stats": stats, "eval": evaluate, "dpo": dpo}


def run_round(co: Coordinator, index: int, phase: Phase) -> str:
    """One round of ``phase`` (the ``index``-th phase of the schedule): configure, then aggregate."""
    mod = PHASES[phase.kind]
    return mod.aggregate(co, index, phase, mod.configure(co, phase))
