"""The run report: ``runs/<id>/report/report.md`` plus ``loss.png``, ``routing.png`` and ``tasks.png``.

Owns: reading a run directory's records (``metrics.jsonl``, ``run.json`` and the coordinator's accountant
record ``privacy/ledger.json``), the interpretation of the event schema for display (``train``, ``stats``,
``eval``, ``rl``, ``party_error``; anything else is ignored), number formatting ("–" for missing), the plots,
and :func:`summarise` (the final aggregate eval metrics, reused by results tables).

What it shows: one run id (``run.name``, which ``distmoe simulate`` sets to the run directory's name, else
the directory's name; Flower's run id only as a detail); a privacy section (epsilon spent per party against
the budget, the releases each party's data went into, every refusal and skipped round); training losses as
the run released them: per party only in the plaintext baseline, under secure aggregation the mean task loss
over the contributing parties (``distmoe.privacy.train_metrics``) and no per-party figure; a loss line
is never drawn across rounds that did not train; retention is plotted against its collapse threshold
(``RETENTION_COLLAPSE``) and a collapse is named in the text. The text shows numbers and closed-set labels of
``privacy/ledger.json`` only (never its free strings): the audit re-renders ``report.md`` and compares.

Must not: import ``flwr`` or ``torch``, read models, checkpoints, anchors or data, or crash on a run
that stopped halfway (missing keys, ``null`` values, absent events: plot and tabulate what exists). The
only hard errors are a missing ``metrics.jsonl`` and a corrupt line in its middle.

Plots use matplotlib's Agg canvas directly (``Figure`` + ``FigureCanvasAgg``, no ``pyplot``): no global
backend switch in the importing process, no figure registry to leak, safe off the main thread.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from distmoe.io import sanitize, write_text_atomic
from distmoe.report.metrics_log import read_metrics

__all__ = ["write_report", "render_markdown", "summarise", "HEALTHY_LOAD_CV"]

log = logging.getLogger(__name__)

AGG = "all"
HEALTHY_LOAD_CV = 0.2
DASH = "–"
FIGSIZE = (6.0, 3.5)
FIGSIZE_WIDE = (8.0, 3.5)
DPI = 110
MAX_PARTY_LEGEND = 8  # more parties than this share one legend entry
RETENTION_COLLAPSE = 0.5  # retention below this: the task is mostly forgotten (named in the report)
RELEASE_KINDS = ("router-stats", "model-update", "rl-update", "eval")  # labels of the accountant's events
REFUSAL_REASONS = {"too-few-contributors": "fewer contributing parties than privacy.min-parties"}
PARTY_LOG = "`<work-dir>/metrics/<party>.jsonl`"  # where a party keeps its own training metrics
_LABEL = re.compile(r"[A-Za-z0-9_.:/*+-]{1,64}\Z")

# ----------------------------------------------------------------------------------------------------
# Value helpers


def _count(v: Any) -> int | float | None:
    """An int stays an int (shown without decimals); other numbers as :func:`_num`."""
    return v if isinstance(v, int) and not isinstance(v, bool) else _num(v)


def _num(v: Any) -> float | None:
    """A finite float, or None for anything else (null, NaN, strings, bools)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _round_of(ev: Mapping[str, Any]) -> int | None:
    r = _num(ev.get("round"))
    return int(r) if r is not None else None


def _party_of(ev: Mapping[str, Any]) -> str:
    p = ev.get("party", AGG)
    return AGG if p is None else str(p)


def fmt(v: Any) -> str:
    """Format for the report: ints as is, floats to 4 significant digits, missing as "–"."""
    if v is None:
        return DASH
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else DASH
    s = str(v)
    return s if s else DASH


def _cell(v: Any) -> str:
    return fmt(v).replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def _arrow(a: Any, b: Any) -> str:
    if _num(a) is None and _num(b) is None:
        return DASH
    return f"{fmt(_num(a))} → {fmt(_num(b))}"


# ----------------------------------------------------------------------------------------------------
# Loading


@dataclass
class _Run:
    run_dir: Path
    record: dict[str, Any]
    record_problem: str | None
    events: list[dict[str, Any]]
    skipped_lines: int
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    stats: list[dict[str, Any]] = field(default_factory=list)
    rl: list[dict[str, Any]] = field(default_factory=list)
    party_errors: list[dict[str, Any]] = field(default_factory=list)
    probes: list[dict[str, Any]] = field(default_factory=list)  # the routing probe, aggregate rows (every round)
    accounts: dict[str, Any] = field(default_factory=dict)  # privacy/ledger.json, {} when absent or unreadable

    @property
    def run_id(self) -> str:
        """The run's one id: ``run.name`` (``distmoe simulate`` sets it to the directory's name), else the
        directory's name, the id every command takes (``report``, ``audit``, ``--resume``)."""
        name = self.record.get("name")
        return str(name) if isinstance(name, str) and _LABEL.match(name) else self.run_dir.name

    @property
    def flower_run_id(self) -> str | None:
        """Flower's id of the run (a detail: the ledger and the parties' accountants are keyed by it)."""
        rid = self.record.get("run_id")
        if not rid:
            rid = next((e.get("run_id") for e in self.events if e.get("event") == "run_start"), None)
        return str(rid) if rid else None

    @property
    def secure(self) -> bool:
        """Secure aggregation: from the run record, else from the train rows (``contributors``, not examples)."""
        priv = self.record.get("privacy")
        if isinstance(priv, Mapping) and isinstance(priv.get("secure_aggregation"), bool):
            return priv["secure_aggregation"]
        return any("contributors" in e for e in self.train + self.rl)

    @property
    def status(self) -> str:
        st = self.record.get("status")
        if st:
            return str(st)
        end = next((e for e in reversed(self.events) if e.get("event") == "run_end"), None)
        if end is not None:
            return str(end.get("status") or "ended")
        return "unknown"

    def agg_evals(self) -> list[dict[str, Any]]:
        return [e for e in self.evals if _party_of(e) == AGG]

    def parties(self) -> list[str]:
        seen: dict[str, None] = {}
        for e in self.train + self.evals:
            p = _party_of(e)
            if p != AGG:
                seen.setdefault(p, None)
        return sorted(seen, key=_natural_key)

    def tasks(self) -> list[str]:
        """Tasks in training order, then any seen only in eval keys."""
        seen: dict[str, None] = {}
        for e in self.train:
            t = e.get("task")
            if t:
                seen.setdefault(str(t), None)
        for e in self.evals:
            for k in e:
                prefix, sep, task = k.partition("/")
                if sep and task and prefix in ("acc", "loss", "n", "retention"):
                    seen.setdefault(task, None)
        return list(seen)


