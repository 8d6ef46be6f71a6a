"""Per-party accountant: composition, refusal before composing, replay, inversion, docs/privacy.md §10."""

from __future__ import annotations

import json
import math

import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from distmoe.privacy.accountant import (
    Accountant,
    BudgetExceeded,
    PrivacyEvent,
    epsilon_from_events,
    noise_multiplier_for,
    skellam_epsilon,
)
from distmoe.privacy.dp import SkellamSpec


def exact_gaussian_eps(z: float, releases: int, delta: float) -> float:
    """R-fold Gaussian (q = 1) is mu-GDP with mu = sqrt(R)/z; invert the Balle-Wang delta(eps). No opacus."""
    mu = math.sqrt(releases) / z

    def d(eps):
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    return brentq(d, 0.0, 200.0)


def test_epsilon_grows_with_releases():
    eps = [epsilon_from_events([PrivacyEvent(1.0)] * r, 1e-5) for r in (1, 5, 10)]
    prv, rdp = zip(*eps, strict=True)
    assert prv[0] < prv[1] < prv[2] and rdp[0] < rdp[1] < rdp[2]
    # steps=k is the same as k separate events
    assert epsilon_from_events([PrivacyEvent(1.0, steps=5)], 1e-5) == pytest.approx(eps[1])


@pytest.mark.parametrize("z,r", [(1.0, 1), (1.0, 10), (10.0, 50), (50.0, 1)])
def test_prv_and_rdp_bound_the_exact_gaussian(z, r):
    exact = exact_gaussian_eps(z, r, 1e-6)
    prv, rdp = epsilon_from_events([PrivacyEvent(z, steps=r)], 1e-6)
    assert exact - 1e-3 <= prv <= exact + 0.02  # PRV: upper bound within its eps_error
    assert rdp >= exact - 1e-3
    assert rdp >= prv - 0.011 and rdp <= 1.25 * prv  # RDP >= PRV (up to PRV's eps_error), ~7% looser


