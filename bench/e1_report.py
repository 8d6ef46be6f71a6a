"""The table commands of the continual-learning instrument (``bench/retention_e1.py table`` and ``table1``): which
of ``bench/e1_tables.py``'s tables an ``--out`` directory's rows get, in what order, and which earlier rows
(``--stage0``) are read beside them (only rows of the same regime, ``same_regime``).

Must not: train, evaluate or write rows (it prints tables of kept rows only).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e1_arms  # noqa: E402  (the bench's own modules, beside this file)
import e1_pairs  # noqa: E402
import e1_tables  # noqa: E402

REGIMES = e1_arms.REGIMES


def same_regime(rows: list[dict], out: Path, stage0: Path) -> list[dict] | None:
    """Check that ``rows`` hold one regime (``SystemExit`` naming ``out`` when they mix), say it when it is not the
    primary, and return the ``--stage0`` rows to read beside them: only when they exist and are of the same regime."""
    regime = e1_tables.regime(rows, str(out))
    if regime != REGIMES[0]:
        print(f"Regime: model.trainable = {regime!r} during A and B (not the primary {REGIMES[0]!r}).\n")
    if not (stage0 / "rows.jsonl").exists():
        return None
    earlier = e1_tables.load_rows(stage0)
    return earlier if e1_tables.regime(earlier, str(stage0)) == regime else None


def show_table(out: Path, stage0: Path, length: int | None) -> None:
    """``table``: Stage 0's tables (B's length by the rule unless ``length``), or a task pair's (the route-apart
    arms, the routing overlap, ``none`` beside Stage 0's); a secondary regime's ``none`` beside the primary's."""
    seed_of = e1_tables.base_seeds(stage0, out)
    rows = e1_tables.units(e1_tables.load_rows(out), seed_of)
    paired, earlier = any("pair" in r for r in rows), same_regime(rows, out, stage0)
    print(e1_tables.tables(rows, e1_pairs.ROUTE_APART_ARMS if paired else e1_arms.STAGE0, length))
    if paired and (out / "overlap.jsonl").exists():
        print("\n" + e1_tables.overlap_table(*e1_tables.load_overlap(out)))
    if paired and earlier is not None:
        print("\n" + e1_tables.none_beside(rows, earlier, e1_pairs.ROUTE_APART_ARMS))
    regime = e1_tables.regime(rows, str(out))
    if not paired and regime != REGIMES[0] and (stage0 / "rows.jsonl").exists():
        print("\n" + e1_tables.none_beside(rows, e1_tables.load_rows(stage0), e1_arms.STAGE0,
                                            (f"{regime} (here)", f"{REGIMES[0]} (--stage0)")))


def show_table1(out: Path, stage0: Path, length: int) -> None:
    """``table1``: Stage 1's tables at B's pre-registered ``length``, base 0's alone when other bases ran too, and
    the same pre-B model's check against Stage 0's rows."""
    rows = e1_tables.load_rows(out)
    seed_of, earlier = e1_tables.base_seeds(stage0, out), same_regime(rows, out, stage0)
    print(e1_tables.tables(e1_tables.units(rows, seed_of), e1_arms.STAGE1, length))
    first = [r for r in rows if seed_of.get(r["base"], 0) == 0]  # Stage 0 ran on base 0 only
    if len(first) < len(rows):
        print("\nBase 0 alone:\n\n" + e1_tables.tables(first, e1_arms.STAGE1, length))
    if earlier is not None:
        print("\n" + e1_tables.same_pre_b(first, earlier, length))
