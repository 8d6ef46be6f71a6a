"""Evaluation figures and training weights under secure aggregation (``distmoe.privacy.metric_noise``,
``distmoe.privacy.vectors.UpdateLayout``): the straggle-differencing attack on evaluation figures, the
calibration of the evaluation noise and its accounting."""

from __future__ import annotations

import math

import numpy as np
import pytest

from distmoe.config import parse_run_config
from distmoe.privacy.accountant import ALPHAS, INT_ALPHAS, Accountant, PrivacyEvent, epsilon_from_events
from distmoe.privacy.metric_noise import SCALE, EvalNoiseError, EvalSpec, eval_sensitivity
from distmoe.privacy.plan import plan_privacy, threshold_for
from distmoe.privacy.releases.evaluate import spec as eval_spec
from distmoe.privacy.ring import from_ring64
from distmoe.privacy.vectors import UpdateLayout

N, T = 4, 3  # four parties, SecAgg threshold three: one straggler still leaves a release
TASK = "arith"
DELTA = 1e-6


def _ring_sum(vectors):
    total = np.zeros_like(vectors[0])
    for v in vectors:
        total = total + v  # uint64 wrap-around, as in SecAgg
    return total


def _party_scores(rng, n_examples):
    """``n_examples`` held-out ``(correct, loss)`` pairs of one party."""
    return [(bool(rng.random() < 0.6), float(rng.uniform(0.5, 4.0))) for _ in range(n_examples)]


def _spec(z=3.0) -> EvalSpec:
    return EvalSpec((TASK,), z, N, N - T, examples_max=48, loss_bound=16.0)


def _difference_eval(spec, scores, rng, noised=True):
    """The attack on evaluation: the server's figures of two releases, all four parties, then the straggler
    (party 3) missing; differencing recovers party 3's held-out count and mean loss. ``noised=False`` is the
    same attack on the exact sums (the defence removed)."""

    def release(parties):
        if noised:
            vecs = [spec.share(spec.sums({TASK: scores[p]}), rng) for p in parties]
        else:
            vecs = [spec.sums({TASK: scores[p]}).astype(np.uint64) for p in parties]
        return spec.decode(_ring_sum(vecs))

    a, b = release(range(N)), release(range(N - 1))
    count = a[f"n/{TASK}"] - b[f"n/{TASK}"]
    loss_sum = a[f"loss/{TASK}"] * a[f"n/{TASK}"] - b[f"loss/{TASK}"] * b[f"n/{TASK}"]
    return count, loss_sum / count if count else math.nan


def test_straggle_differencing_no_longer_recovers_counts_or_losses():
    """Straggle differencing. Attack: a coordinator makes party 3 straggle in the second of two releases with the same
    model and differences its own figures. Before, the weight sum gave party 3's training example count and
    the evaluation sums its exact held-out count and mean loss. Defences exercised: uniform FedAvg weights
    (``UpdateLayout.weight_of``: the weight sum is the contributor count) and the distributed Skellam noise
    on evaluation sums (``EvalSpec.share``). Without the noise (``noised=False``) the same differencing
    recovers the count and loss exactly, so the test would fail if the defence were removed."""
    rng = np.random.default_rng(11)
    sizes = [40, 12, 30, 7]  # held-out examples per party; party 3 is the target
    scores = [_party_scores(rng, k) for k in sizes]
    true_loss = float(np.mean([min(x, 16.0) for _, x in scores[3]]))

    # training count: the server's weight sums of the two releases differ by 1 whatever party 3's count is
    lay = UpdateLayout.build({"w": (3,)}, N, clip=1.0)
    delta = [{"w": rng.normal(0, 0.1, 3)} for _ in range(N)]
    for target_count in (7, 700):
        counts = [100, 50, 80, target_count]
        w_all = lay.decode(_ring_sum([lay.encode(delta[p], counts[p])[0] for p in range(N)]))[1]
        w_less = lay.decode(_ring_sum([lay.encode(delta[p], counts[p])[0] for p in range(N - 1)]))[1]
        assert w_all - w_less == pytest.approx(1.0)  # the contributor indicator, never the count

    # held-out count and loss: exact without the noise (the attack works on the bare sums) ...
    count, loss = _difference_eval(_spec(), scores, rng, noised=False)
    assert count == pytest.approx(sizes[3], abs=1e-9) and loss == pytest.approx(true_loss, abs=16.0 / SCALE)

    # ... and off by at least the noise scale with it, over repeated trials with fresh noise
    spec = _spec()
    sigma_count = spec.aggregate_sigma(T) / spec.scale  # the noise std of one release's count, fewest survivors
    errs_n, errs_loss, exact = [], [], 0
    for _ in range(300):
        c, x = _difference_eval(spec, scores, rng)
        errs_n.append(c - sizes[3])
        errs_loss.append(x - true_loss if math.isfinite(x) else math.inf)
        exact += round(c) == sizes[3]
    rms_n = math.sqrt(np.mean(np.square(errs_n)))
    assert rms_n >= sigma_count > 1.0  # more than one example of noise on the recovered count
    assert exact / 300 < 0.15  # the recovered count is rarely even the right integer
    # the loss is a ratio of two noisy differences: its median error alone exceeds the noise scale of the
    # loss sum over the target's true count (sigma in loss units / count)
    sigma_loss = spec.aggregate_sigma(T) / spec.scale * spec.loss_bound / sizes[3]
    assert float(np.median(np.abs(errs_loss))) >= 0.5 * sigma_loss
    assert math.sqrt(np.mean(np.square(np.clip(errs_loss, -1e6, 1e6)))) >= sigma_loss


