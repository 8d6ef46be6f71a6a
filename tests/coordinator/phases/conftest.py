"""Shared fixtures for the phase tests: a ``RunContext`` over the tiny model's real server model, with no
coordinator and no transport, and the read-back of its ``metrics.jsonl``.

Owns: ``make_ctx`` (a context at a given round of a given schedule), ``metric_lines`` and ``begin`` (a round's
``begin`` and ``configure`` as the loop runs them: the new state made ``ctx.s``).

Must not: be imported by test modules, start a party, or exchange anything (the phases are tested with hand-made
sums, exactly what the aggregator would hand them).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from distmoe.config import parse_run_config
from distmoe.coordinator.context import RunContext
from distmoe.model.adapters import server_model


@pytest.fixture(scope="session")
def tiny_model(tiny):
    """The tiny model's server side (built once; each context takes a copy of its weights)."""
    return server_model(parse_run_config(dict(tiny)).model)


@pytest.fixture
def make_ctx(tiny, tiny_model, tmp_path):
    """``make_ctx(schedule="sft:arith", rnd=1, **overrides) -> RunContext`` at round ``rnd`` of ``schedule``."""

    def make_ctx(schedule: str = "sft:arith", rnd: int = 1, model=None, **overrides) -> RunContext:
        cfg = parse_run_config({**tiny, "schedule.phases": schedule, **overrides})
        ctx = RunContext(cfg, tmp_path / "run", "phase-test", log=lambda s: None)
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        ctx.model = model or tiny_model
        ctx.s = replace(ctx.s, weights={k: v.clone() for k, v in ctx.model.weights.items()}, round=rnd)
        return ctx
    return make_ctx


def metric_lines(ctx: RunContext, event: str | None = None) -> list[dict]:
    path = Path(ctx.run_dir) / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [m for m in lines if event is None or m.get("event") == event]


@pytest.fixture
def read_metrics():
    """``read_metrics(ctx, event=None) -> list[dict]``: the context's ``metrics.jsonl`` lines (of ``event``)."""
    return metric_lines


def begin(step, ctx: RunContext, phase):
    """The loop's first two steps of a round: ``ctx.s = step.begin(ctx, phase)``, then the instruction."""
    ctx.s = step.begin(ctx, phase)
    return step.configure(ctx, phase)


@pytest.fixture
def configure():
    """``configure(step, ctx, phase) -> instruction``: ``begin`` then ``configure``, as the round loop runs them."""
    return begin
