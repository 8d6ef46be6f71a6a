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

import os
from pathlib import Path
from typing import Any

from distmoe.io import write_text_atomic
from distmoe.report.load import HEALTHY_LOAD_CV, _load, _Run, _train_rows, summarise
from distmoe.report.plots import _plot_loss, _plot_rl, _plot_routing, _plot_tasks
from distmoe.report.sections import (
    _anomalies,
    _final_eval,
    _header,
    _per_party,
    _rl_table,
    _routing,
    _schedule,
    _warnings,
)
from distmoe.report.tables import _config, _privacy, _stats_table, _train_table
from distmoe.rundir import RunDir

__all__ = ["write_report", "render_markdown", "summarise", "HEALTHY_LOAD_CV"]


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
    layout = RunDir(run.run_dir)
    layout.report.mkdir(parents=True, exist_ok=True)
    tasks = run.tasks()
    rows, derived = _train_rows(run)

    _plot_loss(run, rows, layout.report_plot("loss"))
    _plot_routing(run, layout.report_plot("routing"))
    _plot_tasks(run, tasks, layout.report_plot("tasks"))
    if run.rl:
        _plot_rl(run, layout.report_plot("rl"))
    path = layout.report_md
    write_text_atomic(path, _markdown(run, tasks, rows, derived))
    return path
