"""The ``stats`` phase: aggregated router statistics become a new version of the router anchor.

The anchor is the per-layer routing distribution of the summed statistics
(``distmoe.routing.anchor.build_anchor``: ``probs[l, e] = max(total[l, e], 0) / sum_e max(total[l, e], 0)``,
``total: [L, E]``), versioned and saved under ``anchors/`` with the checkpoint hash it was measured on.

Must not: import ``flwr``, or see one party's statistics.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from distmoe.config import Phase
from distmoe.coordinator.aggregator import StatsSum, SumRequest
from distmoe.coordinator.context import RunContext
from distmoe.coordinator.phases.base import PhaseStep
from distmoe.coordinator.state import RoundState
from distmoe.model.build import hash_tensors
from distmoe.routing.anchor import AnchorVersion, build_anchor, save_anchor
from distmoe.wire.schema import StatsInstruction


class Stats(PhaseStep):
    kind = "stats"

    def configure(self, co: RunContext, phase: Phase) -> StatsInstruction:
        return StatsInstruction(round=co.s.round, task=phase.task or "", weights=co.np_weights(co.s.weights),
                                base_hash=co.tspec.base_hash)

    def request(self, co: RunContext, index: int, phase: Phase, instr: StatsInstruction) -> SumRequest:
        return SumRequest("stats", "stats", "router-stats", phase.label())

    def aggregate(self, co: RunContext, index: int, phase: Phase, instr: StatsInstruction, out: StatsSum
                  ) -> tuple[RoundState, str]:
        s = co.s
        total = out.total  # [L, E]
        n_seq = float(total.sum(1).mean())
        if n_seq <= 0 or np.any(np.clip(total, 0, None).sum(1) <= 0):
            return s, co.round_failed("router statistics are empty (or all noise): anchor unchanged", failed=False)
        meta = AnchorVersion(version=s.anchor_versions + 1, round=s.round, source_checkpoint=hash_tensors(s.weights),
                             router_spec=co.mspec.router_spec(), num_sequences=n_seq, task=phase.task)
        anchor = build_anchor(total, meta)
        # the task's own anchor, for per-task anchors and expert protection (coordinator/retention.py)
        task_anchors = {**s.task_anchors, phase.task: anchor} if phase.task else s.task_anchors
        save_anchor(anchor, co.files.anchors)
        co.metrics.append({"event": "stats", "round": s.round, "party": "all", "task": phase.task,
                           "anchor_version": meta.version, "num_sequences": n_seq, "parties": out.parties})
        ent = float(-(anchor.probs * np.log(np.clip(anchor.probs, 1e-9, None))).sum(1).mean())
        new = replace(s, anchor=anchor, anchor_versions=meta.version, task_anchors=task_anchors)
        return new, (f"{out.parties}/{out.nodes} parties | anchor v{meta.version}, ~{n_seq:.0f} sequences "
                f"| routing entropy {ent:.3f} nats | {out.note}")