def test_eval_release_decodes_to_noisy_means_of_the_declared_scale():
    rng = np.random.default_rng(3)
    spec = EvalSpec(("a", "b"), 2.0, 5, 2, examples_max=48, loss_bound=8.0)
    scores = [{"a": _party_scores(rng, 40), "b": _party_scores(rng, 10 * (p % 2))} for p in range(5)]
    truth_n = sum(len(s["a"]) for s in scores)
    truth_acc = sum(ok for s in scores for ok, _ in s["a"]) / truth_n
    counts = []
    for _ in range(200):
        out = spec.decode(_ring_sum([spec.share(spec.sums(s), rng) for s in scores]))
        counts.append(out["n/a"])
        assert 0.0 <= out["acc/a"] <= 1.0 and 0.0 <= out["loss/a"] <= 8.0
    want = spec.aggregate_sigma(5) / spec.scale  # 5 survivors of t = 3: z_eff = z sqrt(5/3)
    assert np.std(counts) == pytest.approx(want, rel=0.15)
    assert np.mean(counts) == pytest.approx(truth_n, abs=4 * want / math.sqrt(200))
    exact = spec.decode(_ring_sum([spec.sums(s).astype(np.uint64) for s in scores]))
    assert exact["n/a"] == truth_n and exact["acc/a"] == pytest.approx(truth_acc)
    assert spec.effective_noise_multiplier(3) == pytest.approx(2.0)
    assert spec.effective_noise_multiplier(5) == pytest.approx(2.0 * math.sqrt(5 / 3))


def test_eval_sums_are_bounded_per_example_and_refuse_what_does_not_fit():
    spec = _spec()
    s = spec.sums({TASK: [(True, 100.0), (False, -3.0), (True, math.nan)]})
    assert s.tolist() == [2 * SCALE, SCALE + 0 + SCALE, 3 * SCALE]  # clipped to [0, B]; NaN counts as B
    d2, d1 = eval_sensitivity()
    one = spec.sums({TASK: [(True, 16.0)]})
    assert np.linalg.norm(one) == pytest.approx(d2) and np.abs(one).sum() == pytest.approx(d1)  # the worst example
    with pytest.raises(EvalNoiseError, match="max-eval-examples"):
        spec.sums({TASK: [(True, 1.0)] * 49})
    with pytest.raises(EvalNoiseError, match="undeclared"):
        spec.sums({"other": []})
    with pytest.raises(EvalNoiseError, match="outside"):
        spec.share(np.array([0, 0, 49 * SCALE]))
    assert from_ring64(spec.share(np.zeros(3, np.int64), np.random.default_rng(0))).any()  # the share is noised


def _independent_skellam_eps(z, d2, d1, releases, delta, orders):
    """Agarwal, Kairouz, Liu 2021 Thm 3.5 at the integer ``orders`` and the RDP -> (eps, delta) conversion of
    Balle et al. 2020, written out here without the project's accountant."""
    best = math.inf
    mu = (z * d2) ** 2
    for a in orders:
        rdp = releases * (a * d2**2 / (2 * mu) + min(((2 * a - 1) * d2**2 + 6 * d1) / (4 * mu**2), 3 * d1 / (2 * mu)))
        best = min(best, rdp + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1))
    return best


def test_eval_release_epsilon_matches_an_independent_computation_and_dp_accounting():
    spec = _spec(3.0)
    ev = spec.event(T, "eval round 2")
    assert ev.mechanism == "skellam" and ev.noise_multiplier == pytest.approx(3.0)
    _, rdp = epsilon_from_events([ev, ev], DELTA)
    orders = sorted({int(a) for a in ALPHAS if a == int(a) and a >= 2})  # the accountant's integer orders
    assert rdp == pytest.approx(
        _independent_skellam_eps(3.0, spec.delta2_int, spec.delta1_int, 2, DELTA, orders), rel=1e-9
    )
    # on every integer order the bound can only be lower: the accountant's figure is on the safe side
    assert rdp >= _independent_skellam_eps(3.0, spec.delta2_int, spec.delta1_int, 2, DELTA, INT_ALPHAS)
    import dp_accounting
    from dp_accounting import rdp as dpa_rdp

    acc = dpa_rdp.RdpAccountant(orders=[float(a) for a in orders])
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(3.0), 2))
    gauss = acc.get_epsilon(DELTA)
    assert rdp >= gauss and rdp == pytest.approx(gauss, rel=0.01)  # Skellam is above its Gaussian, barely


def test_default_plan_charges_the_eval_releases_and_stays_within_budget():
    """The default schedule has two eval rounds: the plan charges both (Skellam at z_m = 3), derives the router
    statistics' z around them, and a party's real charges fit the planned epsilon."""
    cfg = parse_run_config({})
    p = cfg.privacy
    plan = plan_privacy(p, cfg.schedule)
    assert plan.eval_releases == 2 and plan.metric_noise_multiplier == 3.0
    evals = [e for e in plan.events() if e.label == "eval"]
    assert evals == [PrivacyEvent(3.0, 1.0, 2, "skellam", "eval", *eval_sensitivity())]
    assert plan.planned_epsilon <= p.epsilon
    assert plan.planned_epsilon == pytest.approx(max(epsilon_from_events(plan.events(), plan.delta)))
    n = 3
    t = threshold_for(n, p.min_parties, p.secagg_graph)
    spec = eval_spec(p, cfg.data.max_eval_examples, cfg.schedule.tasks, n, t)
    acc = Accountant(p.delta, p.epsilon)
    for rnd in (6, 12):
        acc.spend(spec.event(t, f"eval round {rnd}"))
    assert acc.primary_epsilon() <= plan.planned_epsilon
    plain = parse_run_config({"privacy.mode": "plaintext"})
    assert plan_privacy(plain.privacy, plain.schedule).eval_releases == 0  # no DP release in the baseline