def _natural_key(s: str) -> tuple[Any, ...]:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s))


def _by_round(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events with a round, sorted by round (stable: a later duplicate stays later)."""
    return sorted((e for e in events if _round_of(e) is not None), key=lambda e: _round_of(e))


def _load(run_dir: Path) -> _Run:
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"run has no metrics log: {metrics_path}")
    events = read_metrics(metrics_path)
    record: dict[str, Any] = {}
    problem = None
    rec_path = run_dir / "run.json"
    if rec_path.is_file():
        try:
            loaded = json.loads(rec_path.read_text(encoding="utf-8"))
            if isinstance(loaded, dict):
                record = loaded
            else:
                problem = f"{rec_path.name} is not a JSON object"
        except (OSError, ValueError) as exc:
            problem = f"{rec_path.name} unreadable: {exc}"
    else:
        problem = f"{rec_path.name} missing"
    run = _Run(run_dir, record, problem, list(events), events.skipped)
    for e in run.events:
        kind = e.get("event")
        if kind == "train":
            run.train.append(e)
        elif kind == "eval":
            run.evals.append(e)
        elif kind == "stats":
            run.stats.append(e)
        elif kind == "rl":
            run.rl.append(e)
        elif kind == "party_error":
            run.party_errors.append(e)
        elif kind == "probe":
            run.probes.append(e)
    run.train = _by_round(run.train)
    run.rl = _by_round(run.rl)
    run.evals = _by_round(run.evals)
    run.stats = _by_round(run.stats)
    run.probes = _by_round(run.probes)
    accounts = run_dir / "privacy" / "ledger.json"
    if accounts.is_file():
        try:
            loaded = json.loads(accounts.read_text(encoding="utf-8"))
            run.accounts = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError) as exc:
            log.warning("%s unreadable: %s", accounts, exc)
    return run


def _last_agg_eval(run: _Run) -> dict[str, Any] | None:
    ev = run.agg_evals()
    return ev[-1] if ev else None


def summarise(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The final aggregate eval metrics: a copy of the last ``eval`` event with ``party == "all"``.

    Non-finite numbers come back as ``None``; an empty dict means the run never evaluated.
    Raises FileNotFoundError when ``metrics.jsonl`` is missing.
    """
    last = _last_agg_eval(_load(Path(run_dir)))
    return sanitize(last) if last else {}


# ----------------------------------------------------------------------------------------------------
# Train table (aggregate rows, derived from party rows when the aggregate was never logged)


def _weighted(rows: list[dict[str, Any]], key: str) -> float | None:
    pairs = [(_num(r.get(key)), _num(r.get("num_examples"))) for r in rows]
    pairs = [(v, w if w and w > 0 else 1.0) for v, w in pairs if v is not None]
    if not pairs:
        return None
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total


def _train_rows(run: _Run) -> tuple[list[dict[str, Any]], bool]:
    """One aggregate row per round; the flag says whether any row was derived from party events."""
    agg: dict[int, dict[str, Any]] = {}
    parties: dict[int, list[dict[str, Any]]] = {}
    for e in run.train:
        r = _round_of(e)
        if _party_of(e) == AGG:
            agg[r] = e  # a later duplicate (e.g. a resumed round) wins
        else:
            parties.setdefault(r, []).append(e)
    derived = False
    rows = []
    for r in sorted(set(agg) | set(parties)):
        if r in agg:
            rows.append(dict(agg[r], _derived=False))
            continue
        prs = parties[r]
        skipped = [s for s in (_num(p.get("skipped_steps")) for p in prs) if s is not None]
        rows.append(
            {
                "round": r,
                "phase_label": prs[0].get("phase_label"),
                "task": prs[0].get("task"),
                "loss": _weighted(prs, "loss"),
                "loss_first": _weighted(prs, "loss_first"),
                "loss_last": _weighted(prs, "loss_last"),
                "aux_loss": _weighted(prs, "aux_loss"),
                "anchor_kl": _weighted(prs, "anchor_kl"),
                "skipped_steps": int(sum(skipped)) if skipped else None,
                "num_examples": int(sum(_num(p.get("num_examples")) or 0 for p in prs)),
                "_derived": True,
            }
        )
        derived = True
    return rows, derived


# ----------------------------------------------------------------------------------------------------
# Plots


def _figure(figsize: tuple[float, float], ncols: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _save(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    write_text_atomic(path, buf.getvalue())


def _no_data(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.45", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


def _series(events: Iterable[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(rounds, values) for the events where ``key`` is a finite number; a later duplicate round wins."""
    by_round: dict[int, float] = {}
    for e in events:
        v = _num(e.get(key))
        r = _round_of(e)
        if v is not None and r is not None:
            by_round[r] = v
    xs = sorted(by_round)
    return xs, [by_round[x] for x in xs]


def _rounds(events: Iterable[Mapping[str, Any]]) -> list[int]:
    return sorted({r for r in (_round_of(e) for e in events) if r is not None})


def _style(ax, title: str, ylabel: str, rounds: Sequence[int] = (), xlabel: str = "round") -> None:
    """Title, labels, grid and integer round ticks over ``rounds`` (so one point still gets a sane axis)."""
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(True, alpha=0.3, linewidth=0.5)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if rounds:
        lo, hi = min(rounds), max(rounds)
        pad = max(0.5, 0.03 * (hi - lo))
        ax.set_xlim(lo - pad, hi + pad)


def _marker(n: int) -> str | None:
    return "o" if n <= 40 else None


def _legend(ax) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(fontsize=7, ncols=1 if len(handles) <= 5 else 2, framealpha=0.8)


def _broken(xs: list[int], ys: list[float], task_of: Mapping[int, Any] | None) -> tuple[list[int], list[float]]:
    """``(xs, ys)`` with a NaN (a gap in the line) between two rounds that are not consecutive rounds of one
    task: no line is drawn across a statistics, evaluation or skipped round, nor from one task to the next."""
    if task_of is None or not xs:
        return xs, ys
    out_x, out_y = [xs[0]], [ys[0]]
    for i in range(1, len(xs)):
        a, b = xs[i - 1], xs[i]
        if b != a + 1 or task_of.get(a) != task_of.get(b):
            out_x.append(a)
            out_y.append(math.nan)
        out_x.append(b)
        out_y.append(ys[i])
    return out_x, out_y


def _party_lines(ax, run: _Run, events: list[dict[str, Any]], key: str, thin: bool,
                 task_of: Mapping[int, Any] | None = None) -> int:
    """Plot one line per party; return how many had data. ``task_of`` (round -> task): break the lines
    between rounds that are not consecutive rounds of one task (:func:`_broken`)."""
    parties = run.parties()
    many = len(parties) > MAX_PARTY_LEGEND
    drawn = 0
    for i, p in enumerate(parties):
        xs, ys = _series((e for e in events if _party_of(e) == p), key)
        if not xs:
            continue
        label = None if many and drawn else (f"parties ({len(parties)})" if many else p)
        xs, ys = _broken(xs, ys, task_of)
        ax.plot(
            xs,
            ys,
            marker=_marker(len(xs)),
            markersize=2.5 if thin else 3.5,
            linewidth=0.8 if thin else 1.2,
            alpha=0.6 if thin else 0.85,
            color="0.55" if many else f"C{i % 10}",
            label=label,
        )
        drawn += 1
    return drawn


def _agg_line(ax, events: list[dict[str, Any]], key: str, label: str = "all",
              task_of: Mapping[int, Any] | None = None) -> int:
    xs, ys = _series((e for e in events if _party_of(e) == AGG), key)
    n = len(xs)
    if xs:
        xs, ys = _broken(xs, ys, task_of)
        ax.plot(xs, ys, color="black", linewidth=2.2, marker=_marker(n), markersize=4, label=label, zorder=5)
    return n


def _task_boundaries(ax, rows: list[dict[str, Any]]) -> None:
    """Dotted vertical line + label where the training task changes."""
    prev = None
    for row in rows:
        task = row.get("task")
        if task is not None and task != prev:
            r = _round_of(row)
            if prev is not None:
                ax.axvline(r - 0.5, color="0.5", linestyle=":", linewidth=0.9)
            label = ax.annotate(
                str(task),
                xy=(r, 1.0),
                xycoords=ax.get_xaxis_transform(),
                xytext=(2, -3),
                textcoords="offset points",
                fontsize=7,
                va="top",
                ha="left",
                color="0.35",
                annotation_clip=True,
            )
            label.set_in_layout(False)  # a long task name must not squeeze the axes
            prev = task


def _plot_loss(run: _Run, rows: list[dict[str, Any]], path: Path) -> None:
    """Train loss per round (lines broken between non-consecutive training rounds; under secure aggregation the
    released mean task loss); where no loss was released, the contributing parties per training round."""
    fig, (ax,) = _figure(FIGSIZE)
    title = f"Train loss per round — {run.run_id}"
    task_of = {_round_of(r): r.get("task") for r in rows}
    key = "loss" if any(_num(e.get("loss")) is not None for e in run.train) else "task_loss"  # secure: the slot
    n = _party_lines(ax, run, run.train, key, thin=False, task_of=task_of) + _agg_line(
        ax, run.train, key, "all (weighted)" if key == "loss" else "mean over contributing parties", task_of=task_of
    )
    if n:
        _style(ax, title, key.replace("_", " "), _rounds(run.train))
        _task_boundaries(ax, rows)
        _legend(ax)
    elif run.secure and rows:
        xs = [_round_of(r) for r in rows]
        ys = [_num(r.get("contributors", r.get("parties"))) or 0 for r in rows]
        ax.bar(xs, ys, width=0.6, color="0.6", label="contributing parties")
        _style(ax, f"Training rounds — {run.run_id}", "contributing parties", xs)
        from matplotlib.ticker import MaxNLocator

        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        _task_boundaries(ax, rows)
        ax.text(0.5, 0.04, "training losses are not released under secure aggregation:\n"
                "each party's own log, <work-dir>/metrics/<party>.jsonl", ha="center", va="bottom",
                transform=ax.transAxes, fontsize=7, color="0.3",
                bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "0.8"})
    else:
        ax.set_title(title, fontsize=10)
        _no_data(ax, "no train rounds logged")
    _save(fig, path)


def _plot_probe(run: _Run, path: Path) -> None:
    """``routing.png`` from the routing probe (every round): KL to the anchor, load CV, top-1 consistency."""
    fig, axes = _figure((10.5, 3.5), 3)
    rounds = _rounds(run.probes)
    warn = _num(_config_value(run, "routing.load-cv-warn"))
    for ax, key, title, ylabel, empty in (
            (axes[0], "routing_kl", "Routing KL to anchor (probe)", "KL (nats)", "no anchor yet"),
            (axes[1], "load_cv", "Expert-load CV (probe)", "coefficient of variation", "no probe"),
            (axes[2], "top1_consistency", "Top-1 consistency with previous round", "fraction", "one probe only")):
        if not _agg_line(ax, run.probes, key, label="probe"):
            ax.set_title(title, fontsize=10)
            _no_data(ax, empty)
            continue
        _style(ax, title, ylabel, rounds)
        _task_boundaries(ax, run.train + run.rl)
        if key == "load_cv":
            ax.axhline(HEALTHY_LOAD_CV, color="tab:green", linestyle="--", linewidth=1.0,
                       label=f"healthy < {HEALTHY_LOAD_CV:g}")
            if warn:
                ax.axhline(warn, color="tab:red", linestyle=":", linewidth=1.0, label=f"warn > {warn:g}")
        ax.set_ylim(bottom=0)
        _legend(ax)
    _save(fig, path)


def _config_value(run: _Run, key: str) -> Any:
    cfg = run.record.get("config")
    return cfg.get(key) if isinstance(cfg, Mapping) else None


def _plot_routing(run: _Run, path: Path) -> None:
    if run.probes:
        return _plot_probe(run, path)
    fig, (ax_kl, ax_cv) = _figure(FIGSIZE_WIDE, 2)
    n = _party_lines(ax_kl, run, run.evals, "routing_kl", thin=True) + _agg_line(
        ax_kl, run.evals, "routing_kl"
    )
    if n:
        _style(ax_kl, "Routing KL to anchor", "KL (nats)", _rounds(run.evals))
        ax_kl.set_ylim(bottom=0)
        _legend(ax_kl)
    else:
        ax_kl.set_title("Routing KL to anchor", fontsize=10)
        _no_data(ax_kl, "no anchor yet")
    n = _party_lines(ax_cv, run, run.evals, "load_cv", thin=True) + _agg_line(ax_cv, run.evals, "load_cv")
    if n:
        _style(ax_cv, "Expert-load CV", "coefficient of variation", _rounds(run.evals))
        ax_cv.axhline(
            HEALTHY_LOAD_CV,
            color="tab:green",
            linestyle="--",
            linewidth=1.0,
            label=f"healthy < {HEALTHY_LOAD_CV:g}",
        )
        ax_cv.set_ylim(bottom=0)
        _legend(ax_cv)
    else:
        ax_cv.set_title("Expert-load CV", fontsize=10)
        _no_data(ax_cv, "no eval rounds logged")
    _save(fig, path)


def _plot_rl(run: _Run, path: Path) -> None:
    """Reward under the inference engine, and the train/inference mismatch, per RL round."""
    fig, (ax_r, ax_m) = _figure(FIGSIZE_WIDE, 2)
    n = _party_lines(ax_r, run, run.rl, "reward", thin=True) + _agg_line(ax_r, run.rl, "reward")
    _style(ax_r, "RL reward (inference engine)", "mean reward", _rounds(run.rl))
    if n:
        _legend(ax_r)
    n = 0
    for key, label, color in (("logp_diff_mean", "mean |dlogp|", "tab:blue"), ("k3", "K3 KL", "tab:orange"),
                              ("masked_frac_low", "masked share (k < low)", "tab:red"),
                              ("masked_frac_high", "masked share (k > high)", "tab:purple")):
        xs, ys = _series((e for e in run.rl if _party_of(e) == AGG), key)
        if xs:
            ax_m.plot(xs, ys, color=color, linewidth=1.8, marker=_marker(len(xs)), markersize=4, label=label)
            n += len(xs)
    _style(ax_m, "Train/inference mismatch (aggregate)", "value", _rounds(run.rl))
    if n:
        _legend(ax_m)
    _save(fig, path)


def _rl_table(run: _Run) -> list[str]:
    if not run.rl:
        return []
    rows = [(_round_of(e), e.get("task"), _arrow(e.get("reward_first"), e.get("reward_last")), e.get("logp_diff_mean"),
             e.get("logp_diff_max"), e.get("k3"), e.get("masked_frac_low"), e.get("masked_frac_high"),
             e.get("seq_masked_frac"), e.get("clip_frac"), e.get("masked_entropy"), e.get("skipped_steps"))
            for e in run.rl if _party_of(e) == AGG]
    head = ("round", "task", "reward first → last", "mean |Δlogp|", "max |Δlogp|", "K3", "masked low",
            "masked high", "seqs w/ masked", "clip frac", "masked-token entropy", "skipped")
    eng = next((e for e in run.rl if e.get("engine")), {})
    note = f"Engine `{eng.get('engine', '–')}`, correction `{eng.get('correction', '–')}`."
    return ["## RL rounds (aggregate)", "", note, "", *_table(head, rows), "", "![rl](rl.png)", ""]


def _plot_per_task(ax, agg, tasks: list[str], metric: str) -> int:
    """One line per task of ``<metric>/<task>``; returns how many were drawn."""
    drawn = 0
    for i, t in enumerate(tasks):
        xs, ys = _series(agg, f"{metric}/{t}")
        if xs:
            ax.plot(xs, ys, marker=_marker(len(xs)), markersize=5, linewidth=1.8, color=f"C{i % 10}", label=t,
                    zorder=4)
            drawn += 1
    return drawn


def _plot_tasks(run: _Run, tasks: list[str], path: Path) -> None:
    fig, (ax_acc, ax_ret) = _figure(FIGSIZE_WIDE, 2)
    agg = run.agg_evals()
    if _plot_per_task(ax_acc, agg, tasks, "acc"):
        _style(ax_acc, "Accuracy per task (aggregate)", "accuracy", _rounds(agg))
        lo, hi = ax_acc.get_ylim()  # DP-noised figures may leave [0, 1]: keep every point in view
        ax_acc.set_ylim(min(-0.02, lo), max(1.05, hi))
        _legend(ax_acc)
    else:
        ax_acc.set_title("Accuracy per task (aggregate)", fontsize=10)
        _no_data(ax_acc, "no aggregate eval logged")
    if _plot_per_task(ax_ret, agg, tasks, "retention"):
        _style(ax_ret, "Retention of earlier tasks", "retention (acc now / before)", _rounds(agg))
        ax_ret.axhline(1.0, color="0.6", linestyle=":", linewidth=0.8)
        lo, hi = ax_ret.get_ylim()
        ax_ret.set_ylim(min(-0.08, lo), max(1.15, hi))  # a retention of 0 sits above the axis, not on it
        ax_ret.axhspan(ax_ret.get_ylim()[0], RETENTION_COLLAPSE, color="tab:red", alpha=0.08, zorder=0,
                       label=f"collapse < {RETENTION_COLLAPSE:g}")
        for i, t in enumerate(tasks):  # the last value of each task, written next to its point
            xs, ys = _series(agg, f"retention/{t}")
            if xs:
                ax_ret.annotate(f"{ys[-1]:.2f}", (xs[-1], ys[-1]), xytext=(4, 4), textcoords="offset points",
                                fontsize=7, color=f"C{i % 10}")
        _legend(ax_ret)
    else:
        ax_ret.set_title("Retention of earlier tasks", fontsize=10)
        _no_data(ax_ret, "no retention yet\n(needs a later task trained)")
    _save(fig, path)


# ----------------------------------------------------------------------------------------------------
# Markdown


def _parse_time(v: Any) -> datetime | None:
    if _num(v) is not None:
        try:
            return datetime.fromtimestamp(float(v), tz=UTC)  # UTC: the same text on every machine
        except (OverflowError, OSError, ValueError):
            return None
    if isinstance(v, str) and v:
        try:
            return datetime.fromisoformat(v)
        except ValueError:
            return None
    return None


def _duration(a: Any, b: Any) -> str | None:
    ta, tb = _parse_time(a), _parse_time(b)
    if ta is None or tb is None or (ta.tzinfo is None) != (tb.tzinfo is None):
        return None
    s = (tb - ta).total_seconds()
    if s < 0:
        return None
    h, rem = divmod(int(round(s)), 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h {m:02d}m {sec:02d}s" if h else f"{m}m {sec:02d}s"


def _show_time(v: Any) -> str:
    if _num(v) is not None:
        t = _parse_time(v)
        return t.isoformat(timespec="seconds") if t else fmt(v)
    return fmt(v)


def _round_kinds(run: _Run) -> str:
    """``13 (6 training, 1 statistics, 2 evaluation)``: the distinct rounds of each kind that were logged."""
    kinds = [("training", run.train), ("RL", run.rl), ("statistics", run.stats), ("evaluation", run.evals)]
    counts = [(name, len({_round_of(e) for e in evs})) for name, evs in kinds]
    total = len({_round_of(e) for _, evs in kinds for e in evs})
    skipped = len({_round_of(e) for e in run.train + run.rl if e.get("skipped") is True and _party_of(e) == AGG})
    parts = ", ".join(f"{n} {name}" for name, n in counts if n) + (f"; {skipped} skipped" if skipped else "")
    return f"{total} ({parts})" if parts else "0"


def _header(run: _Run) -> list[str]:
    rec = run.record
    out = [f"# Run report: `{run.run_id}` — {run.status}", ""]
    priv = rec.get("privacy") if isinstance(rec.get("privacy"), Mapping) else {}
    n_parties = _count(priv.get("n_parties")) if priv else None
    if n_parties is None and isinstance(rec.get("parties"), Mapping) and rec["parties"]:
        n_parties = len(rec["parties"])
    if n_parties is None and run.parties():  # the plaintext baseline: its per-party rows
        n_parties = len(run.parties())
    info = [
        ("run", f"`{run.run_id}`"),
        ("status", run.status),
        ("started", _show_time(rec.get("started"))),
        ("finished", _show_time(rec.get("finished"))),
        ("duration", _duration(rec.get("started"), rec.get("finished"))),
        ("rounds logged", _round_kinds(run)),
        ("parties", n_parties),
    ]
    out += [f"- **{k}**: {fmt(v)}" for k, v in info]
    if run.flower_run_id and run.flower_run_id != run.run_id:
        out.append(f"- detail: Flower's run id `{run.flower_run_id}` (the ledgers' `run` field)")
    if run.skipped_lines:
        out.append(f"- **note**: skipped {run.skipped_lines} partial trailing line(s) of `metrics.jsonl`")
    if run.record_problem:
        out.append(f"- **note**: {run.record_problem}")
    out.append("")
    error = rec.get("error")
    if error:
        text = str(error)
        if len(text) > 4000:
            text = text[:4000] + "\n… (truncated)"
        out += ["## Error", "", "```", text.replace("```", "'''"), "```", ""]
    return out


def _warnings(run: _Run) -> list[str]:
    warnings = run.record.get("warnings") or []
    if isinstance(warnings, str):
        warnings = [warnings]
    out = ["## Warnings", ""]
    if warnings:
        out += [f"- {str(w).strip()}" for w in warnings]
    else:
        out.append("None.")
    return out + [""]


def _anomalies(run: _Run) -> list[str]:
    """Flagged aggregate metrics (non-finite, or beyond ``federation.anomaly-z`` rolling z-scores) and
    rejected aggregates, from the run record and the metrics log."""
    items = [a for a in run.record.get("anomalies") or [] if isinstance(a, dict)]
    if not items:
        return []
    out = ["## Anomalies", ""]
    out += [f"- round {a.get('round', '–')}: {str(a.get('detail', '')).strip()}" for a in items]
    return out + [""]


def _schedule(run: _Run) -> list[str]:
    sched = run.record.get("schedule") or []
    if isinstance(sched, str):
        sched = [sched]
    out = ["## Schedule", ""]
    if sched:
        out += [f"{i}. `{s}`" for i, s in enumerate(sched, 1)]
    else:
        out.append(DASH)
    return out + [""]


def _final_eval(run: _Run, tasks: list[str]) -> list[str]:
    last = _last_agg_eval(run)
    out = ["## Final evaluation (aggregate)", ""]
    if last is None:
        return out + ["No aggregate eval logged.", ""]
    out.append(f"Round {fmt(_round_of(last))}.")
    out.append("")
    rows = [
        (
            t,
            _num(last.get(f"acc/{t}")),
            _num(last.get(f"loss/{t}")),
            _count(last.get(f"n/{t}")),
            _num(last.get(f"retention/{t}")),
        )
        for t in tasks
        if any(f"{p}/{t}" in last for p in ("acc", "loss", "n", "retention"))
    ]
    out += _table(("task", "accuracy", "loss", "n", "retention"), rows) if rows else ["No per-task metrics."]
    out.append("")
    collapsed = [(t, r) for t, *_, r in rows if r is not None and r < RETENTION_COLLAPSE]
    if collapsed:
        out += [f"**Retention collapsed**: {', '.join(f'`{t}` {fmt(r)}' for t, r in collapsed)} (below "
                f"{RETENTION_COLLAPSE:g}: the model kept less than half of its earlier accuracy on "
                f"{'this task' if len(collapsed) == 1 else 'these tasks'} while it trained the new one; see "
                "`tasks.png`; a larger `routing.anchor-kl-coef` or a lower `train.lr` holds more of it).", ""]
    if run.secure:
        out += ["Under secure aggregation these figures come from sums over the parties with distributed DP noise "
                "(`privacy.metric-noise-multiplier`, docs/privacy.md §4.5): a small difference between two "
                "rounds may be noise.", ""]
    if last.get("new_task") is not None or last.get("new_task_loss") is not None:
        loss = _num(last.get("new_task_loss"))
        out += [f"New task: `{fmt(last.get('new_task'))}`" + (f", loss {fmt(loss)}." if loss is not None else "."), ""]
    return out


def _probe_section(run: _Run) -> list[str]:
    """The per-round routing of the public probe set and the per-layer expert selection of its last round."""
    every = _config_value(run, "routing.probe-every")
    out = [f"Per-round routing on the public probe set (`routing.probe-every` = {fmt(every)}): the global model "
           "after each round, measured by every party on public prompts and combined by median; no party data, no "
           "privacy cost (`docs/privacy.md` §3). KL is to the anchor of that round; top-1 consistency is with the "
           "previous probe.", ""]
    rows = [(_round_of(e), e.get("phase_label"), _num(e.get("routing_kl")), _num(e.get("load_cv")),
             _num(e.get("top1_consistency")), _count(e.get("anchor_version")), _count(e.get("parties")),
             _count(e.get("disagreeing"))) for e in run.probes]
    out += _table(("round", "phase", "routing KL", "load CV", "top-1 consistency", "anchor", "parties",
                   "disagreeing"), rows)
    warns = [e for e in run.events if e.get("event") == "routing_warning"]
    out += ["", f"Routing-health warnings: {len(warns)} (listed under Warnings; `routing.load-cv-warn` = "
                f"{fmt(_config_value(run, 'routing.load-cv-warn'))}, `routing.kl-rise-rounds` = "
                f"{fmt(_config_value(run, 'routing.kl-rise-rounds'))}).", ""]
    last = run.probes[-1]
    counts = last.get("expert_counts")
    if isinstance(counts, list) and counts and all(isinstance(r, list) for r in counts):
        width = max(len(r) for r in counts)
        out += ["### Expert selection on the probe set", "",
                f"Top-1 selections per MoE layer and expert at round {fmt(_round_of(last))} (share of the layer's "
                "probe tokens in parentheses; an even split is 1/E each).", ""]
        body = []
        for i, r in enumerate(counts):
            tot = sum(x for x in r if _num(x) is not None) or 1
            body.append((f"layer {i}", *[f"{fmt(_count(x))} ({100 * (_num(x) or 0) / tot:.0f}%)" for x in r]))
        out += _table(("layer", *[f"expert {j}" for j in range(width)]), body) + [""]
    return out


def _routing(run: _Run) -> list[str]:
    agg = run.agg_evals()
    out = ["## Routing", ""]
    if run.probes:
        out += _probe_section(run)
        if not any(_num(e.get(k)) is not None for e in agg for k in ("routing_kl", "load_cv", "top1_consistency")):
            return out
        out += ["### At evaluation rounds (held-out data)", ""]
    if not agg:
        return out + ["No aggregate eval logged.", ""]
    if run.secure and not any(_num(e.get(k)) is not None for e in agg for k in ("routing_kl", "load_cv",
                                                                               "top1_consistency")):
        return out + ["Not released: under secure aggregation the routing metrics (routing KL to the anchor, "
                      "expert-load CV, top-1 consistency) stay at the parties.", ""]
    last = agg[-1]
    cv = _num(last.get("load_cv"))
    verdict = DASH if cv is None else ("healthy" if cv < HEALTHY_LOAD_CV else f"above {HEALTHY_LOAD_CV:g}")
    rows = []
    for key, name, note in (
        ("routing_kl", "routing KL to anchor", None),
        ("load_cv", f"expert-load CV (healthy < {HEALTHY_LOAD_CV:g})", verdict),
        ("top1_consistency", "top-1 consistency vs reference", None),
    ):
        _, ys = _series(agg, key)
        rows.append((name, _num(last.get(key)), ys[0] if ys else None, max(ys) if ys else None, note))
    out += _table(("metric", "final", "first", "max", "note"), rows)
    out += ["", f"Final values from round {fmt(_round_of(last))}; first/max over all aggregate evals.", ""]
    return out


def _per_party(run: _Run, tasks: list[str]) -> list[str]:
    out = ["## Per-party final metrics", ""]
    parties = run.parties()
    if run.secure and not parties:
        return out + ["Per-party metrics: none, by design under secure aggregation: the server receives only sums "
                      "over the parties (docs/privacy.md). Each party's training losses are in its own log, "
                      f"{PARTY_LOG} under its node's work directory.", ""]
    if not parties:
        return out + ["No per-party events logged.", ""]
    last_eval: dict[str, dict[str, Any]] = {}
    last_train: dict[str, dict[str, Any]] = {}
    for e in run.evals:
        last_eval[_party_of(e)] = e
    for e in run.train:
        last_train[_party_of(e)] = e
    header = [
        "party",
        "eval round",
        *[f"acc/{t}" for t in tasks],
        "routing KL",
        "load CV",
        "top-1 cons.",
        "train round",
        "train loss",
    ]
    rows = []
    for p in [*parties, AGG]:
        ev, tr = last_eval.get(p, {}), last_train.get(p, {})
        rows.append(
            [
                f"**{p}**" if p == AGG else p,
                _round_of(ev) if ev else None,
                *[_num(ev.get(f"acc/{t}")) for t in tasks],
                _num(ev.get("routing_kl")),
                _num(ev.get("load_cv")),
                _num(ev.get("top1_consistency")),
                _round_of(tr) if tr else None,
                _num(tr.get("loss")),
            ]
        )
    return out + _table(header, rows) + [""]


def _train_table(rows: list[dict[str, Any]], derived: bool, secure: bool = False) -> list[str]:
    out = ["## Train rounds (aggregate)", ""]
    if not rows:
        return out + ["No train rounds logged.", ""]
    if secure and not any(_num(r.get(k)) is not None for r in rows for k in ("loss", "loss_first", "loss_last")):
        # secure aggregation releases only the training-metric slots' means: no column of dashes
        body = [(r["round"], r.get("phase_label"), r.get("task"), _count(r.get("contributors", r.get("parties"))),
                 "skipped: nothing released" if r.get("skipped") else "applied") for r in rows]
        header: tuple[str, ...] = ("round", "phase", "task", "contributing parties†", "update")
        if any(_num(r.get("skipped_steps")) is not None for r in rows):  # the secure sum of NaN/Inf steps skipped
            body = [(*b, _count(r.get("skipped_steps"))) for b, r in zip(body, rows, strict=True)]
            header = (*header, "skipped NaN/Inf steps (sum)")
        body = [(*b, _num(r.get("task_loss"))) for b, r in zip(body, rows, strict=True)]  # the released slot mean
        header = (*header, "mean task loss†")
        out += _table(header, body)
    else:
        body = [
            (
                f"{r['round']}*" if r.get("_derived") else r["round"],
                r.get("phase_label"),
                r.get("task"),
                _arrow(r.get("loss_first"), r.get("loss_last")),
                _num(r.get("loss")),
                _num(r.get("aux_loss")),
                _num(r.get("anchor_kl")),
                _count(r.get("skipped_steps")),
                _count(r.get("num_examples", r.get("contributors"))),
            )
            for r in rows
        ]
        out += _table(
            (
                "round",
                "phase",
                "task",
                "loss first → last",
                "mean loss",
                "aux loss",
                "anchor KL",
                "skipped steps",
                "examples (parties†)",
            ),
            body,
        )
    if any("contributors" in r for r in rows):
        out += ["", "† secure aggregation: FedAvg weights are uniform, so the column counts the contributing parties "
                "(never examples); the mean task loss is over them, each party's clipped to "
                "`privacy.metric-loss-bound` (docs/privacy.md §3; per-party figures stay in each party's "
                f"{PARTY_LOG}), and "
                "the evaluation figures carry distributed DP noise (`privacy.metric-noise-multiplier`, "
                "docs/privacy.md §4.5)."]
    if derived:
        out += ["", "\\* no aggregate event logged for this round; weighted mean of the party events."]
    return out + [""]


def _stats_table(run: _Run, secure: bool = False) -> list[str]:
    agg = [e for e in run.stats if _party_of(e) == AGG]
    if not agg:
        return []
    rows = [(_round_of(e), e.get("task"), e.get("anchor_version"), _num(e.get("num_sequences"))) for e in agg]
    out = ["## Routing statistics rounds", "", *_table(("round", "task", "anchor version", "sequences"), rows), ""]
    if secure:
        out += ["Sequences: the number of sequences in the router statistics, summed over the parties with their DP "
                "noise (so not a whole number).", ""]
    return out


def _eps(v: Any) -> float | None:
    """epsilon of an accountant summary ``{"prv": x, "rdp": y}``: the max of the two, as the parties charge."""
    if isinstance(v, Mapping):
        vals = [x for x in (_num(v.get("prv")), _num(v.get("rdp"))) if x is not None]
        return max(vals) if vals else None
    return _num(v)


def _releases(state: Any) -> dict[str, int]:
    """Releases per kind in one party's accountant state (``privacy/ledger.json``): the sum of its events' steps by
    the closed set of labels ``RELEASE_KINDS`` (anything else counts as ``other``)."""
    out: dict[str, int] = {}
    events = state.get("events") if isinstance(state, Mapping) else None
    for ev in events if isinstance(events, list) else []:
        if not isinstance(ev, Mapping):
            continue
        label = str(ev.get("label") or "")
        kind = next((k for k in RELEASE_KINDS if label == k or label.startswith(k + " ")), "other")
        steps = ev.get("steps")
        out[kind] = out.get(kind, 0) + (steps if isinstance(steps, int) and not isinstance(steps, bool) else 1)
    return out


def _privacy(run: _Run) -> list[str]:
    """Mode, budget, epsilon spent per party, releases, refusals and skipped rounds."""
    out = ["## Privacy", ""]
    priv = run.record.get("privacy") if isinstance(run.record.get("privacy"), Mapping) else {}
    if not priv and not run.accounts:
        return out + ["No privacy record (`run.json` has no `privacy`).", ""]
    if priv.get("secure_aggregation") is False or priv.get("mode") == "plaintext":
        out += ["**Plaintext baseline**: no secure aggregation and no DP; every party's figures reach the server "
                "(the audit fails such a run).", ""]
    else:
        plan = priv.get("plan") if isinstance(priv.get("plan"), Mapping) else {}
        budget = _num(priv.get("epsilon_budget", run.accounts.get("epsilon_budget")))
        delta = _num(priv.get("delta", run.accounts.get("delta")))
        out.append(f"Secure aggregation of every reply (threshold t = {fmt(_count(priv.get('threshold')))} of "
                   f"{fmt(_count(priv.get('n_parties')))} parties); router statistics and evaluation figures with "
                   "distributed DP; model updates " + ("with client-level DP" if _num(
                       plan.get("update_noise_multiplier")) else "as a secure sum (no DP noise)") + ".")
        out.append(f"Budget ε = {fmt(budget)} at δ = {fmt(delta)} per party (unit: one sequence); planned "
                   f"ε {fmt(_num(plan.get('planned_epsilon')))} over {fmt(_count(plan.get('stats_releases')))} "
                   f"router-statistics, {fmt(_count(plan.get('update_releases')))} update and "
                   f"{fmt(_count(plan.get('eval_releases')))} evaluation release(s).")
        out.append("")
        spent = run.accounts.get("epsilon") if isinstance(run.accounts.get("epsilon"), Mapping) else None
        if spent is None:
            spent = priv.get("epsilon_spent") if isinstance(priv.get("epsilon_spent"), Mapping) else {}
        states = run.accounts.get("parties") if isinstance(run.accounts.get("parties"), Mapping) else {}
        names = sorted({str(p) for p in [*spent, *states] if _LABEL.match(str(p))}, key=_natural_key)
        kinds = [k for k in (*RELEASE_KINDS, "other") if any(_releases(states.get(p)).get(k) for p in names)]
        rows = []
        for p in names:
            eps, rel = _eps(spent.get(p)), _releases(states.get(p))
            share = f"{100 * eps / budget:.0f}%" if eps is not None and budget else None
            rows.append((p, eps, budget, share, *[rel.get(k, 0) for k in kinds]))
        if rows:
            out += _table(("party", "ε spent", "budget", "of budget", *[f"{k} releases" for k in kinds]), rows)
            out.append("")
        else:
            out += ["No epsilon spent recorded (no release was made).", ""]
    out += ["Refusals and skipped rounds:", ""]
    items = []
    for e in run.party_errors:
        code = e.get("code")
        if code == "budget":
            items.append(f"round {fmt(_round_of(e))}: party `{_party_of(e)}` refused the release: it would exceed "
                         "its privacy budget (nothing was sent)")
        elif isinstance(code, str) and _LABEL.match(code):
            items.append(f"round {fmt(_round_of(e))}: party `{_party_of(e)}` left out of "
                         f"`{e.get('phase_label') if _LABEL.match(str(e.get('phase_label'))) else '–'}`: {code}")
    refused = run.accounts.get("refused") if isinstance(run.accounts.get("refused"), list) else []
    for r in refused:
        if isinstance(r, Mapping):
            why = REFUSAL_REASONS.get(str(r.get("reason")), "refused")
            rel = r.get("release") if r.get("release") in RELEASE_KINDS else "release"
            items.append(f"round {fmt(_count(r.get('round')))}: {rel} not released: {why} "
                         f"({fmt(_count(r.get('contributors')))} contributed, min {fmt(_count(r.get('min_parties')))})")
    for e in run.train + run.rl:
        if e.get("skipped") is True and _party_of(e) == AGG:
            items.append(f"round {fmt(_round_of(e))}: {e.get('event')} round skipped: nothing released, model "
                         "unchanged")
    out += [f"- {i}" for i in items] if items else ["None."]
    return out + [""]


def _config(run: _Run) -> list[str]:
    cfg = run.record.get("config")
    if not isinstance(cfg, Mapping) or not cfg:
        return []
    rows = [(str(k), json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in sorted(cfg.items())]
    return ["## Config", "", *_table(("key", "value"), rows), ""]


def _markdown(run: _Run, tasks: list[str], rows: list[dict[str, Any]], derived: bool) -> str:
    md = [
        *_header(run),
        *_warnings(run),
        *_anomalies(run),
        *_privacy(run),
        *_schedule(run),
        *_final_eval(run, tasks),
        *_routing(run),
        *_per_party(run, tasks),
        *_train_table(rows, derived, run.secure),
        *_stats_table(run, run.secure),
        *_rl_table(run),
        "## Plots",
        "",
        "![loss](loss.png)",
        "",
        "![routing](routing.png)",
        "",
        "![tasks](tasks.png)",
        "",
        *_config(run),
    ]
    return "\n".join(md).rstrip("\n") + "\n"


def render_markdown(run_dir: str | os.PathLike[str]) -> str:
    """The text of ``report.md`` for ``run_dir``, without writing anything (the audit compares it with the
    file on disk: a report holds nothing but what its run's records render)."""
    run = _load(Path(run_dir))
    rows, derived = _train_rows(run)
    return _markdown(run, run.tasks(), rows, derived)


def write_report(run_dir: str | os.PathLike[str]) -> Path:
    """Write ``run_dir/report/report.md`` and its three PNG plots; return the Markdown path.

    Raises FileNotFoundError when ``run_dir/metrics.jsonl`` is missing and ValueError when a line in its
    middle is corrupt; anything else missing or partial is shown as "–" or an empty panel.
    """
    run = _load(Path(run_dir))
    out_dir = run.run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    tasks = run.tasks()
    rows, derived = _train_rows(run)

    _plot_loss(run, rows, out_dir / "loss.png")
    _plot_routing(run, out_dir / "routing.png")
    _plot_tasks(run, tasks, out_dir / "tasks.png")
    if run.rl:
        _plot_rl(run, out_dir / "rl.png")
    path = out_dir / "report.md"
    write_text_atomic(path, _markdown(run, tasks, rows, derived))
    return path
