"""The shape of a schedule phase, in the style of a Flower strategy: ``configure`` then ``aggregate``.

Owns: ``PhaseStep``, the interface every phase of ``distmoe.coordinator.phases`` implements. The round state
(``distmoe.coordinator.state.RoundState``) is immutable: a step that changes it returns a new one, and the loop
makes it ``ctx.s``.

- ``begin(ctx, phase) -> RoundState``: the state the round starts from (default: ``ctx.s``); a new task begins
  here (``RoundState.begin_task``: the model and evaluation before it kept), and for ``sft`` the model may grow
  (``keeps_weights`` says beforehand whether the round sends the global weights as they are).
- ``configure(ctx, phase) -> instruction``: what every party is sent this round (Flower's ``configure_train``),
  read from ``ctx.s``; it changes nothing.
- ``request(ctx, index, phase, instr) -> SumRequest``: which sum the round asks the aggregator for
  (``distmoe.coordinator.aggregator.SumRequest``: update, router statistics or evaluation), with the release name
  and the round's ``metrics.jsonl`` fields.
- ``aggregate(ctx, index, phase, instr, out) -> (RoundState, str)``: the new round state with the released sum
  folded in (global weights, anchor, last evaluation), recorded, and the round's progress line (Flower's
  ``aggregate_train``); ``ctx.s`` is left as it was.

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
from distmoe.coordinator.state import RoundState


class PhaseStep(abc.ABC):
    """One schedule phase kind (module docstring). ``updates_model``: a released sum changes the global weights
    (the loop then settles the routing bias before the round's checkpoint)."""

    kind: str = ""
    updates_model: bool = False

    def begin(self, ctx: RunContext, phase: Phase) -> RoundState:
        """The round state this round starts from (a phase that begins a task overrides it)."""
        return ctx.s

    def keeps_weights(self, ctx: RunContext, phase: Phase) -> bool:
        """Whether a round of ``phase`` starting from ``ctx.s`` sends the global weights as they are (then it can
        carry the routing probe of the round before: ``phases/probe.py``); a ``begin`` that changes them says no."""
        return True

    @abc.abstractmethod
    def configure(self, ctx: RunContext, phase: Phase) -> object:
        """This round's instruction to every party, from ``ctx.s`` (which it leaves as it is)."""

    @abc.abstractmethod
    def request(self, ctx: RunContext, index: int, phase: Phase, instr: object) -> SumRequest:
        """The sum this round asks for."""

    @abc.abstractmethod
    def aggregate(self, ctx: RunContext, index: int, phase: Phase, instr: object, out: object
                  ) -> tuple[RoundState, str]:
        """The new round state with the released sum ``out`` folded in, and the round's progress line."""
