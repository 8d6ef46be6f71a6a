"""Shared fixtures for the coordinator tests: whole runs of three in-process parties laid out like
``distmoe simulate``'s run directory, and readers of what such a run leaves (releases, audit failures).

Owns: ``lay_out_run`` (party data, work dirs, node files, RunConfig), ``make_run`` (the same with a
``Coordinator`` over ``LocalTransport``: the exact party code path, ledgers, guards, secure aggregation),
``releases`` and ``failed_checks``.

Must not: be imported by test modules (they ask for fixtures by name), run a schedule itself, or start Flower.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest

from distmoe.config import parse_node_config, parse_run_config
from distmoe.coordinator import Coordinator
from distmoe.data.synth import write_synthetic
from distmoe.inprocess import LocalTransport

IDS = (100, 101, 102)
SCHEDULE = "sft:arith, stats:arith, eval"


def _lay_out(base: dict, tmp: Path, overrides: dict, node_extra: dict | None = None, data_from: Path | None = None,
             prefix: str = "run"):
    run_dir = tmp / "run"
    if data_from is None:
        dirs = write_synthetic(run_dir / "work" / "data", parties=3, examples_per_task=24, seed=0, canaries=1)
    else:
        shutil.copytree(data_from / "work" / "data", run_dir / "work" / "data")
        dirs = sorted(p for p in (run_dir / "work" / "data").iterdir() if p.is_dir())
    cfg = parse_run_config({**base, **overrides})
    (run_dir / "nodes").mkdir(parents=True)
    nodes = {}
    for i, (nid, d) in enumerate(zip(IDS, dirs, strict=True)):
        nc = {"data-path": str(d), "party-name": d.name, "work-dir": str(run_dir / "work" / d.name),
              **((node_extra or {}).get(d.name, {}))}
        (run_dir / "nodes" / f"node-{i}.toml").write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in nc.items()))
        nodes[nid] = parse_node_config(nc, cfg.sim)
    return cfg, nodes, run_dir, dirs, f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def lay_out_run(tiny_run):
    """``lay_out_run(tmp, schedule, data_from=None, **overrides) -> (cfg, nodes, run_dir, run_id)``: three parties'
    synthetic data (with planted canaries), work dirs and node files under ``tmp/run``, as ``distmoe simulate``
    lays them out, and the tiny-run RunConfig. ``data_from``: copy that run's party data (the planted canaries are
    fresh random strings each time)."""

    def lay_out_run(tmp: Path, schedule: str, data_from: Path | None = None, **overrides):
        cfg, nodes, run_dir, _, run_id = _lay_out(tiny_run, tmp, {"schedule.phases": schedule, **overrides},
                                                  data_from=data_from, prefix="res")
        return cfg, nodes, run_dir, run_id
    return lay_out_run


@pytest.fixture(scope="session")
def make_run(tiny_run):
    """``make_run(tmp, overrides=None, node_extra=None) -> (coord, transport, run_dir, dirs, lines)``: a run laid
    out as ``lay_out_run`` does (default schedule ``sft:arith, stats:arith, eval``), node files under nodes/ (where
    the audit finds each party's canaries.txt), and a ``Coordinator`` over ``LocalTransport`` logging to ``lines``."""

    def make_run(tmp: Path, overrides: dict | None = None, node_extra: dict | None = None):
        cfg, nodes, run_dir, dirs, run_id = _lay_out(tiny_run, tmp, {"schedule.phases": SCHEDULE, **(overrides or {})},
                                                     node_extra=node_extra, prefix="sec")
        transport = LocalTransport(cfg, nodes, run_id)
        lines: list[str] = []
        coord = Coordinator(cfg, run_dir, transport, run_id, log=lines.append)
        return coord, transport, run_dir, dirs, lines
    return make_run


def _releases(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "ledger" / "coordinator.jsonl"
    entries = [json.loads(x) for x in path.read_text().splitlines() if x]
    return [e for e in entries if e["payload_type"] == f"release:{kind}"]


def _failed_checks(result) -> set[str]:
    return {c.name for c in result.checks if c.status == "fail"}


@pytest.fixture(scope="session")
def releases():
    """``releases(run_dir, kind)`` -> the coordinator ledger's ``release:<kind>`` entries."""
    return _releases


@pytest.fixture(scope="session")
def failed_checks():
    """``failed_checks(audit_result)`` -> the names of the audit checks that failed."""
    return _failed_checks
