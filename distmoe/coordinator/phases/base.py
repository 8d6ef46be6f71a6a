"""The shape of a schedule phase, in the style of a Flower strategy: ``configure`` then ``aggregate``.

Owns: ``PhaseStep``, the interface every phase of ``distmoe.coordinator.phases`` implements:

- ``configure(ctx, phase) -> instruction``: what every party is sent this round (Flower's ``configure_train``);
  it may begin a task in the round state (``RoundState.begin_task``) or, for ``sft``, grow the model first.
- ``request(ctx, index, phase, instr) -> SumRequest``: which sum the round asks the aggregator for
  (``distmoe.coordinator.aggregator.SumRequest``: update, router statistics or evaluation), with the release name
  and the round's ``metrics.jsonl`` fields.
- ``aggregate(ctx, index, phase, instr, out) -> str``: fold the released sum into the round state (global weights,
  anchor, last evaluation) and record it; returns the round's progress line (Flower's ``aggregate_train``).

A step never sees a transport, an aggregator or a ``Skip``: the round loop (``coordinator/loop.py``) does the one
exchange between ``configure`` and ``aggregate``, and records a round that released nothing itself. So a phase can
be tested with a hand-made sum (``tests/coordinator/phases``).

Must not: import ``flwr``, branch on the privacy mode (the aggregator does), or talk to a party.
"""

from __future__ import annotations

import abc

from distmoe.config import Phase
from distmoe.coordinator.aggregator import SumRequest
from distmoe.coordinator.context import RunContext


class PhaseStep(abc.ABC):
    """One schedule phase kind (module docstring). ``updates_model``: a released sum changes the global weights
    (the loop then settles the routing bias before the round's checkpoint)."""

    kind: str = ""
    updates_model: bool = False

    @abc.abstractmethod
    def configure(self, ctx: RunContext, phase: Phase) -> object:
        """This round's instruction to every party."""

    @abc.abstractmethod
    def request(self, ctx: RunContext, index: int, phase: Phase, instr: object) -> SumRequest:
        """The sum this round asks for."""

    @abc.abstractmethod
    def aggregate(self, ctx: RunContext, index: int, phase: Phase, instr: object, out: object) -> str:
        """Fold the released sum ``out`` into the round state; the round's progress line."""
