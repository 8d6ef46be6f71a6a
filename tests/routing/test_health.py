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


# The routing KL of the probes of rounds 7-13 of whole default runs (the README's quick start, `distmoe simulate` with
# no config, and the same config in process), as their metrics.jsonl recorded it: rounds 1-6 (task A, its eval) have
# no anchor, round 7 is the stats round that builds anchor v1 (the model is the one it was built from), rounds 8-12
# train task B, 13 evaluates. The first quick start warned at round 11 (three rises, 0.0016 -> 0.0068) under the
# count-only trigger. The last run is the default with 10x routing.anchor-kl-coef (5).
DEFAULT_RUNS = {
    "quick start, warned": (0.012841220857685395, 0.0016212021054826807, 0.0027181906301016, 0.004737283101888158,
                            0.006801209846015092, 0.005220876168842523, 0.005220876168842523),
    "quick start": (0.015981608247717657, 0.0035992351962776245, 0.002857032268930088, 0.0033928151176773626,
                    0.003231697470592903, 0.004725572390924294, 0.004725572390924294),
    "in process": (0.01373794715773411, 0.002718596315750819, 0.002014498862752108, 0.0034221073816145062,
                   0.003072345845777475, 0.003882158052932096, 0.003882158052932096),
    "anchor-kl-coef 5": (0.018281619828905818, 0.0016771023780611603, 0.001346637710611152, 0.0014049147913946318,
                         0.0010085632880586465, 0.0014538889679139315, 0.0014538889679139315),
}


def _series(kls):
    """``(round, load CV, routing KL, anchor version)`` of every probe of a default run, rounds 1-13."""
    return [(r, 0.5, math.nan, 0) for r in range(1, 7)] + [(r, 0.5, kl, 1) for r, kl in enumerate(kls, 7)]


def _kl_warnings(series, rounds=3):
    w = RoutingWatch(load_cv_warn=0.0, kl_rise_rounds=rounds)
    return [(r, t) for r, cv, kl, v in series for k, t in w.observe(r, cv, kl, v) if k == "kl_rise"]


def test_kl_rise_stays_quiet_on_the_default_runs_pattern():
    """The default run's KL falls from its level at the anchor's round (the model the anchor was built from) once the
    anchor term acts, then climbs back as task B is learned, below that level: no warning. The warned run does rise
    three probes in a row, so only the level keeps it quiet."""
    for name, kls in DEFAULT_RUNS.items():
        assert _kl_warnings(_series(kls)) == [], name
    rises = DEFAULT_RUNS["quick start, warned"]
    assert rises[1] < rises[2] < rises[3] < rises[4] < rises[0]  # three rises in a row, all below the first level


def test_kl_rise_fires_when_routing_drifts_past_the_anchors_level():
    """The default config without the anchor term (routing.anchor-kl-coef = 0, in process; its recorded probe KL of
    rounds 7-11): the KL rises three probes in a row from 0.0057 to 0.0142, past 0.0118 at the anchor's round, and
    the warning fires at round 11 naming both levels and the coefficient that holds routing closer."""
    no_anchor = (0.01180093232353978, 0.005714097012225293, 0.011031729343012034, 0.011622865968165969,
                 0.014171167704785272)
    got = _kl_warnings(_series(no_anchor))
    assert [r for r, _ in got] == [11]
    assert "0.0057 -> 0.0142" in got[0][1] and "0.0118 at round 7" in got[0][1]
    assert "routing.anchor-kl-coef" in got[0][1]
    assert _kl_warnings(_series(no_anchor[:4])) == []  # at round 10 (0.0116) still below the anchor's level