def test_reference_doc_figures():
    # docs/privacy.md §10, delta = 1e-6, q = 1: opacus RDP / PRV (measured there)
    for z, r, rdp_ref, prv_ref in [(5.0, 50, 7.766, 7.296), (10.0, 50, 3.542, 3.318), (20.0, 50, 1.661, 1.554)]:
        prv, rdp = epsilon_from_events([PrivacyEvent(z, steps=r)], 1e-6)
        assert rdp == pytest.approx(rdp_ref, abs=0.005) and prv == pytest.approx(prv_ref, abs=0.005)
    # z = 50, one release: orders up to 1024 give ~0.080, opacus' default orders (<= 63) would give 0.153
    assert epsilon_from_events([PrivacyEvent(50.0)], 1e-6)[1] == pytest.approx(0.080, abs=0.002)
    # docs/privacy.md §10, combined history: DP-SGD (z=1, q=256/10k, 50 * 39 steps) + router stats (z=10, 50 rounds);
    # with a Skellam event RDP is composed at integer orders only (9.810 at fractional orders was not backed)
    events = [PrivacyEvent(1.0, 256 / 10_000, 50 * (10_000 // 256), label="dp-sgd"),
              PrivacyEvent(10.0, 1.0, 50, mechanism="skellam", label="router-stats")]
    prv, rdp = epsilon_from_events(events, 1e-6)
    assert rdp == pytest.approx(9.929, abs=0.01) and prv == pytest.approx(9.129, abs=0.01)


def test_refusal_happens_before_composition():
    acc = Accountant(delta=1e-5, epsilon_budget=6.0)
    first = acc.spend(PrivacyEvent(1.0, label="stats round 0"))
    assert first == pytest.approx(max(acc.epsilon())) and first < 6.0
    before = acc.state_dict()
    ev = PrivacyEvent(1.0, label="stats round 1")
    assert acc.would_exceed(ev)
    with pytest.raises(BudgetExceeded) as info:
        acc.spend(ev)
    err = info.value
    assert err.budget == 6.0 and err.current == pytest.approx(first) and err.after > 6.0
    assert "epsilon=6" in str(err) and f"{first:.4f}" in str(err)
    assert acc.state_dict() == before and len(acc.events) == 1
    # a release that fits is still accepted afterwards
    assert not acc.would_exceed(PrivacyEvent(50.0))
    acc.spend(PrivacyEvent(50.0))
    assert len(acc.events) == 2


def test_primary_choice():
    ev = PrivacyEvent(10.0, steps=50)
    prv, rdp = epsilon_from_events([ev], 1e-6)
    for primary, expect in [("max", max(prv, rdp)), ("prv", prv), ("rdp", rdp)]:
        acc = Accountant(1e-6, 100.0, primary=primary)
        assert acc.spend(ev) == pytest.approx(expect) == acc.primary_epsilon()
    # a budget between PRV and RDP: accepted under "prv", refused under the default "max"
    mid = (prv + rdp) / 2
    Accountant(1e-6, mid, primary="prv").spend(ev)
    with pytest.raises(BudgetExceeded):
        Accountant(1e-6, mid).spend(ev)


def test_state_round_trip_and_independent_recomputation():
    acc = Accountant(delta=1e-6, epsilon_budget=20.0)
    acc.spend(PrivacyEvent(1.0, 0.1, 20, label="dp-sgd"))
    acc.spend(PrivacyEvent(10.0, 1.0, 1, mechanism="skellam", label="stats"))
    acc.spend(PrivacyEvent(9.13, 1.0, 1, mechanism="skellam", label="stats, one dropout"))
    state = json.loads(json.dumps(acc.state_dict()))  # JSON-able
    again = Accountant.from_state_dict(state)
    assert again.epsilon() == pytest.approx(acc.epsilon())
    assert again.events == acc.events
    # the audit's recomputation from the events alone
    assert epsilon_from_events(state["events"], state["delta"]) == pytest.approx(acc.epsilon())
    # a different event list gives a different answer (the check has teeth)
    state["events"][0]["steps"] = 10
    assert epsilon_from_events(state["events"], 1e-6)[0] < acc.epsilon()[0]


def test_load_state_rejects_bad_events():
    acc = Accountant(1e-6, 5.0)
    state = acc.state_dict()
    state["events"] = [{"noise_multiplier": 1.0, "clip": 3}]
    with pytest.raises(ValueError, match="unknown"):
        acc.load_state_dict(state)
    state["events"] = [{"noise_multiplier": 0.0}]
    with pytest.raises(ValueError, match="noise_multiplier"):
        acc.load_state_dict(state)
    assert acc.events == ()


@pytest.mark.parametrize("kw", [dict(noise_multiplier=-1.0), dict(noise_multiplier=1.0, sample_rate=1.5),
                                dict(noise_multiplier=1.0, steps=0), dict(noise_multiplier=1.0, mechanism="laplace")])
def test_invalid_events_rejected(kw):
    with pytest.raises(ValueError):
        PrivacyEvent(**kw)


@pytest.mark.parametrize("target,releases,primary", [(3.0, 50, "rdp"), (3.0, 50, "prv"), (1.0, 10, "max")])
def test_noise_multiplier_for_inverts_epsilon(target, releases, primary):
    z = noise_multiplier_for(target, 1e-6, releases, primary=primary)
    prv, rdp = epsilon_from_events([PrivacyEvent(z, steps=releases)], 1e-6)
    eps = {"prv": prv, "rdp": rdp, "max": max(prv, rdp)}[primary]
    assert eps <= target and eps == pytest.approx(target, rel=0.01)
    # slightly less noise would overspend
    prv2, rdp2 = epsilon_from_events([PrivacyEvent(z * 0.98, steps=releases)], 1e-6)
    assert {"prv": prv2, "rdp": rdp2, "max": max(prv2, rdp2)}[primary] > target


def test_noise_multiplier_for_matches_reference_table():
    # docs/privacy.md §10: eps = 3, q = 1, R = 50, delta = 1e-6 -> z_rdp 11.64, z_prv 10.98 (z_exact 10.92)
    assert noise_multiplier_for(3.0, 1e-6, 50, primary="rdp") == pytest.approx(11.64, rel=0.01)
    assert noise_multiplier_for(3.0, 1e-6, 50, primary="prv") == pytest.approx(10.98, rel=0.01)


def test_dropouts_raise_epsilon_when_accounted_with_survivors():
    spec = SkellamSpec(24, 8, noise_multiplier=10.0, n_parties=10, num_sequences_max=1000)
    eps = [epsilon_from_events([PrivacyEvent(spec.effective_noise_multiplier(10 - d), steps=50)], 1e-6)[0]
           for d in (0, 1, 3)]
    assert eps[0] < eps[1] < eps[2]
    # docs/privacy.md §10, n = 10, z = 10, R = 50: exact 3.308 / 3.508 / 4.039 for d = 0 / 1 / 3 (PRV ~0.01 above)
    assert eps == pytest.approx([3.308, 3.508, 4.039], abs=0.02)


def test_skellam_is_accounted_accurately_by_its_gaussian_approximation():
    spec = SkellamSpec(24, 8, noise_multiplier=10.0, n_parties=6, num_sequences_max=1000, scale=32)
    sk = skellam_epsilon(spec.sigma_int**2, spec.delta2_int, spec.delta1_int, 50, 1e-6)
    gauss_rdp = epsilon_from_events([PrivacyEvent(spec.noise_multiplier, steps=50)], 1e-6)[1]
    assert sk >= gauss_rdp and sk == pytest.approx(gauss_rdp, rel=1e-3)  # docs/privacy.md §10: 3.543 vs 3.543
    # with a tiny variance (sigma_int of a few units) the approximation breaks down: use skellam_epsilon
    small = skellam_epsilon(4.0, 1.0, 1.0, 1, 1e-6)
    assert small > 1.1 * epsilon_from_events([PrivacyEvent(2.0)], 1e-6)[1]


# ----------------------------------------------------------------- integer orders and dp-accounting
def test_skellam_rdp_only_at_integer_orders():
    from distmoe.privacy.accountant import ALPHAS, rdp_orders, skellam_rdp

    assert any(a != int(a) for a in ALPHAS)
    orders = rdp_orders(True, ALPHAS)
    assert orders and all(a == int(a) and a >= 2 for a in orders)
    with pytest.raises(ValueError, match="integer"):
        skellam_rdp(1.0, 64.0, 64.0, [1.5, 2.0])
    # a Skellam event in a history puts every event on integer orders: the Gaussian's part can only grow
    g = PrivacyEvent(2.0, steps=10)
    sk = PrivacyEvent(50.0, 1.0, 1, "skellam", d2=128.0, d1=256.0)
    assert epsilon_from_events([g, sk], 1e-6)[1] > epsilon_from_events([g, PrivacyEvent(50.0)], 1e-6)[1]
    # a legacy Skellam event (no sensitivities) is charged at the worst case, never below a recorded one
    assert (epsilon_from_events([PrivacyEvent(0.7, 1.0, 1, "skellam")], 1e-6)[1]
            >= epsilon_from_events([PrivacyEvent(0.7, 1.0, 1, "skellam", d2=128.0, d1=256.0)], 1e-6)[1])
    assert PrivacyEvent.from_dict(sk.to_dict()) == sk and "d2" not in g.to_dict()


@pytest.mark.parametrize("z,releases", [(2.0, 10), (0.69, 1), (10.0, 50), (1.0, 5)])
def test_gaussian_matches_dp_accounting(z, releases):
    """distmoe's RDP epsilon of the Gaussian equals Google's dp-accounting RdpAccountant at the same orders
    (fractional and integer); its PRV is within eps_error of dp-accounting's PLD accountant."""
    import dp_accounting
    from dp_accounting import pld, rdp

    from distmoe.privacy.accountant import ALPHAS, INT_ALPHAS

    event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), releases)
    for orders in (ALPHAS, INT_ALPHAS):
        ref = rdp.RdpAccountant(orders=list(orders)).compose(event).get_epsilon(1e-6)
        mine = epsilon_from_events([PrivacyEvent(z, steps=releases)], 1e-6, alphas=orders)[1]
        assert mine == pytest.approx(ref, rel=1e-6)
    ref_pld = pld.PLDAccountant().compose(event).get_epsilon(1e-6)
    prv = epsilon_from_events([PrivacyEvent(z, steps=releases)], 1e-6)[0]
    assert ref_pld - 0.02 <= prv <= ref_pld + 0.02


