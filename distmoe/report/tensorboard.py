"""TensorBoard scalars of a run: every aggregate metric of ``metrics.jsonl`` under ``RUN/tensorboard/``.

Owns: :func:`write_tensorboard` (``report.tensorboard = true`` after a simulation, ``distmoe report
--tensorboard``) and the tag scheme: one scalar ``<event>/<key>`` (``train/loss``, ``eval/acc/arith``,
``stats/num_sequences``) per finite number of an aggregate row (``party == "all"``) of a ``train``, ``rl``,
``stats`` or ``eval`` event, at step = its round and wall time = its ``time``. Every run of it replaces the
directory's event files (one file, no duplicate points). View with ``tensorboard --logdir RUN/tensorboard``.

The files are written with the ``tensorboard`` package's own event writer (the optional extra ``distmoe
[tensorboard]``; ``torch.utils.tensorboard`` needs that same package); without it :func:`write_tensorboard`
raises :class:`TensorBoardMissing` naming the extra. The audit reads the files back without it
(``distmoe.audit.tfevents``) and accepts only scalars whose tags are keys of the aggregate rows.

Must not: import ``flwr`` or ``torch``, write a per-party row (a plaintext run's per-party rows are skipped:
the audit allows aggregate tags only), or write anything outside ``RUN/tensorboard/``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from distmoe.rundir import RunDir, load_run

__all__ = ["write_tensorboard", "require", "scalars", "TensorBoardMissing", "EVENTS", "SKIP_KEYS"]

EVENTS = ("train", "rl", "stats", "eval", "probe")  # the events whose aggregate numbers become scalars
SKIP_KEYS = frozenset({"event", "round", "time", "phase", "party", "anchor_version", "skipped"})
INSTALL_HINT = "pip install 'distmoe[tensorboard]'"


class TensorBoardMissing(RuntimeError):
    """The ``tensorboard`` package (the ``tensorboard`` extra) is not installed."""


def scalars(run_dir: str | os.PathLike[str]) -> list[tuple[str, int, float, float]]:
    """``(tag, step, value, wall_time)`` of every finite number of an aggregate row, in log order."""
    out = []
    for e in load_run(run_dir).metrics:
        kind, rnd = e.get("event"), e.get("round")
        if kind not in EVENTS or e.get("party", "all") != "all" or not isinstance(rnd, int) or isinstance(rnd, bool):
            continue
        t = e.get("time")
        wall = float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0
        for key, v in e.items():
            if key in SKIP_KEYS or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if math.isfinite(float(v)):
                out.append((f"{kind}/{key}", rnd, float(v), wall))
    return out


def require() -> None:
    """Raise :class:`TensorBoardMissing` (naming the extra) unless the ``tensorboard`` package can be imported."""
    _writer()


def _writer():
    try:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError as exc:
        raise TensorBoardMissing(
            f"TensorBoard output needs the 'tensorboard' package, the optional extra "
            f"'tensorboard' of distmoe: {INSTALL_HINT} ({exc})"
        ) from None
    return Event, Summary, EventFileWriter


def write_tensorboard(run_dir: str | os.PathLike[str]) -> Path:
    """Write the run's aggregate metrics as TensorBoard scalars under ``run_dir/tensorboard``; return that
    directory. Raises :class:`TensorBoardMissing` without the ``tensorboard`` package (nothing is written),
    FileNotFoundError without ``metrics.jsonl``."""
    points = scalars(run_dir)  # raises before anything is written: no run directory, no metrics log
    Event, Summary, EventFileWriter = _writer()
    out = RunDir(run_dir).tensorboard
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("events.out.tfevents.*"):  # a re-run replaces the points, never duplicates them
        old.unlink()
    writer = EventFileWriter(str(out))
    try:
        for tag, step, value, wall in points:
            writer.add_event(
                Event(wall_time=wall, step=step, summary=Summary(value=[Summary.Value(tag=tag, simple_value=value)]))
            )
    finally:
        writer.close()
    return out
