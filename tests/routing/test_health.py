"""Unit tests: the routing-health watch (load-CV threshold, routing KL rising for several rounds)."""

from __future__ import annotations

import math

from distmoe.routing.health import RoutingWatch


def test_load_cv_warns_once_per_episode():
    w = RoutingWatch(load_cv_warn=1.0, kl_rise_rounds=0)
    seen = [w.observe(r, cv, math.nan, 0) for r, cv in enumerate((0.5, 1.2, 1.5, 0.9, 1.1, 0.7, 1.1), 1)]
    kinds = [[k for k, _ in x] for x in seen]
    # 0.9 is not below 0.8 x the threshold: no new warning at round 5; after 0.7 it warns again
    assert kinds == [[], ["load_cv"], [], [], [], [], ["load_cv"]]
    assert "round 2: routing load CV 1.200" in seen[1][0][1] and "routing.load-cv-warn = 1" in seen[1][0][1]
    off = RoutingWatch(load_cv_warn=0.0, kl_rise_rounds=0)
    assert off.observe(1, 9.0, math.nan, 0) == []


def test_kl_rise_needs_consecutive_rises_against_one_anchor():
    w = RoutingWatch(load_cv_warn=0.0, kl_rise_rounds=3)
    out = []
    for r, (kl, v) in enumerate(((0.1, 1), (0.2, 1), (0.3, 1), (0.25, 1), (0.3, 1), (0.4, 1), (0.5, 1)), 1):
        out += [(r, k, t) for k, t in w.observe(r, 0.1, kl, v)]
    assert [(r, k) for r, k, _ in out] == [(7, "kl_rise")]  # the fall at round 4 restarted the count
    assert "0.2500 -> 0.5000" in out[0][2] and "anchor v1" in out[0][2]
    w = RoutingWatch(load_cv_warn=0.0, kl_rise_rounds=2)
    got = [w.observe(r, 0.1, kl, v) for r, (kl, v) in enumerate(((0.1, 1), (0.2, 1), (0.3, 2), (0.4, 2)), 1)]
    assert [g for g in got if g] == []  # the new anchor at round 3 restarted the count
    assert RoutingWatch(0.0, 2).observe(1, 0.1, math.nan, 0) == []  # no anchor: no KL


def test_load_cv_warning_says_what_to_do():
    """The default run (aux loss only) warns at its first probe: the warning names the change that evens the load and
    the key that silences it; with the routing bias on it names the bias's rate instead."""
    aux = RoutingWatch(load_cv_warn=1.0, kl_rise_rounds=0, balance="aux").observe(1, 1.04, math.nan, 0)[0][1]
    assert "configs/continual-balanced.toml" in aux and "routing.load-cv-warn = 0" in aux
    bias = RoutingWatch(load_cv_warn=1.0, kl_rise_rounds=0, balance="bias").observe(1, 1.04, math.nan, 0)[0][1]
    assert "routing.balance-rate" in bias and "continual-balanced" not in bias and "routing.load-cv-warn = 0" in bias
    w = RoutingWatch(load_cv_warn=0.0, kl_rise_rounds=1)
    kl = [t for r, x in enumerate((0.1, 0.2), 1) for _, t in w.observe(r, 0.1, x, 1)][0]
    assert "routing.anchor-kl-coef" in kl
