"""One module per schedule phase, each a ``PhaseStep`` (``phases/base.py``) written once against the sums of the
``Aggregator`` interface.

Each step has ``begin(ctx, phase) -> RoundState`` (the state the round starts from: a new task begins there),
``configure(ctx, phase) -> instruction`` (what every party is sent this round, like Flower strategies'
``configure_*``), ``request`` (which sum the round asks for) and ``aggregate(ctx, index, phase, instr, sum) ->
(RoundState, str)`` (a new round state with the released sum folded into the global model or anchor, logged, and the
round's progress line, like ``aggregate_*``); the round state is immutable and the loop threads it. ``PHASES`` maps
a phase kind to its step; the round loop (``coordinator/loop.py``) does the exchange between the two.
``update.apply_update`` is the part ``sft``, ``rl`` and ``dpo`` share (``dpo`` sends an ``sft`` instruction with
``objective = "dpo"``). ``probe`` and ``settle`` are not schedule phases but exchanges the loop runs after a round
(public inputs only): ``instruction`` then ``apply``, which returns the round state too.

Must not: branch on the privacy mode (the aggregator does), talk to a party, or import ``flwr``.
"""

from __future__ import annotations

from distmoe.coordinator.phases.base import PhaseStep
from distmoe.coordinator.phases.dpo import Dpo
from distmoe.coordinator.phases.evaluate import Evaluate
from distmoe.coordinator.phases.rl import Rl
from distmoe.coordinator.phases.sft import Sft
from distmoe.coordinator.phases.stats import Stats

PHASES: dict[str, PhaseStep] = {step.kind: step for step in (Sft(), Rl(), Stats(), Evaluate(), Dpo())}
