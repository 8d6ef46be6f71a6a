"""The progress line: at most 100 columns, no empty fields; noised figures with their noise scale."""

from __future__ import annotations

import math

from distmoe.report.progress import WIDTH, fit, noisy, within_noise


def test_fit_packs_fields_into_lines_of_at_most_100_columns():
    fields = ["round 13/13", "eval", "3/3 parties", "acc: lookup 0.81 ± 0.04, arith 0.12 ± 0.04, strings 0.50 ± 0.05",
              "", "retention lookup 0.95", "probe: KL 0.012, load CV 0.35, top-1 0.99", "3.2 s"]
    lines = fit(fields)
    assert len(lines) == 2 and all(len("  " + x) <= 100 for x in lines)
    assert lines[0].startswith("round 13/13 | eval | 3/3 parties | acc: lookup 0.81")
    assert lines[1].startswith("    ") and " |  | " not in " ".join(lines)  # no empty field
    assert " | ".join(x.strip() for x in lines).split(" | ") == [f for f in fields if f]  # nothing lost
    assert fit(["round 1/5 (1.0 s)", "sft:lookup", "3/3 parties"]) == ["round 1/5 (1.0 s) | sft:lookup | 3/3 parties"]
    assert WIDTH == 98


def test_noisy_figures_carry_their_scale_and_zero_is_within_noise():
    assert noisy(0.8123, 0.0412) == "0.81 ± 0.04"
    assert noisy(0.0, 0.04) == "≈ 0 (within noise)"  # a clipped 0 is not printed as 0
    assert noisy(0.03, 0.04) == "≈ 0 (within noise)"
    assert noisy(0.5, math.nan) == "0.50"  # not noised (plaintext): the value
    assert noisy(math.nan, 0.1) == "n/a"
    assert within_noise(0.004, 0.04) and not within_noise(0.3, 0.04) and not within_noise(0.0, math.nan)
