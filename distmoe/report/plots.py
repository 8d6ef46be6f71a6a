"""The run report's plots: ``loss.png``, ``routing.png``, ``tasks.png`` and ``rl.png``.

Owns: every figure of the report. A loss line is never drawn across rounds that did not train (statistics,
evaluation, skipped rounds, another task); the routing probe's top-1 consistency is plotted on training rounds
only (a round that changes no weights shows 1.0, which is no improvement); retention is plotted against its
collapse threshold (``RETENTION_COLLAPSE``).

Plots use matplotlib's Agg canvas directly (``Figure`` + ``FigureCanvasAgg``, no ``pyplot``): no global
backend switch in the importing process, no figure registry to leak, safe off the main thread.

Must not: import ``flwr`` or ``torch``, or read anything but the loaded run (``distmoe.report.load``).
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from distmoe.io import write_text_atomic
from distmoe.report.load import (
    AGG,
    DPI,
    FIGSIZE,
    FIGSIZE_WIDE,
    HEALTHY_LOAD_CV,
    MAX_PARTY_LEGEND,
    RETENTION_COLLAPSE,
    _config_value,
    _num,
    _party_of,
    _round_of,
    _Run,
)

TRAINING_KINDS = ("sft", "rl", "dpo")  # phases whose rounds change the weights


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
    agg = [e for e in events if _party_of(e) == AGG]
    xs, ys = _series(agg, key)
    n = len(xs)
    if xs:
        _noise_bars(ax, agg, key, xs, ys, ecolor="0.35", label="± 1 noise std (update DP)", zorder=4)
        xs, ys = _broken(xs, ys, task_of)
        ax.plot(xs, ys, color="black", linewidth=2.2, marker=_marker(n), markersize=4, label=label, zorder=5)
    return n

def _noise_bars(ax, agg: list[dict[str, Any]], key: str, xs: list[int], ys: list[float], **style: Any) -> None:
    """One update-noise std (``<key>_sd``, a released training figure under client-level DP) as error bars."""
    vals = dict(zip(xs, ys, strict=True))
    bars = [(x, vals[x], sd) for x, sd in zip(*_series(agg, f"{key}_sd"), strict=True) if x in vals]
    if bars:
        ax.errorbar([b[0] for b in bars], [b[1] for b in bars], yerr=[b[2] for b in bars], fmt="none",
                    elinewidth=1.0, capsize=3, **style)

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
        events = run.probes
        if key == "top1_consistency":  # a round that trains nothing keeps every choice: 1.0 is no improvement
            events = [e for e in events if str(e.get("phase_label", "")).split(":")[0] in TRAINING_KINDS]
        if not _agg_line(ax, events, key, label="probe (training rounds)" if key == "top1_consistency" else "probe"):
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
        agg = [e for e in run.rl if _party_of(e) == AGG]
        xs, ys = _series(agg, key)
        if xs:
            ax_m.plot(xs, ys, color=color, linewidth=1.8, marker=_marker(len(xs)), markersize=4, label=label)
            n += len(xs)
            _noise_bars(ax_m, agg, key, xs, ys, ecolor=color, alpha=0.6)
    _style(ax_m, "Train/inference mismatch (aggregate)", "value", _rounds(run.rl))
    if n:
        _legend(ax_m)
    _save(fig, path)

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
