"""The pre-registered analysis of the continual-learning instrument (``bench/retention_e1.py``): paired
differences between arms that branch from the same pre-B checkpoint, a Holm correction over the arm-vs-none
tests, the comparison at equal B loss, and the choice of B's length.

Fixed before the runs (see ``bench/retention_e1.py``'s docstring for the design):

* Per seed ``s`` and arm ``a``: ``d_s = y_s(a) - y_s(none)``. Per arm: the mean of ``d``, its 95 % t-interval
  ``mean +- t_{0.975, n-1} * sd / sqrt(n)``, the two-sided one-sample t-test p and the exact two-sided Wilcoxon
  signed-rank p (``scipy.stats.wilcoxon``; with 3 seeds its smallest possible p is 0.25, so it can never reject).
* Holm over the ``m`` arm-vs-none tests of one endpoint (Holm 1979, "A simple sequentially rejective multiple
  test procedure"): sort the t-test p ascending, ``p_(r)`` adjusted to ``max_{j<=r} min(1, (m - j + 1) p_(j))``;
  the adjusted interval of rank ``r`` is the t-interval at confidence ``1 - 0.05 / (m - r + 1)``. An effect is
  claimed only where the adjusted p < 0.05 (then the adjusted interval excludes 0).
* Equal B loss: the target is the largest final B NLL over the arms of a seed (every arm reaches it); each arm's
  A accuracy is read where its B NLL curve first falls to the target, linearly interpolated in B NLL between the
  two checkpoints around the crossing.
* B's length: among the checkpoints, the one whose none-arm mean kept fraction
  ``(acc_A(after B) - acc_A(base)) / (acc_A(after A) - acc_A(base))`` is closest to 0.5 within [0.2, 0.8];
  ``None`` when no checkpoint is in the window (then the gate is not met: say so).
* The stop rule: an oracle whose mean A-accuracy gain over none at equal B loss is < 0.10 cannot buy retention in
  this regime.

Must not: train, read checkpoints or decide what the runs are (the bench does); pure functions on numbers.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from scipy import stats as sps

ALPHA = 0.05
STOP_RULE_GAIN = 0.10  # the oracle must beat none by this much in A's accuracy at equal B loss


def paired(diffs: Sequence[float], level: float = 1 - ALPHA) -> dict[str, float]:
    """Mean of paired differences, its two-sided t-interval at ``level``, t-test p and Wilcoxon p."""
    d = [float(x) for x in diffs]
    n = len(d)
    if n < 2:
        raise ValueError(f"paired: need at least 2 paired differences, got {n}")
    mean = statistics.fmean(d)
    sd = statistics.stdev(d)
    half = sps.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    if sd == 0.0:
        p_t = 1.0 if mean == 0.0 else 0.0
    else:
        p_t = float(2 * sps.t.sf(abs(mean) / (sd / math.sqrt(n)), n - 1))
    p_w = 1.0 if all(x == 0.0 for x in d) else float(sps.wilcoxon(d, zero_method="wilcox").pvalue)
    return {"n": n, "mean": mean, "sd": sd, "lo": mean - half, "hi": mean + half, "p_t": p_t, "p_wilcoxon": p_w}


def holm(pvalues: dict[str, float]) -> dict[str, tuple[float, int]]:
    """Holm-adjusted p and the rank (1 = smallest p) of each test; ``m`` = the number of tests."""
    order = sorted(pvalues, key=lambda k: pvalues[k])
    m = len(order)
    out: dict[str, tuple[float, int]] = {}
    running = 0.0
    for r, key in enumerate(order, start=1):
        running = max(running, min(1.0, (m - r + 1) * pvalues[key]))
        out[key] = (running, r)
    return out


def compare_arms(diffs: dict[str, Sequence[float]]) -> dict[str, dict[str, float]]:
    """Per arm: ``paired`` of its differences against none, the Holm-adjusted t and Wilcoxon p, the adjusted
    interval (``adj_lo``, ``adj_hi``) and ``claimed`` (adjusted p < 0.05)."""
    tests = {arm: paired(d) for arm, d in diffs.items()}
    adj_t = holm({a: t["p_t"] for a, t in tests.items()})
    adj_w = holm({a: t["p_wilcoxon"] for a, t in tests.items()})
    m = len(tests)
    for arm, t in tests.items():
        p_adj, rank = adj_t[arm]
        wide = paired(diffs[arm], level=1 - ALPHA / (m - rank + 1))
        t.update({"p_t_holm": p_adj, "p_wilcoxon_holm": adj_w[arm][0], "adj_lo": wide["lo"], "adj_hi": wide["hi"],
                  "claimed": float(p_adj < ALPHA)})
    return tests


def at_equal_loss(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    """``curve``: (B NLL, A accuracy) at successive checkpoints. A's accuracy where B's NLL first reaches
    ``target`` (linear in B NLL between the checkpoints around the crossing); None if it never does."""
    if not curve:
        raise ValueError("at_equal_loss: empty curve")
    prev = None
    for b, a in curve:
        if b <= target:
            if prev is None or prev[0] == b:
                return float(a)
            a0, w = prev[1], (prev[0] - target) / (prev[0] - b)
            return float(a0 + w * (a - a0))
        prev = (b, a)
    return None


def kept_fraction(base: float, after_a: float, after_b: float) -> float:
    """What B left of what A's training added: ``(after_b - base) / (after_a - base)`` (NaN if A added nothing)."""
    gain = after_a - base
    return (after_b - base) / gain if gain > 0 else math.nan


def choose_length(kept: dict[int, list[float]], lo: float = 0.2, hi: float = 0.8) -> int | None:
    """The B step (checkpoint) whose mean none-arm kept fraction is closest to 0.5 inside [lo, hi]."""
    inside = {}
    for step, vals in kept.items():
        vals = [v for v in vals if math.isfinite(v)]
        if vals and lo <= statistics.fmean(vals) <= hi:
            inside[step] = abs(statistics.fmean(vals) - 0.5)
    return min(inside, key=lambda s: (inside[s], s)) if inside else None


def fmt_test(t: dict[str, float]) -> str:
    """``+0.123 [−0.01, +0.25] (Holm [−0.05, +0.30], p_t 0.04 → 0.12, W 0.25 → 0.75)``."""
    return (f"{t['mean']:+.3f} [{t['lo']:+.3f}, {t['hi']:+.3f}] (Holm [{t['adj_lo']:+.3f}, {t['adj_hi']:+.3f}], "
            f"p_t {t['p_t']:.3f} → {t['p_t_holm']:.3f}, W {t['p_wilcoxon']:.2f} → {t['p_wilcoxon_holm']:.2f})"
            + (" **claimed**" if t["claimed"] else ""))


def load_rows(keep: Path) -> list[dict]:
    """The kept rows of a federated bench: ``<keep>/<run>/row.json``, in name order."""
    return [json.loads(p.read_text()) for p in sorted(Path(keep).glob("*/row.json"))]


def complete_seeds(rows: list[dict], arms: Sequence[str]) -> tuple[list, list]:
    """(seeds with a row of every arm, seeds cut off before every arm ran); a seed is an int, or a (base, seed) unit
    where the rows span several bases."""
    have: dict = {}
    for r in rows:
        seed = tuple(r["seed"]) if isinstance(r["seed"], (list, tuple)) else int(r["seed"])
        have.setdefault(seed, set()).add(r["arm"])
    done = sorted(s for s, got in have.items() if set(arms) <= got)
    return done, sorted(set(have) - set(done))
