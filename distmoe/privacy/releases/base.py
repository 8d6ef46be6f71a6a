"""What a release yields to the coordinator, and the public facts both sides build a release from.

Owns: the sums a round releases (``UpdateSum``: the mean model update and its training-metric slots; ``StatsSum``:
the summed ``[L, E]`` router statistics; ``EvalSum``: the evaluation aggregate), ``Skip`` (a round that released
nothing, with its line and whether it counts as a failed round for ``federation.on-round-failure``), ``Opened``
(a secure sum decoded and checked: the sum or ``Skip``, the ledger entry's DP facts and info, and what the
coordinator prints or records besides), and ``ServerFacts`` (the public facts the coordinator opens a release
with). The plaintext baseline (``distmoe.coordinator.aggregator``) yields the same sums.

Must not: import torch or ``flwr``, hold a party's reply, or draw noise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Skip:
    """Nothing was released this round; ``text`` is the round's line, ``failed`` makes it a failed round."""

    text: str
    failed: bool = True


@dataclass
class UpdateSum:
    delta: dict[str, np.ndarray]  # name -> [*shape] float32: the weighted mean update to add
    metrics: dict[str, float]  # aggregate training metrics (secagg: the training-metric slots' means only)
    num_examples: int  # the summed weight: examples in plaintext, contributing parties under secagg
    parties: int  # parties included in the sum
    nodes: int  # parties asked
    noise: dict[str, float] = field(default_factory=dict)  # noise std of each noised metric mean (update noise)
    uniform: bool = False  # a secure release: weight 1 per contributor, metrics = the released slots' means


@dataclass
class StatsSum:
    total: np.ndarray  # [L, E] summed per-sequence routing frequencies (noised under secagg)
    parties: int
    nodes: int
    note: str  # the DP line for the progress output


@dataclass
class EvalSum:
    per_party: dict[str, dict[str, float]] = field(default_factory=dict)  # "all" plus, in plaintext, each party
    parties: int = 0
    nodes: int = 0


@dataclass
class Opened:
    """A secure sum decoded and bound-checked. ``result``: the sum, or ``Skip``; ``dp`` / ``info``: the release's
    ledger entry (``problem``: why the sum is rejected, None when applied); ``warnings``: lines to print;
    ``privacy``: fields for ``run.json`` ``privacy``."""

    result: UpdateSum | StatsSum | EvalSum | Skip
    dp: dict | None
    problem: str | None
    info: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    privacy: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Prepared:
    """The coordinator's view of one round's release: the vector's ``length`` and ring ``Z_2^bits``, the DP event
    at ``n_active`` survivors (None: not a DP release), and ``open(secure_sum) -> Opened``."""

    length: int
    bits: int
    event_at: Callable[[int], object] | None
    open: Callable[[object], Opened]


@dataclass(frozen=True)
class ServerFacts:
    """The public facts the coordinator opens a round's release with: the run's privacy and data settings, the
    noise plan, the roster size ``n`` and threshold ``t``, the round, the model's trainable shapes and routing
    shape, the round's SecAgg key material (``round_keys() -> (secagg run id, U1)``) and the epsilon spent so far
    (``epsilon() -> {party: {"prv": .., "rdp": ..}}``)."""

    privacy: object  # distmoe.config.PrivacyConfig
    max_eval_examples: int
    plan: object  # distmoe.privacy.plan.PrivacyPlan
    n: int
    t: int
    rnd: int
    shapes: tuple = ()
    layers: int = 0
    experts: int = 0
    round_keys: Callable[[], tuple[bytes, tuple]] | None = None
    epsilon: Callable[[], dict] | None = None