@pytest.mark.parametrize("z,releases,layers,scale", [(0.6950, 1, 4, 64), (10.0, 50, 24, 32), (2.0, 5, 1, 32)])
def test_skellam_is_at_least_the_dp_accounting_gaussian_at_integer_orders(z, releases, layers, scale):
    """At the same variance the Skellam epsilon is >= the Gaussian's (dp-accounting, integer orders), and
    distmoe's epsilon of the Skellam history is the one of its integer-order RDP bound."""
    import dp_accounting
    from dp_accounting import rdp
    from opacus.accountants.analysis.rdp import get_privacy_spent

    from distmoe.privacy.accountant import INT_ALPHAS, skellam_rdp

    d2, d1 = scale * math.sqrt(layers), scale * layers
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), releases)
    gauss = rdp.RdpAccountant(orders=list(INT_ALPHAS)).compose(event).get_epsilon(1e-6)
    sk = PrivacyEvent(z, 1.0, releases, "skellam", d2=d2, d1=d1)
    mine = epsilon_from_events([sk], 1e-6)[1]
    assert mine >= gauss
    assert mine == pytest.approx(skellam_epsilon((z * d2) ** 2, d2, d1, releases, 1e-6))
    eps, order = get_privacy_spent(orders=list(map(float, INT_ALPHAS)),
                                   rdp=list(releases * skellam_rdp(z, d2, d1, INT_ALPHAS)), delta=1e-6)
    assert mine == pytest.approx(float(eps)) and float(order) == int(order)
    # the Skellam-plus-Gaussian history is at least dp-accounting's all-Gaussian composition at integer orders
    both = rdp.RdpAccountant(orders=list(INT_ALPHAS)).compose(event).compose(dp_accounting.GaussianDpEvent(3.0))
    assert epsilon_from_events([sk, PrivacyEvent(3.0)], 1e-6)[1] >= both.get_epsilon(1e-6)


