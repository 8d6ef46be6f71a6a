"""The privacy plan charges what the parties charge: updates per sequence at z_u / 2, router statistics by the
Skellam bound at integer orders, so the planned epsilon is a backed bound <= privacy.epsilon."""

from __future__ import annotations

import pytest

from distmoe.config import ConfigError, parse_run_config
from distmoe.privacy.accountant import Accountant, BudgetExceeded, PrivacyEvent, epsilon_from_events, skellam_epsilon
from distmoe.privacy.plan import plan_privacy, threshold_for
from distmoe.privacy.releases.stats import event as stats_event
from distmoe.privacy.releases.stats import spec as stats_spec
from distmoe.privacy.update_noise import SEQUENCE_FACTOR, update_dp_facts, update_event
from distmoe.privacy.vectors import UpdateLayout

DEFAULT_Z_BEFORE = 0.6894149190029418  # the default plan's derived z before integer orders (7.999 "<= 8")


def test_update_noise_4_is_charged_as_the_gaussian_at_2_per_sequence():
    ev = update_event(4.0, 2, 2, "model-update round 1")  # the party's charge (t survivors)
    assert ev.noise_multiplier == 2.0 and SEQUENCE_FACTOR == 2.0
    assert epsilon_from_events([ev], 1e-6) == pytest.approx(epsilon_from_events([PrivacyEvent(2.0)], 1e-6))
    # three of t = 2 present: party-level z_eff = 4 sqrt(3/2), per sequence half of it
    assert update_event(4.0, 3, 2, "").noise_multiplier == pytest.approx(4.0 * 1.5**0.5 / 2)
    lay = UpdateLayout.build({"w": (3,)}, 3, 1.0, private=True)
    facts = update_dp_facts(lay, 4.0, 3, 2)
    assert facts["z_eff"] == 4.0 and facts["z_sequence"] == 2.0 and facts["sequence_sensitivity"] == 2 * lay.clip


def test_update_noise_4_no_longer_fits_the_default_budget():
    """Before: 10 update releases at z_u = 4 were planned at z = 4 per sequence, epsilon 7.998 <= 8, while the
    sequence-level composition (z = 2 and the router statistics) was 11.65. Now the plan refuses it."""
    cfg = parse_run_config({"privacy.update-noise-multiplier": 4.0})
    with pytest.raises(ConfigError, match="z_u/2 = 2 per sequence") as ei:
        plan_privacy(cfg.privacy, cfg.schedule)
    # RDP of the Gaussian at z = 2 over the 10 update releases (8.847 alone) and the 2 evaluation releases
    # (Skellam at privacy.metric-noise-multiplier = 3)
    assert "9.300" in str(ei.value)
    roomy = parse_run_config({"privacy.update-noise-multiplier": 4.0, "privacy.epsilon": 16.0})
    plan = plan_privacy(roomy.privacy, roomy.schedule)
    upd = [e for e in plan.events() if e.label == "model-update"]
    assert upd == [PrivacyEvent(2.0, 1.0, 10, "gaussian", "model-update")]
    assert plan.planned_epsilon <= 16.0
    assert plan.planned_epsilon == pytest.approx(max(epsilon_from_events(plan.events(), plan.delta)))
    assert plan.planned_epsilon > max(epsilon_from_events([PrivacyEvent(2.0, 1.0, 10)], plan.delta))


def test_default_plan_is_backed_by_the_integer_order_skellam_bound():
    """Before: z = 0.6894 read epsilon 7.999 at fractional orders; the Skellam bound at integer orders is 8.064."""
    cfg = parse_run_config({})
    p = cfg.privacy
    n = 3
    t = threshold_for(n, p.min_parties, p.secagg_graph)
    old = stats_spec(p, DEFAULT_Z_BEFORE, 4, 8, n, t)  # the default tiny model: L = 4, E = 8
    assert skellam_epsilon(old.sigma_int**2, old.delta2_int, old.delta1_int, 1, p.delta) == pytest.approx(8.064,
                                                                                                         abs=1e-3)
    with pytest.raises(BudgetExceeded):  # the party's accountant now refuses the old plan's release
        Accountant(p.delta, p.epsilon).spend(stats_event(old, t, "router-stats round 1"))
    plan = plan_privacy(p, cfg.schedule)
    assert plan.noise_multiplier > DEFAULT_Z_BEFORE and plan.planned_epsilon <= p.epsilon
    for layers, experts in ((4, 8), (1, 2), (48, 128)):  # whatever the model, the party's charge fits the plan
        spec = stats_spec(p, plan.noise_multiplier, layers, experts, n, t)
        acc = Accountant(p.delta, p.epsilon)
        assert acc.spend(stats_event(spec, t, "router-stats round 1")) <= plan.planned_epsilon + 1e-9
        assert skellam_epsilon(spec.sigma_int**2, spec.delta2_int, spec.delta1_int, 1, p.delta) <= p.epsilon


def test_default_plan_epsilon_is_cross_checked_with_dp_accounting():
    """The default plan's epsilon (add/remove one example of one party: docs/privacy.md §2) against Google's
    dp-accounting on the same releases as Gaussians of the same variance: its integer-order RDP is at most
    distmoe's Skellam bound and within 0.01 of it (the Skellam excess term), its PLD within 0.02 of distmoe's PRV,
    and the plan stays within the budget."""
    import dp_accounting
    from dp_accounting import pld, rdp

    from distmoe.privacy.accountant import INT_ALPHAS

    cfg = parse_run_config({})
    plan = plan_privacy(cfg.privacy, cfg.schedule)
    assert (plan.stats_releases, plan.update_releases, plan.eval_releases) == (1, 0, 2)
    prv, rdp_eps = epsilon_from_events(plan.events(), plan.delta)
    assert plan.planned_epsilon == max(prv, rdp_eps) <= plan.epsilon == 8.0
    same = dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(plan.noise_multiplier), plan.stats_releases),
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(plan.metric_noise_multiplier),
                                          plan.eval_releases)])
    ref_rdp = rdp.RdpAccountant(orders=list(INT_ALPHAS)).compose(same).get_epsilon(plan.delta)
    ref_pld = pld.PLDAccountant().compose(same).get_epsilon(plan.delta)
    assert ref_rdp <= rdp_eps <= ref_rdp + 0.01
    assert abs(prv - ref_pld) <= 0.02
    assert plan.planned_epsilon == pytest.approx(7.996, abs=5e-4)


def test_a_schedule_without_stats_rounds_is_not_told_to_derive_their_noise():
    """Update noise over a schedule without ``stats`` rounds spends the budget: the error names the update and
    evaluation noise keys, not ``privacy.noise-multiplier`` (which no release of that run uses) nor its derivation."""
    cfg = parse_run_config({"privacy.update-noise-multiplier": 1.0, "schedule.phases": "sft:lookup*5, eval"})
    with pytest.raises(ConfigError) as ei:
        plan_privacy(cfg.privacy, cfg.schedule)
    msg = str(ei.value)
    assert msg.startswith("config key 'privacy.update-noise-multiplier':"), msg
    assert "raise privacy.update-noise-multiplier or privacy.metric-noise-multiplier or privacy.epsilon" in msg
    assert "to derive it" not in msg
