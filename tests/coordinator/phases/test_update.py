"""The round line's released training figures (``distmoe.coordinator.phases.update.released``): a noised figure
with its noise std, and one within a std of 0 as '≈ 0 (within noise)', never a bare (possibly negative) number."""

from __future__ import annotations

import math

from distmoe.coordinator.phases.update import released

NAMES = (("task_loss", "task loss", ".3f"), ("k3", "K3", ".2e"))


def test_released_figures_without_noise_are_the_plain_means():
    assert released({"task_loss": 2.3266, "k3": 0.021}, {}, NAMES) == "task loss 2.327 | K3 2.10e-02"


def test_a_noised_figure_carries_its_std_and_one_within_noise_reads_so():
    text = released({"task_loss": 2.3266, "k3": -0.013}, {"task_loss": 0.41, "k3": 0.05}, NAMES)
    assert text == "task loss 2.327 ± 0.410 | K3 ≈ 0 (within noise)"  # not 'K3 -1.30e-02 ± 5.00e-02'


def test_no_contributor_says_so():
    assert released({"task_loss": math.nan}, {}, NAMES) == "no training figures (no contributor)"


def test_noised_rl_figures_pack_into_round_lines_of_at_most_100_columns():
    """Four noised RL figures (about 100 characters together) are fields of their own: no line passes 100 columns."""
    from distmoe.report.progress import fit

    names = (("reward", "reward", ".3f"), ("logp_diff_mean", "|dlogp|", ".4f"), ("masked_frac", "masked", ".4f"),
             ("k3", "K3", ".2e"))
    figures = {"reward": 0.07, "logp_diff_mean": 6.0314, "masked_frac": 5.237, "k3": 6.64}
    text = "3/3 parties | " + released(figures, {"reward": 3.65, "logp_diff_mean": 3.65, "masked_frac": 5.16,
                                                 "k3": 3.65}, names)
    lines = fit(["round 2/3 (11.2 s)", "rl:lookup", *text.split(" | ")])
    assert all(len("  " + x) <= 100 for x in lines), lines
    assert "K3 6.64e+00 ± 3.65e+00" in lines[-1]