def test_identical_histories_are_composed_once_per_process(monkeypatch):
    """A coordinator holds one accountant per party with the same history: the composition runs once for all of
    them (``_COMPOSED``), gives the same answer as a fresh computation, and a different history is not a hit."""
    from distmoe.privacy import accountant as A

    monkeypatch.setattr(A, "_COMPOSED", {})
    calls = []
    real = A._eps_prv
    monkeypatch.setattr(A, "_eps_prv", lambda *a, **k: calls.append(a) or real(*a, **k))
    events = [PrivacyEvent(3.0, 1.0, 1, mechanism="skellam", label="stats"), PrivacyEvent(2.0, 1.0, 1, label="eval")]
    accs = [Accountant(delta=1e-6, epsilon_budget=20.0) for _ in range(20)]
    after = [acc.epsilon_after(events[0]) for acc in accs]
    assert len(calls) == 1 and len(set(after)) == 1
    for acc in accs:
        acc.spend(events[0])
    assert len(calls) == 1  # the same history again
    A._COMPOSED.clear()
    assert accs[0].epsilon() == pytest.approx(epsilon_from_events(events[:1], 1e-6))  # a fresh recomputation agrees
    assert len(calls) == 2
    assert epsilon_from_events(events, 1e-6)[0] > epsilon_from_events(events[:1], 1e-6)[0]  # another history: no hit
    assert len(calls) == 3
    # the merged history is the key: the same releases in another order are the same composition
    assert epsilon_from_events(events[::-1], 1e-6) == epsilon_from_events(events, 1e-6) and len(calls) == 3


# the deployed ServerApp's log stream: ``flwr-serverapp`` mirrors its stdout and stderr into the lines that
# ``flwr run --stream`` prints, then imports the app (flwr/superlink/cli/flwr_serverapp.py)
_STREAMED = """
import logging
from queue import Queue
from flwr.supercore.logger import mirror_output_to_queue, restore_output
q = Queue()
mirror_output_to_queue(q)
import server.app, clients.app  # everything the two apps import, opacus (the accountant's) among it
from flwr.common.logger import log
log(logging.INFO, "distmoe | marker line")
restore_output()
items = []
while not q.empty():
    items.append(q.get())
print("COPIES", sum("marker line" in s for s in items))
"""


@pytest.mark.slow  # a real process importing both apps (torch, transformers, flwr): tens of seconds when loaded
def test_the_apps_log_stream_carries_each_line_once():
    """opacus' ``logging.basicConfig`` at import put a stderr handler on the root logger, and Flower's logger
    propagates to it: the deployed ServerApp's stream (stdout and stderr mirrored) carried every line twice."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", _STREAMED], capture_output=True, text=True, cwd=str(repo),
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "COPIES 1" in res.stdout, res.stdout[-500:]
