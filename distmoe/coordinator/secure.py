"""The secure form of the ``Aggregator``: every reply of every phase is one secure sum.

Owns: for each phase, the public layout of the vector the parties mask (``distmoe.privacy.vectors``:
``UpdateLayout``, ``StatsLayout``; ``distmoe.privacy.metric_noise.EvalSpec``), the DP event of a release at
the survivors' count (``PrivacyEvent``: client-level Gaussian on updates when
``privacy.update-noise-multiplier`` > 0, distributed Skellam on router statistics and on every evaluation
release). Update releases carry the objective's training metrics as clipped, bounded slots of the same sum
(``distmoe.privacy.train_metrics``: decoded to means over the securely counted contributors, bound-checked, noised
with the update noise when it is on) and uniform weights (the weight sum is the number of contributing parties);
evaluation releases no routing metrics. The bound checks on the decoded sum
(``distmoe.aggregate``: a sum that no honest set of parties can produce is rejected, logged and not
applied), and the release entry in the ledger with its survivors, DP parameters and canaries: their values, the
seed of their positions with the public material it hashes (``dp.canary_seed`` over the round's U1 mask keys)
and a digest of the positions, for the audit to recompute. A router-statistics sum whose row sums disagree
less than the recorded noise implies (``dp.row_noise_test``, per release) is flagged (``info.row_noise``, a
warning); the audit tests it pooled over the run. The round
itself (setup, masked input, the privacy gate, unmasking) is ``distmoe.coordinator.secagg.SecureRounds``.

Must not: see any party's individual reply (only ``SecureRounds``' sums), or import ``flwr``.
"""

from __future__ import annotations

import math

import numpy as np

from distmoe.aggregate import aggregate_problem, stats_sum_problem
from distmoe.coordinator.aggregator import Aggregator, EvalSum, Skip, StatsSum, UpdateSum
from distmoe.coordinator.secagg import SecureRounds, SecureSum
from distmoe.privacy import train_metrics as TM
from distmoe.privacy.accountant import PrivacyEvent
from distmoe.privacy.dp import canary_seed, positions_digest, row_noise_test
from distmoe.privacy.plan import eval_spec, stats_event, stats_spec
from distmoe.privacy.update_noise import update_dp_facts, update_event
from distmoe.privacy.vectors import SKIPPED_MAX, StatsLayout, UpdateLayout

ROW_NOISE_ALPHA = 1e-6  # the per-release warning level of the row-sum noise test (the audit pools releases)


def _round_keys(sec: SecureRounds, rnd: int) -> tuple[bytes, tuple[tuple[int, bytes], ...]]:
    """The SecAgg run id and round ``rnd``'s U1 as ``(node id, s_pk)`` sorted by id: the public material every
    party's ``RoundStart`` listed (read from the server's round state, which keeps it until round ``rnd + 2``)."""
    srv = sec.server
    return srv.params.run_id, srv.round_keys(rnd)


