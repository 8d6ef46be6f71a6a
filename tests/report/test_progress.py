"""The progress line: at most 100 columns, no empty fields; noised figures with their noise scale; any other line of
the stream (a warning, the privacy header) wrapped to 100 columns too."""

from __future__ import annotations

import math

from distmoe.report.progress import INDENT, WIDTH, fit, noisy, within_noise, wrap


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


WARNING = ("WARNING: round 1: routing load CV 1.188 on the probe set exceeds routing.load-cv-warn = 1 (experts "
           "unevenly used; healthy < 0.2). To even it: the routing bias of configs/continual-balanced.toml "
           "(docs/results.md); to silence this: routing.load-cv-warn = 0")


def test_a_long_warning_is_wrapped_at_spaces_into_lines_of_at_most_100_columns():
    lines = wrap(WARNING)
    assert len(lines) == 3 and all(len("  " + x) <= 100 for x in lines)
    assert all(x.startswith(INDENT) for x in lines[1:])
    assert " ".join(x.strip() for x in lines) == WARNING  # nothing lost, words and keys kept whole
    assert "configs/continual-balanced.toml" in lines[1] and lines[2].endswith("routing.load-cv-warn = 0")
    assert wrap("round 1/5 | sft:lookup") == ["round 1/5 | sft:lookup"]  # a line that fits is unchanged
    assert wrap("a\nb") == ["a", "b"]
    long_word = "x" * 120  # a word longer than a line (a path) stays whole
    assert wrap(f"see {long_word} now") == ["see", INDENT + long_word, INDENT + "now"]
