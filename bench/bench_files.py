"""The bench's own files of a federated run, kept beside its run directory, never in it; and the in-process drive
of a run directory that ``distmoe.simulate.prepare`` laid out.

A run directory holds only what distmoe writes: ``distmoe audit``'s ``server-files`` check fails on any file it does
not know (``distmoe.audit.schemas``), and it admits ``overrides.toml`` only beside the ``simulate.json`` of a
``distmoe simulate`` run. So a bench's ``bench.json`` (arm, seed, wall time), ``row.json`` (its table row) and
``coordinator.log`` (the coordinator's progress lines) go to ``<runs-dir>/bench-files/<run id>/`` (``bench_dir``),
and an in-process run (``run_prepared``: the coordinator over ``distmoe.inprocess.LocalTransport``, no simulate
launcher, hence no ``simulate.json``) moves the ``overrides.toml`` that ``prepare`` wrote there too. The run
directory then passes the audit as a ``distmoe simulate`` run's does.

Must not: write into a run directory, or change what a run computes (the same coordinator and party code).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

BENCH_FILES = "bench-files"  # beside the run directories: the bench's own files of each run


def bench_dir(run_dir: Path) -> Path:
    """Where the bench keeps its own files of a run: ``<runs-dir>/bench-files/<run id>/``, beside the run directory."""
    return run_dir.parent / BENCH_FILES / run_dir.name


def bench_file(run_dir: Path, name: str) -> Path:
    """A bench file of a run, to read: in its bench directory, else in the directory itself (a kept-row directory
    of ``bench/results``, or a run directory written before the bench directory existed)."""
    side = bench_dir(run_dir) / name
    return side if side.exists() else run_dir / name


def write_bench_file(run_dir: Path, name: str, text: str) -> Path:
    """Write one of the bench's own files of a run into its bench directory (``bench_dir``)."""
    path = bench_dir(run_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def run_prepared(cfg, run_dir: Path, parties: list[Path], run_id: str) -> None:
    """Drive a run directory that ``distmoe.simulate.prepare`` laid out, in process: its ``overrides.toml`` moved to
    the bench directory, the coordinator over ``LocalTransport`` logging to the bench directory's
    ``coordinator.log``; ``RuntimeError`` naming the run directory unless the run completes."""
    from distmoe.config import parse_node_config
    from distmoe.coordinator import Coordinator
    from distmoe.inprocess import LocalTransport
    from distmoe.rundir import RunDir

    files, side = RunDir(run_dir), bench_dir(run_dir)
    side.mkdir(parents=True, exist_ok=True)
    files.overrides().replace(side / files.overrides().name)
    nodes = {100 + i: parse_node_config(tomllib.loads(files.node_file(i).read_text()), cfg.sim)
             for i in range(len(parties))}
    with (side / "coordinator.log").open("w") as log:
        rec = Coordinator(cfg, run_dir, LocalTransport(cfg, nodes, run_id), run_id,
                          log=lambda s: print(s, file=log, flush=True)).run()
    if rec.get("status") != "completed":
        raise RuntimeError(f"{run_dir}: run did not complete: {rec.get('error')}")
