"""The tables of the continual-learning instrument (``bench/retention_e1.py``) from its kept rows: Stage 0 (B's
length chosen by the rule, the stop rule per oracle) and Stage 1 (B's length fixed in advance, every arm against
none), both by the pre-registered analysis of ``bench/e1_stats.py``; the routing overlap of the task pairs
(``bench/e1_pairs.py``).

Must not: train, evaluate or write rows; read anything but the rows it is given.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e1_stats  # noqa: E402  (the bench's own analysis module, beside this file)

READOUTS = {"router-frozen+forced": "router-frozen"}  # a second readout of an arm's run


def load_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines() if line.strip()]


PRIMARY = "router+experts"  # the regime of a row without a "trainable" key (every row kept before the option)


def regime(rows: list[dict], where: str) -> str:
    """The one regime (``model.trainable`` during A and B) of ``rows``; ``SystemExit`` naming ``where`` when they
    mix regimes (arms pair only within a regime: a secondary run keeps its rows in an ``--out`` of its own)."""
    got = sorted({r.get("trainable", PRIMARY) for r in rows})
    if len(got) > 1:
        raise SystemExit(f"{where}: rows of several regimes (model.trainable {', '.join(got)}); the regimes do not "
                         f"pair: keep each in its own --out")
    return got[0] if got else PRIMARY


def base_seeds(*dirs: Path) -> dict[str, int]:
    """Base directory name -> base seed, from the ``base.jsonl`` records the ``base`` command writes. The name is a
    hash of the whole run config, so one base rebuilt after an unrelated config default changed gets a second name:
    both map to the same seed (and its rows reproduce the earlier ones exactly: the notebook records the check)."""
    out: dict[str, int] = {}
    for d in dirs:
        if (d / "base.jsonl").exists():
            lines = (d / "base.jsonl").read_text().splitlines()
            out.update({r["base"]: r["base_seed"] for r in map(json.loads, filter(str.strip, lines))})
    return out


def units(rows: list[dict], seed_of: dict[str, int]) -> list[dict]:
    """Rows of one base as they are; rows of several bases with ``seed`` made the unit ``(base seed, seed)``, so that
    seed s of two bases is two units and arms pair within one. ``seed_of``: ``base_seeds``."""
    names = {r["base"] for r in rows}
    if len(names) < 2:
        return rows
    missing = sorted(names - set(seed_of))
    if missing:
        raise SystemExit(f"no base.jsonl record names the base(s) {missing}: run the `base` command with --out")
    if len({seed_of[r["base"]] for r in rows}) < 2:
        return rows
    return [{**r, "seed": (seed_of[r["base"]], r["seed"])} for r in rows]


def tables(rows: list[dict], order: tuple[str, ...], length: int | None = None) -> str:
    """Markdown tables from the kept rows: the none arm's curve, every arm's curve, then the paired comparisons at
    ``length`` (None: Stage 0's rule chooses it) and at the last B checkpoint. ``order``: the arms, in order."""
    by = {(r["seed"], r["arm"], r["phase"], r["step"]): r for r in rows}
    ran = {(k[0], k[1]) for k in by}
    every = sorted({r["seed"] for r in rows if r["phase"] == "b" and r["arm"] == "none"})
    arms = [a for a in (*order, *READOUTS) if a != "none" and (a not in READOUTS or READOUTS[a] in order)
            and any((s, a) in ran for s in every)]
    seeds = [s for s in every if all((s, a) in ran for a in arms)]  # a seed cut off before every arm ran: left out
    steps = sorted({r["step"] for r in rows if r["phase"] == "b" and r["arm"] == "none" and r["seed"] in seeds})
    steps = [st for st in steps if all((s, "none", "b", st) in by for s in seeds)]
    base = {s: by[(s, "base", "base", 0)] for s in seeds}
    after = {s: by[(s, "after-a", "after-a", 0)] for s in seeds}
    kept = {st: [e1_stats.kept_fraction(base[s]["acc_a"], after[s]["acc_a"], by[(s, "none", "b", st)]["acc_a"])
                 for s in seeds] for st in steps}
    cut = [s for s in every if s not in seeds]
    lines = [f"Seeds: {seeds} (n = {len(seeds)})" + (f"; cut off before every arm ran, left out: {cut}." if cut
                                                       else "."), "",
             "| B step | none: A acc (mean, per seed) | kept fraction | B acc | B NLL |", "|---|---|---|---|---|"]
    for st in steps:
        r = [by[(s, "none", "b", st)] for s in seeds]
        per = ", ".join(f"{x['acc_a']:.3f}" for x in r)
        lines.append(f"| {st} | {_mean(x['acc_a'] for x in r):.3f} ({per}) | "
                     f"{_mean(kept[st]):.2f} | {_mean(x['acc_b'] for x in r):.3f} | "
                     f"{_mean(x['nll_b'] for x in r):.3f} |")
    lines += ["", "Forgetting curves, every arm (mean over seeds: A acc / A NLL / B NLL):", "",
              "| B step | " + " | ".join(("none", *arms)) + " |", "|---|" + "---|" * (len(arms) + 1)]
    for st in steps:
        cells = []
        for a in ("none", *arms):
            r = [by[(s, a, "b", st)] for s in seeds if (s, a, "b", st) in by]
            cells.append(f"{_mean(x['acc_a'] for x in r):.3f} / {_mean(x['nll_a'] for x in r):.2f} / "
                         f"{_mean(x['nll_b'] for x in r):.2f}" if r else "–")
        lines.append(f"| {st} | " + " | ".join(cells) + " |")
    stage0 = length is None
    if stage0:
        length = e1_stats.choose_length(kept)
    lines += ["", f"Before B: A acc {_mean(after[s]['acc_a'] for s in seeds):.3f}, A NLL "
              f"{_mean(after[s]['nll_a'] for s in seeds):.3f}; base A acc "
              f"{_mean(base[s]['acc_a'] for s in seeds):.3f}, "
              f"A NLL {_mean(base[s]['nll_a'] for s in seeds):.3f}.",
              f"B's length by the rule (none keeps 20–80 %, closest to 50 %): {length}." if stage0 else
              f"B's length, fixed before the runs: {length}.", ""]
    if not arms:
        return "\n".join(lines)
    if length is None:
        lines.append("No checkpoint in the window: the gate is not met at these lengths.")
    else:
        what = "the rule's length" if stage0 else "the pre-registered length"
        lines += compare_at(by, seeds, arms, steps, length, after, what, stage0)
    if steps and steps[-1] != length:
        lines += ["", *compare_at(by, seeds, arms, steps, steps[-1], after, "the end of B (secondary)", stage0)]
    return "\n".join(lines)


def compare_at(by: dict, seeds: list[int], arms: list[str], steps: list[int], length: int, after: dict,
               what: str, stop_rule: bool = True) -> list[str]:
    """The paired arm-vs-none tables at B step ``length``: equal B steps, then equal B loss (each curve starts at
    the pre-B state, step 0)."""
    full = [s for s in seeds if all((s, a, "b", length) in by for a in arms)]
    if len(full) < 2:
        return [f"At B step {length} ({what}): fewer than 2 seeds with every arm."]
    lines = [f"At B step {length}, {what} (equal B steps), arm − none, paired over seeds {full}:", "",
             "| arm | A acc | NLL_A − none's (= ΔNLL_A − none's) | B acc | B NLL |", "|---|---|---|---|---|"]
    ends = {"A acc": "acc_a", "nll": "nll_a", "B acc": "acc_b", "B nll": "nll_b"}
    res = {k: e1_stats.compare_arms({a: [by[(s, a, "b", length)][f] - by[(s, "none", "b", length)][f] for s in full]
                                     for a in arms}) for k, f in ends.items()}
    for a in arms:
        lines.append(f"| {a} | " + " | ".join(e1_stats.fmt_test(res[k][a]) for k in ends) + " |")
    eq = {}
    for s in full:
        start = (after[s]["nll_b"], after[s]["acc_a"])  # step 0: the shared pre-B state
        curves = {a: [start] + [(by[(s, a, "b", st)]["nll_b"], by[(s, a, "b", st)]["acc_a"]) for st in steps
                                if (s, a, "b", st) in by and st <= length] for a in ("none", *arms)}
        target = max(c[-1][0] for c in curves.values())
        eq[s] = {a: e1_stats.at_equal_loss(c, target) for a, c in curves.items()}
    eq_res = e1_stats.compare_arms({a: [eq[s][a] - eq[s]["none"] for s in full] for a in arms})
    lines += ["", f"At equal B loss (the seed's largest B NLL at step {length}), A acc, arm − none:", "",
              "| arm | A acc at equal B loss |" + (" stop rule: mean gain ≥ +0.10 |" if stop_rule else ""),
              "|---|---|" + ("---|" if stop_rule else "")]
    for a in arms:
        rule = (f" {'passes' if eq_res[a]['mean'] >= e1_stats.STOP_RULE_GAIN else 'fails'}"
                f"{' (and claimed)' if eq_res[a]['claimed'] else ' (not claimed)'} |") if stop_rule else ""
        lines.append(f"| {a} | {e1_stats.fmt_test(eq_res[a])} |" + rule)
    per_seed = []
    for s in full:
        cells = [f"{a} {by[(s, a, 'b', length)]['acc_a']:.3f}/{_f(eq[s][a])}" for a in ("none", *arms)]
        per_seed.append(f"s{s}: " + ", ".join(cells))
    return lines + ["", "Per seed (A acc at that step / at equal B loss): " + "; ".join(per_seed)]


def _f(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def _mean(xs) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


def same_pre_b(rows: list[dict], earlier: list[dict], step: int) -> str:
    """Which seeds start B from the very state ``earlier`` (Stage 0's rows) did: the after-A row and the none arm's
    row at ``step`` equal (every figure, exactly); only there may Stage 0's arms be read beside these."""
    def key(rs: list[dict], seed: int, arm: str, st: int) -> tuple | None:
        hit = [r for r in rs if r["seed"] == seed and r["arm"] == arm and r["step"] == st]
        return tuple(hit[0][f] for f in ("acc_a", "nll_a", "acc_b", "nll_b")) if hit else None

    seeds = sorted({r["seed"] for r in rows if r["arm"] == "after-a"})
    same = [s for s in seeds if key(rows, s, "after-a", 0) is not None
            and key(rows, s, "after-a", 0) == key(earlier, s, "after-a", 0)
            and key(rows, s, "none", step) == key(earlier, s, "none", step)]
    return (f"Seeds whose pre-B state and none arm at step {step} equal Stage 0's exactly: {same} "
            f"(of {seeds}); Stage 0's oracles and replay at those seeds are the same comparison.")


def load_overlap(out: Path) -> tuple[list[dict], str | None]:
    """The rows of the ``overlap`` measurement kept in ``<out>/overlap.jsonl`` and the pair it chose."""
    rows = [json.loads(x) for x in (out / "overlap.jsonl").read_text().splitlines() if x.strip()]
    return rows, next((r["pair"] for r in rows if r.get("chosen")), None)


def overlap_table(rows: list[dict], chosen: str | None) -> str:
    """A's vs B's answer-token routing on the warm base, per pair: mean JS distance and intersection, per layer."""
    lines = ["| A vs B | JS distance, mean (per layer) | intersection, mean (per layer) | B acc / NLL on the base "
             "| can run |", "|---|---|---|---|---|"]
    for r in rows:
        js, inter = ", ".join(f"{x:.3f}" for x in r["js"]), ", ".join(f"{x:.3f}" for x in r["intersection"])
        nll = f" / {r['base_nll_b']:.2f}" if "base_nll_b" in r else ""
        lines.append(f"| {r['pair']} | {r['js_mean']:.3f} ({js}) | {r['intersection_mean']:.3f} ({inter}) | "
                     f"{r['base_acc_b']:.3f}{nll} | {'yes' if r['runnable'] else 'no'} |")
    return "\n".join(lines + ["", f"Chosen by the pre-registered rule: {chosen or 'none (no pair qualifies)'}."])


def none_beside(rows: list[dict], earlier: list[dict], arms: tuple[str, ...],
                labels: tuple[str, str] = ("this pair", "T1 -> T2")) -> str:
    """Descriptive, not a test (B or the regime differs): the none arm's curve here beside ``earlier``'s (``labels``:
    here, there) at the seeds both ran (here: every one of ``arms``), and at which of them the pre-B state is the
    same (after-A rows equal)."""
    def get(rs: list[dict], seed: int, arm: str, step: int) -> dict | None:
        return next((r for r in rs if r["seed"] == seed and r["arm"] == arm and r["step"] == step), None)

    seeds = sorted(set(e1_stats.complete_seeds(rows, arms)[0]) & {r["seed"] for r in earlier if r["arm"] == "none"})
    if not seeds:
        return f"None beside {labels[1]}: no seed (unit) ran in both."
    same = [s for s in seeds if get(rows, s, "after-a", 0) is not None and
            all(get(rows, s, "after-a", 0)[f] == get(earlier, s, "after-a", 0)[f] for f in ("acc_a", "nll_a"))]
    steps = sorted({r["step"] for r in rows if r["arm"] == "none" and r["phase"] == "b"})
    lines = [f"None beside {labels[1]} at seeds {seeds} (the same pre-B state at {same}); mean A acc / B acc / "
             "B NLL:", "", f"| B step | {labels[0]} | {labels[1]} |", "|---|---|---|"]
    for st in steps:
        cells = []
        for rs in (rows, earlier):
            got = [get(rs, s, "none", st) for s in seeds]
            got = [g for g in got if g is not None]
            cells.append(" / ".join(f"{_mean(g[f] for g in got):.3f}" for f in ("acc_a", "acc_b", "nll_b"))
                         if len(got) == len(seeds) else "–")
        lines.append(f"| {st} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