class SecureAggregator(Aggregator):
    def __init__(self, co, transport, guard, rounds: SecureRounds):
        super().__init__(co, transport, guard)
        self.rounds = rounds

    def _log(self, res: SecureSum, phase: str, release: str, dp: dict | None, problem: str | None, **info) -> None:
        self.guard.log_release(rnd=self.co.s.round, phase=phase, release=release, total=res.total, dp=dp,
                                  info={"mode": "secagg", "release": release, "included": list(res.included),
                                        "dropped": list(res.dropped), "responders": list(res.responders), **info,
                                        "applied": problem is None, **({"rejected": problem} if problem else {})},
                                  verdict="accepted" if problem is None else f"rejected: {problem}")
        if problem is not None:
            what = {"router-stats": "router statistics", "eval": "evaluation numbers"}.get(release, release)
            self.co.say(f"round {self.co.s.round}: the secure sum of {what} is rejected: {problem}")

    def updates(self, instr, kind, release, event):
        co, p, sec = self.co, self.co.cfg.privacy, self.rounds
        n, t = len(sec.roster), sec.threshold
        z_u = sec.plan.update_noise_multiplier
        layout, slots = TM.release_layout(
            UpdateLayout.build(co.tspec.shapes, n, p.update_clip, private=z_u > 0, noise_multiplier=z_u,
                               threshold=t, ring=p.ring_bits),
            TM.objective_of(kind, getattr(instr, "objective", None)), p.metric_loss_bound, p.update_metric_share)

        def event_at(n_active: int) -> PrivacyEvent:  # n_active >= t survivors, per sequence (z_u/2 at t)
            return update_event(z_u, n_active, t, f"{release} round {co.s.round}")

        res = sec.round(co.s.round, kind, instr, release, layout.length, event_at if z_u > 0 else None,
                        bits=layout.bits)
        if res is None:
            return Skip("no secure sum this round: model unchanged")
        avg, weight = layout.decode(res.total)
        problem = aggregate_problem(layout, avg, weight, len(res.included), z_u, t)
        skipped = layout.decode_skipped(res.total)  # the one stability count (None with update noise)
        if problem is None and skipped is not None and not 0 <= skipped <= len(res.included) * SKIPPED_MAX:
            problem = f"skipped-step count {skipped:.6g} outside [0, {len(res.included)} x {SKIPPED_MAX}]"
        sigma = TM.noise_std(layout, z_u, res.n_active, t)  # the update noise on each metric word (0 without)
        means, stds, slot_problem = TM.decode(res.total, layout, slots, res.contributors, len(res.included), sigma)
        problem = problem or slot_problem  # a slot no honest contributors can produce: the sum is not applied
        dp = None
        if z_u > 0:
            dp = update_dp_facts(layout, z_u, n, t, res.n_active)
        self._log(res, kind, release, dp, problem, weight_sum=weight, frac_bits=layout.frac_bits,
                  ring_bits=layout.bits, contributors=res.contributors,
                  metric_slots=[[s.key, s.lo, s.hi] for s in slots])
        if problem is not None:
            return Skip(f"aggregate rejected ({problem}): model unchanged")
        if avg is None:
            return Skip(f"{len(res.included)} parties, total weight 0 (no data for task {instr.task!r}): model "
                        "unchanged", failed=False)
        metrics = {} if skipped is None else {"skipped_steps": skipped}
        metrics.update(means)  # the training-metric slots: means over the contributors (noised with update noise)
        return UpdateSum(avg, metrics, int(round(weight)), len(res.included), n, noise=stds)

    def router_stats(self, instr, shape, label):
        p, sec, rnd = self.co.cfg.privacy, self.rounds, self.co.s.round
        n, t = len(sec.roster), sec.threshold
        spec = stats_spec(p, sec.plan.noise_multiplier, shape[0], shape[1], n, t)
        layout = StatsLayout(spec)

        def event_at(n_active: int) -> PrivacyEvent:
            return stats_event(spec, n_active, f"router-stats round {rnd}")

        res = sec.round(rnd, "stats", instr, "router-stats", layout.length, event_at)
        if res is None:
            return Skip("no secure sum this round: anchor unchanged")
        run_key, u1 = _round_keys(sec, rnd)
        seed = canary_seed(run_key, rnd, u1)
        layout = StatsLayout(spec, seed)
        noisy, canaries = layout.decode(res.total)  # [L, E] sequence units, [K] integer units
        ints = layout.decode_ints(res.total)[:spec.dim].reshape(shape)  # [L, E]
        dp = spec.dp_params(res.n_active)
        sigma = spec.aggregate_sigma(res.n_active)
        problem = stats_sum_problem(ints, spec.scale, res.n_active, p.num_sequences_max, sigma)
        rows = [int(v) for v in ints.sum(1)]  # [L]
        canary = {"k": int(spec.n_canaries), "values": [int(v) for v in canaries], "seed": seed.hex(),
                  "secagg_run": run_key.hex(), "u1": [[int(c), k.hex()] for c, k in u1],
                  "positions_sha256": positions_digest(layout.canary_positions)}
        extra = {}
        if shape[0] > 1:
            rt = row_noise_test([(rows, math.sqrt(shape[1]) * sigma)], ROW_NOISE_ALPHA)
            extra["row_noise"] = {"stat": rt.statistic, "dof": rt.dof, "p_low": rt.p_low, "flag": not rt.passed}
            if not rt.passed:
                self.co.say(f"round {rnd}: WARNING: the router-statistics rows disagree less than the recorded noise "
                            f"implies (variance ratio {rt.ratio:.3g}, p = {rt.p_low:.3g}): a party's noise share may "
                            "be missing from the statistic (the audit's row-noise check decides)")
        self._log(res, "stats", "router-stats", dp, problem, layers=shape[0], experts=shape[1], canary=canary,
                  row_sums=rows, **extra)
        if problem is not None:  # the privacy cost is spent (the sum was unmasked), the anchor stays
            return Skip(f"aggregate rejected ({problem}): anchor unchanged")
        worst = max((max(v["prv"], v["rdp"]) for v in sec.epsilon().values()), default=0.0)
        return StatsSum(np.asarray(noisy), len(res.included), n,
                        f"DP z_eff {dp['z_eff']:.2f}, epsilon spent <= {worst:.3f} of {p.epsilon:g}")

    def evaluation(self, instr, tasks):
        co, sec, rnd = self.co, self.rounds, self.co.s.round
        n, t = len(sec.roster), sec.threshold
        spec = eval_spec(co.cfg.privacy, co.cfg.data.max_eval_examples, tuple(tasks), n, t)

        def event_at(n_active: int) -> PrivacyEvent:
            return spec.event(n_active, f"eval round {rnd}")

        res = sec.round(rnd, "eval", instr, "eval", spec.length, event_at)
        if res is None:
            return Skip("no secure sum this round: no evaluation")
        problem = spec.problem(res.total, len(res.included))
        self._log(res, "eval", "eval", spec.dp_params(res.n_active), problem, tasks=list(tasks))
        if problem is not None:
            return Skip(f"aggregate rejected ({problem}): no evaluation")
        sd = spec.aggregate_sigma(len(sec.roster)) / spec.scale  # noise of each sum, in examples (full roster)
        if (co.record.get("privacy") or {}).get("eval_noise_sd") != sd:  # the report's noise scales derive from it
            co.record.update(privacy={**(co.record.get("privacy") or {}), "eval_noise_sd": sd})
        return EvalSum({"all": with_noise_scale(spec, spec.decode(res.total), res.n_active)}, len(res.included),
                       len(sec.roster))


def with_noise_scale(spec, decoded: dict[str, float], n_active: int) -> dict[str, float]:
    """``decoded`` plus each figure's noise scale (one standard deviation, first-order in the noisy sums):
    ``acc_sd/<t>`` and ``loss_sd/<t>``. Each of a task's three sums carries Skellam noise of ``sigma`` ring
    units, i.e. ``sigma / s`` examples; a ratio ``r = a / n`` of two noisy sums then has
    ``sd(r) ~= (sigma / s) * sqrt(1 + r^2) / n`` (the loss in units of its bound ``B``)."""
    sd = spec.aggregate_sigma(n_active) / spec.scale
    out = dict(decoded)
    for t in spec.tasks:
        n = decoded.get(f"n/{t}", 0.0)
        acc, loss = decoded.get(f"acc/{t}", math.nan), decoded.get(f"loss/{t}", math.nan)
        ok = n >= 0.5 and math.isfinite(acc)
        out[f"acc_sd/{t}"] = sd * math.sqrt(1 + acc * acc) / n if ok else math.nan
        r = loss / spec.loss_bound if math.isfinite(loss) else 0.0
        out[f"loss_sd/{t}"] = spec.loss_bound * sd * math.sqrt(1 + r * r) / n if ok else math.nan
    return out
