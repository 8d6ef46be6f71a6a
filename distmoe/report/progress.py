"""The per-round progress line: fields packed into lines of at most ``WIDTH`` characters, and noised figures
printed with their noise scale.

Owns :func:`fit` (the fields of a round, e.g. ``round 3/12``, ``sft:arith``, ``3/3 parties``, ``probe: ...``,
``1.2 s``, joined by `` | ``; empty fields dropped; a field that would push a line past ``WIDTH`` starts an
indented continuation line, so nothing wraps at 100 columns) and :func:`noisy` (a DP-noised figure as
``0.81 ± 0.04``, and ``≈ 0 (within noise)`` where it is within its noise of 0, never a clipped ``0``), and
:func:`wrap` (any other line of the stream, a warning or the privacy header, broken at spaces into lines of at most
``WIDTH`` characters; a word is never split, so a path or a key stays whole).

Must not: decide what a round reports (the phases do), or print.
"""

from __future__ import annotations

import math
import textwrap

WIDTH = 98  # a progress line is shown indented by 2 characters: 100 columns in all
INDENT = "    "
SEP = " | "


def fit(fields: list[str], width: int = WIDTH) -> list[str]:
    """``fields`` (empty ones dropped) joined by `` | `` into lines of at most ``width`` characters where each
    field fits; an overflowing field starts a continuation line indented by ``INDENT``."""
    lines: list[str] = []
    cur = ""
    for f in (x.strip() for x in fields):
        if not f:
            continue
        if not cur:
            cur = f if not lines else INDENT + f
        elif len(cur) + len(SEP) + len(f) <= width:
            cur += SEP + f
        else:
            lines.append(cur)
            cur = INDENT + f
    if cur:
        lines.append(cur)
    return lines


def noisy(value: float, scale: float, digits: int = 2) -> str:
    """A noised figure with its noise scale (one standard deviation): ``0.81 ± 0.04``; within one scale of 0
    (and a noise-free 0 read from a clipped figure) ``≈ 0 (within noise)``; no scale (not noised): the value."""
    if not math.isfinite(value):
        return "n/a"
    if not math.isfinite(scale) or scale <= 0:
        return f"{value:.{digits}f}"
    if abs(value) <= scale:
        return "≈ 0 (within noise)"
    return f"{value:.{digits}f} ± {scale:.{digits}f}"


RETENTION_NA = "n/a (earlier accuracy within noise)"  # retention against an earlier accuracy that was noise


def within_noise(value: float, scale: float) -> bool:
    """Is ``value`` within one noise scale of 0 (so a ratio against it is undefined)?"""
    return math.isfinite(scale) and scale > 0 and (not math.isfinite(value) or abs(value) <= scale)


def wrap(text: str, width: int = WIDTH) -> list[str]:
    """``text`` as lines of at most ``width`` characters: each of its own lines broken at spaces (words kept whole,
    so a line holds more only where one word does), continuation lines indented by ``INDENT`` beyond the line's own
    indentation; a line that fits is unchanged."""
    out: list[str] = []
    for line in text.split("\n"):
        lead = line[:len(line) - len(line.lstrip())]
        if len(line) <= width or not line.strip():
            out.append(line)
            continue
        out += textwrap.wrap(line.strip(), width, initial_indent=lead, subsequent_indent=lead + INDENT,
                             break_long_words=False, break_on_hyphens=False)
    return out
