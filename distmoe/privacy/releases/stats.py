"""The ``router-stats`` release: one party's per-sequence routing frequencies ``[L, E]`` with planted canaries and
its distributed Skellam noise share, masked into one secure sum.

Owns, for both sides:
- the spec (``spec``: scale, per-sequence bound, noise, canaries, for ``n`` parties and threshold ``t``; the one
  place both sides build it), the DP event of a release (``event``) and the layout
  (``StatsLayout``, its canary positions drawn from the round's U1 mask keys: ``dp.canary_seed``, so no single
  party or the server picks them);
- the party's encoding (``encode``: charged at ``t`` survivors, where ``z_eff(t) = z``, before the vector with
  its Skellam share is built);
- the coordinator's opening (``prepare``): the DP event at ``n_active`` survivors, the decoding to noisy sequence
  counts and the canary values, the bound check (``distmoe.aggregate.stats_sum_problem``), the row-sum noise test
  (``dp.row_noise_test``: rows that disagree less than the recorded noise implies are flagged, a warning; the audit
  pools the test over the run), and the ledger entry with the canaries' values, the seed of their positions with
  the public material it hashes and a digest of the positions, for the audit to recompute.

Must not: import torch or ``flwr``, or see one party's statistics on the coordinator's side (only the sum).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from distmoe.aggregate import stats_sum_problem
from distmoe.config import PrivacyConfig
from distmoe.privacy.accountant import PrivacyEvent
from distmoe.privacy.dp import SkellamSpec, canary_seed, positions_digest, row_noise_test
from distmoe.privacy.releases.base import Opened, Prepared, ServerFacts, Skip, StatsSum
from distmoe.privacy.vectors import StatsLayout

UNCHANGED = "anchor unchanged"
ROW_NOISE_ALPHA = 1e-6  # the per-release warning level of the row-sum noise test (the audit pools releases)


# ------------------------------------------------------------------------------------------------------ both sides
def spec(p: PrivacyConfig, noise_multiplier: float, layers: int, experts: int, n_parties: int,
         threshold: int) -> SkellamSpec:
    """The calibration of one router-statistics release of ``[layers, experts]`` (over-provisioned for ``n - t``
    dropouts), checked to fit Z_2^64 (``WrapError`` names the bound otherwise)."""
    if noise_multiplier <= 0:
        raise ValueError("router statistics need a noise multiplier > 0")
    out = SkellamSpec(layers=layers, experts=experts, noise_multiplier=noise_multiplier, n_parties=n_parties,
                      num_sequences_max=p.num_sequences_max, scale=p.scale, n_canaries=p.noise_canaries,
                      max_dropouts=n_parties - threshold, rounding="mass-preserving")
    out.check_fits_ring64()  # every secure sum lives in Z_2^64
    return out


def event(spec: SkellamSpec, n_active: int, label: str) -> PrivacyEvent:
    """The ledger event of one router-statistics release summed over ``n_active`` survivors."""
    return PrivacyEvent(spec.effective_noise_multiplier(n_active), 1.0, 1, "skellam", label, d2=spec.delta2_int,
                        d1=spec.delta1_int)


# ---------------------------------------------------------------------------------------------- the party's side
def encode(spec: SkellamSpec, per_seq: np.ndarray, seed: bytes, charge: Callable[[PrivacyEvent], float], t: int,
           rnd: int, budget: float) -> tuple[np.ndarray, dict, bool]:
    """``(vector [D] uint64 with the Skellam share, the ledger's DP facts, contributed)`` of ``per_seq``
    ``[N, L, E]``, charged at the fewest survivors a completed round can have (``t``) before it is built."""
    contributed = per_seq.shape[0] > 0
    eps = charge(event(spec, t, f"router-stats round {rnd}"))
    vec = StatsLayout(spec, seed).encode(per_seq)  # [D] uint64, Skellam share included
    return vec, {**spec.dp_params(n_active=t), "epsilon": eps, "budget": budget, "canary_seed": seed.hex()}, contributed


# ---------------------------------------------------------------------------------------- the coordinator's side
def prepare(f: ServerFacts, kind: str, release: str, instr: object) -> Prepared:
    p, rnd, shape = f.privacy, f.rnd, (f.layers, f.experts)
    sp = spec(p, f.plan.noise_multiplier, shape[0], shape[1], f.n, f.t)

    def event_at(n_active: int) -> PrivacyEvent:
        return event(sp, n_active, f"router-stats round {rnd}")

    def open_(res) -> Opened:
        run_key, u1 = f.round_keys()
        seed = canary_seed(run_key, rnd, u1)
        lay = StatsLayout(sp, seed)
        noisy, canaries = lay.decode(res.total)  # [L, E] sequence units, [K] integer units
        ints = lay.decode_ints(res.total)[:sp.dim].reshape(shape)  # [L, E]
        dp = sp.dp_params(res.n_active)
        sigma = sp.aggregate_sigma(res.n_active)
        problem = stats_sum_problem(ints, sp.scale, res.n_active, p.num_sequences_max, sigma)
        rows = [int(v) for v in ints.sum(1)]  # [L]
        canary = {"k": int(sp.n_canaries), "values": [int(v) for v in canaries], "seed": seed.hex(),
                  "secagg_run": run_key.hex(), "u1": [[int(c), k.hex()] for c, k in u1],
                  "positions_sha256": positions_digest(lay.canary_positions)}
        extra, warnings = {}, []
        if shape[0] > 1:
            rt = row_noise_test([(rows, math.sqrt(shape[1]) * sigma)], ROW_NOISE_ALPHA)
            extra["row_noise"] = {"stat": rt.statistic, "dof": rt.dof, "p_low": rt.p_low, "flag": not rt.passed}
            if not rt.passed:
                warnings.append(f"round {rnd}: WARNING: the router-statistics rows disagree less than the recorded "
                                f"noise implies (variance ratio {rt.ratio:.3g}, p = {rt.p_low:.3g}): a party's noise "
                                "share may be missing from the statistic (the audit's row-noise check decides)")
        info = dict(layers=shape[0], experts=shape[1], canary=canary, row_sums=rows, **extra)
        if problem is not None:  # the privacy cost is spent (the sum was unmasked), the anchor stays
            return Opened(Skip(f"aggregate rejected ({problem}): {UNCHANGED}"), dp, problem, info, warnings)
        worst = max((max(v["prv"], v["rdp"]) for v in f.epsilon().values()), default=0.0)
        return Opened(StatsSum(np.asarray(noisy), len(res.included), f.n,
                               f"DP z_eff {dp['z_eff']:.2f}, epsilon spent <= {worst:.3f} of {p.epsilon:g}"),
                      dp, None, info, warnings)

    return Prepared(StatsLayout(sp).length, 64, event_at, open_)  # the canary positions leave the length as is
