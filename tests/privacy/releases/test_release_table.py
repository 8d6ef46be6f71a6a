"""The release table (``distmoe.privacy.releases``) used by both sides: three parties encode with a release's
party side, their vectors are summed in its ring (what the secure sum yields once the masks cancel), and the
coordinator's side opens the sum: the decoded release is the parties' figures, every release is charged before it
is built, and a sum that no honest set of parties can produce is rejected and not applied."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from distmoe.config import parse_run_config
from distmoe.privacy import releases as R
from distmoe.privacy.plan import plan_privacy
from distmoe.privacy.releases.base import EvalSum, ServerFacts, Skip, StatsSum, UpdateSum
from distmoe.privacy.releases.evaluate import spec as eval_spec
from distmoe.privacy.releases.stats import spec as stats_spec

N, T = 3, 2
SHAPES = (("w", (4, 3)), ("b", (3,)))
U1 = ((100, b"\x01" * 32), (101, b"\x02" * 32), (102, b"\x03" * 32))
RUN_KEY = b"\x07" * 16


def _cfg(**keys):
    return parse_run_config({"schedule.phases": "sft:arith, stats:arith, eval", "privacy.update-clip": 1.0, **keys})


def _facts(cfg, **kw) -> ServerFacts:
    plan = plan_privacy(cfg.privacy, cfg.schedule)
    return ServerFacts(privacy=cfg.privacy, max_eval_examples=cfg.data.max_eval_examples, plan=plan, n=N, t=T, rnd=4,
                       shapes=SHAPES, layers=2, experts=4, round_keys=lambda: (RUN_KEY, U1),
                       epsilon=lambda: {"p": {"prv": 0.1, "rdp": 0.2}}, **kw)


def _ring_sum(vectors) -> np.ndarray:
    return np.sum(np.stack(vectors), axis=0, dtype=vectors[0].dtype)  # wraps modulo 2^bits, as the masks do


def _secure_sum(total) -> SimpleNamespace:
    return SimpleNamespace(total=total, included=("p0", "p1", "p2"), dropped=(), responders=(), n_active=N,
                           contributors=N)


class Charges(list):
    def __call__(self, event) -> float:
        self.append(event)
        return 0.5


def test_an_update_release_decodes_to_the_parties_mean_and_a_forged_weight_is_rejected():
    cfg = _cfg(**{"privacy.update-noise-multiplier": 0.0})
    prep = R.RELEASES["update"].prepare(_facts(cfg), "sft", "model-update", SimpleNamespace(task="arith"))
    lay, slots = R.update.layout(cfg.privacy, SHAPES, N, T, 0.0, "sft")
    rng = np.random.default_rng(0)
    deltas = [{k: rng.uniform(-0.05, 0.05, sh).astype(np.float32) for k, sh in SHAPES} for _ in range(N)]
    vecs = [R.update.encode(lay, slots, d, 5, {"task_loss": 1.0 + i, "skipped_steps": 0.0})[0]
            for i, d in enumerate(deltas)]
    assert prep.length == lay.length and prep.bits == lay.bits and prep.event_at is None  # no update noise: no DP
    opened = prep.open(_secure_sum(_ring_sum(vecs)))
    assert isinstance(opened.result, UpdateSum) and opened.problem is None and opened.result.num_examples == N
    for k, _ in SHAPES:
        np.testing.assert_allclose(opened.result.delta[k], np.mean([d[k] for d in deltas], 0), atol=1e-5)
    assert opened.result.metrics["task_loss"] == pytest.approx(2.0, abs=1e-3)  # the contributors' mean
    forged = _ring_sum(vecs + [vecs[0]])  # a fourth party's input in a sum of three
    rejected = prep.open(_secure_sum(forged))
    assert isinstance(rejected.result, Skip) and rejected.problem and "rejected" in rejected.result.text


def test_update_noise_is_charged_before_it_is_drawn():
    cfg = _cfg(**{"privacy.update-noise-multiplier": 4.0, "schedule.sft-rounds": 1})
    lay, slots = R.update.layout(cfg.privacy, SHAPES, N, T, 4.0, "sft")
    vec = R.update.encode(lay, slots, {k: np.zeros(sh, np.float32) for k, sh in SHAPES}, 5, {})[0]
    charges = Charges()
    noised, dp = R.update.add_noise(lay, vec.copy(), 4.0, N, T, charges, 4, 3.0)
    assert len(charges) == 1 and dp["epsilon"] == 0.5 and dp["budget"] == 3.0
    assert not np.array_equal(noised, vec)  # the party's Gaussian share was added
    assert R.RELEASES["update"].prepare(_facts(cfg), "sft", "model-update", None).event_at is not None


def test_a_stats_release_decodes_the_parties_counts_with_the_shared_canary_seed():
    cfg = _cfg()
    f = _facts(cfg)
    prep = R.RELEASES["stats"].prepare(f, "stats", "router-stats", None)
    spec = stats_spec(cfg.privacy, f.plan.noise_multiplier, 2, 4, N, T)
    from distmoe.privacy.dp import canary_seed

    seed = canary_seed(RUN_KEY, 4, U1)  # the party derives it from the round's U1, as the coordinator does
    rng = np.random.default_rng(1)
    per_seq = [rng.dirichlet(np.ones(4), size=(6, 2)) for _ in range(N)]  # [N_seq, L, E] each
    charges = Charges()
    vecs = [R.stats.encode(spec, ps, seed, charges, T, 4, 3.0)[0] for ps in per_seq]
    assert len(charges) == N and prep.length == vecs[0].shape[0]
    opened = prep.open(_secure_sum(_ring_sum(vecs)))
    assert isinstance(opened.result, StatsSum) and opened.problem is None
    want = np.sum([ps.sum(0) for ps in per_seq], 0)  # [L, E] sequence counts
    sd = spec.aggregate_sigma(N) / spec.scale  # the sum's noise, in sequences
    assert np.abs(opened.result.total - want).max() < 8 * sd + 1e-3  # the parties' counts, within the noise
    assert opened.info["canary"]["seed"] == seed.hex() and opened.info["row_sums"]


def test_an_eval_release_decodes_accuracy_and_rejects_an_impossible_count():
    cfg = _cfg()
    prep = R.RELEASES["eval"].prepare(_facts(cfg), "eval", "eval", SimpleNamespace(tasks=("arith",)))
    spec = eval_spec(cfg.privacy, cfg.data.max_eval_examples, ("arith",), N, T)
    scores = {"arith": [(True, 0.5), (False, 1.0), (True, 0.25)]}
    charges = Charges()
    vecs = [R.evaluate.encode(spec, scores, charges, T, 4, 3.0)[0] for _ in range(N)]
    assert len(charges) == N
    opened = prep.open(_secure_sum(_ring_sum(vecs)))
    assert isinstance(opened.result, EvalSum) and opened.privacy["eval_noise_sd"] > 0
    sd = opened.privacy["eval_noise_sd"]  # the noise of each sum, in examples
    assert abs(opened.result.per_party["all"]["n/arith"] - 3 * N) < 6 * sd + 1  # 9 examples, noised
    huge = _ring_sum(vecs).copy()
    huge[2] += np.uint64(10 ** 9)  # a count no three parties can reach
    assert isinstance(prep.open(_secure_sum(huge)).result, Skip)
