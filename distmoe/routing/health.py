"""Routing health during a run: warnings from the per-round probe metrics (``distmoe.routing.probe``).

Two signals, each warned once when it starts (and again only after it has cleared: for the load CV, fallen below
``CV_REARM`` of the threshold, so a CV oscillating around the threshold warns once):

- **load imbalance**: ``load_cv > routing.load-cv-warn`` (top-1 load CV, ``distmoe.routing.metrics.load_cv``).
  The default 1.0 is where about half the experts go unused: with ``E`` experts of which ``E/2`` get equal load
  and ``E/2`` none, ``std / mean = 1``; the maximum, all load on one expert, is ``sqrt(E - 1)``; DistMoE cites
  ``< 0.2`` as healthy;
- **routing drift**: routing KL to the anchor rose in ``routing.kl-rise-rounds`` consecutive probes against the
  same anchor version (a new anchor restarts the count) **and** is now above its level at the first probe against
  that anchor — the opposite of DistMoE's "routing KL stays flat over rounds". That first level (``kl_ref``) is the
  KL of the model the anchor was built from (a ``stats`` round does not change the model, and its own probe comes
  first): the part no training can remove, as the public probe prompts are not the parties' data and the anchor
  carries the DP noise of its statistics. A rise below it is routing still closer to the anchor than its own source,
  not drift: on the default run the KL falls from 0.013-0.016 at the anchor's round to 0.0016-0.0036 after the
  first round of the next task and climbs back, at most to 0.0068 in three runs, once three probes in a row (a count
  of rises alone warned there); without the anchor term it passes the level (``docs/operations.md``, Routing
  health). After a resume, the first probe against the anchor then sets the level.

Must not: run models, or see anything but the aggregate probe metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

CV_REARM = 0.8  # the load-CV warning re-arms once the CV fell below this fraction of routing.load-cv-warn


@dataclass
class RoutingWatch:
    load_cv_warn: float  # 0 = off
    kl_rise_rounds: int  # 0 = off
    balance: str = "aux"  # routing.balance: which advice the load-CV warning gives
    cv_high: bool = False
    kl_prev: float = math.nan
    kl_start: float = math.nan
    kl_ref: float = math.nan  # the first probe's KL against the current anchor: the model the anchor was built from
    ref_round: int = 0
    rises: int = 0
    kl_warned: bool = False  # this run of rises has been warned
    anchor_version: int = -1
    history: list[tuple[int, str]] = field(default_factory=list)  # (round, kind) of every warning

    def observe(self, rnd: int, load_cv: float, routing_kl: float, anchor_version: int) -> list[tuple[str, str]]:
        """The warnings of one probe, as ``(kind, text)`` with kind ``load_cv`` or ``kl_rise``."""
        out: list[tuple[str, str]] = []
        if self.load_cv_warn > 0 and math.isfinite(load_cv):
            if load_cv > self.load_cv_warn and not self.cv_high:
                out.append(("load_cv", f"round {rnd}: routing load CV {load_cv:.3f} on the probe set exceeds "
                                       f"routing.load-cv-warn = {self.load_cv_warn:g} (experts unevenly used; "
                                       f"healthy < 0.2). {self.load_cv_advice()}"))
            # hysteresis: a CV oscillating around the threshold warns once, not at every crossing
            self.cv_high = load_cv > self.load_cv_warn or (self.cv_high and load_cv > CV_REARM * self.load_cv_warn)
        if anchor_version != self.anchor_version:  # a new anchor: KL is measured against something else now
            self.anchor_version, self.kl_prev, self.kl_ref, self.rises = anchor_version, math.nan, math.nan, 0
        if self.kl_rise_rounds > 0 and math.isfinite(routing_kl):
            if not math.isfinite(self.kl_ref):
                self.kl_ref, self.ref_round = routing_kl, rnd
            if math.isfinite(self.kl_prev) and routing_kl > self.kl_prev:
                self.rises += 1
            else:
                self.rises, self.kl_start, self.kl_warned = 0, routing_kl, False
            if self.rises >= self.kl_rise_rounds and routing_kl > self.kl_ref and not self.kl_warned:
                self.kl_warned = True
                out.append(("kl_rise", f"round {rnd}: routing KL to anchor v{anchor_version} rose for "
                                       f"{self.rises} consecutive rounds ({self.kl_start:.4f} -> {routing_kl:.4f}; "
                                       f"routing.kl-rise-rounds = {self.kl_rise_rounds}) above its "
                                       f"{self.kl_ref:.4f} at round {self.ref_round}, when the anchor was built: "
                                       "routing is drifting from the anchor. To hold it closer: a larger "
                                       "routing.anchor-kl-coef (0 = off: routing.kl-rise-rounds)"))
            self.kl_prev = routing_kl
        self.history += [(rnd, kind) for kind, _ in out]
        return out

    def load_cv_advice(self) -> str:
        """What the user can do about a high load CV, given ``routing.balance``: the tiny default model starts
        near CV 1 and the aux loss alone keeps it there; the routing bias of ``configs/continual-balanced.toml``
        brings it to about 0.2 (``docs/results.md``, How balanced are the experts)."""
        if "bias" in self.balance:
            act = "a larger routing.balance-rate evens it faster"
        else:
            act = "to even it: the routing bias of configs/continual-balanced.toml (docs/results.md)"
        return f"{act[0].upper()}{act[1:]}; to silence this: routing.load-cv-warn = 0"
