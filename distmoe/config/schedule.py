"""The schedule grammar: phase kinds, :class:`Phase`, the parser of ``schedule.phases``, the schedule derived
from a list of tasks, the ``eval.every`` cadence and the tasks that grow the model.

Owns: ``PHASE_KINDS`` and ``UPDATE_KINDS``, the one table of phase kinds (every other module asks it rather than
listing kinds), and every rule of the grammar ``kind[:task][*rounds]``.

Must not: import anything of distmoe outside this package, or know what a phase does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distmoe.config.keys import ConfigError

PHASE_KINDS = ("sft", "stats", "eval", "rl", "dpo")
UPDATE_KINDS = ("sft", "rl", "dpo")  # the phases that train and release a model update (a task, '*rounds')
TASK_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


@dataclass(frozen=True)
class Phase:
    kind: str  # one of PHASE_KINDS
    task: str | None
    rounds: int

    def label(self) -> str:
        return self.kind + (f":{self.task}" if self.task else "")



def parse_schedule(text: str, default_rounds: int, key: str = "schedule.phases") -> tuple[Phase, ...]:
    """Parse ``"sft:arith*3, eval, stats:arith, sft:strings, eval"`` into phases.

    Grammar: phases separated by ``,`` or ``->``; each is ``kind[:task][*rounds]``. ``sft``, ``rl`` and
    ``dpo`` need a task (``dpo``: a task of preference pairs); ``stats`` takes an optional task (default:
    every local task); ``eval`` takes none.
    """
    items = [s.strip() for s in re.split(r",|->", text) if s.strip()]
    if not items:
        raise ConfigError(f"config key '{key}': value {text!r} has no phases "
                          f"(expected e.g. 'sft:arith, stats:arith, sft:strings, eval')")
    phases: list[Phase] = []
    for item in items:
        m = re.fullmatch(r"([a-z]+)(?::([^*\s]+))?(?:\*(\d+))?", item)
        if not m:
            raise ConfigError(f"config key '{key}': phase {item!r} is malformed "
                              f"(expected kind[:task][*rounds], kind one of {', '.join(PHASE_KINDS)})")
        kind, task, rounds = m.group(1), m.group(2), m.group(3)
        if kind not in PHASE_KINDS:
            raise ConfigError(f"config key '{key}': phase {item!r} has unknown kind {kind!r} "
                              f"(allowed: {', '.join(PHASE_KINDS)})")
        if task is not None and not TASK_RE.match(task):
            raise ConfigError(f"config key '{key}': phase {item!r} has an invalid task name {task!r} "
                              "(letters, digits, '-' and '_')")
        if kind in UPDATE_KINDS and task is None:
            raise ConfigError(f"config key '{key}': phase {item!r} needs a task (e.g. '{kind}:arith')")
        if kind == "eval" and task is not None:
            raise ConfigError(f"config key '{key}': phase {item!r}: eval takes no task "
                              "(it evaluates every task seen so far)")
        n = int(rounds) if rounds is not None else (default_rounds if kind in UPDATE_KINDS else 1)
        if n < 1:
            raise ConfigError(f"config key '{key}': phase {item!r} must have at least 1 round")
        if kind not in UPDATE_KINDS and n != 1:
            raise ConfigError(f"config key '{key}': phase {item!r}: only sft, rl and dpo phases take '*rounds'")
        phases.append(Phase(kind=kind, task=task, rounds=n))
    return tuple(phases)


def expansion_tasks(phases: tuple[Phase, ...]) -> list[str]:
    """The tasks whose first ``sft`` phase grows the model under ``retention.expand-experts`` (in schedule order): an
    ``sft`` phase of a task not trained before (by an ``sft``, ``dpo`` or ``rl`` phase), once some task was."""
    out: list[str] = []
    trained: list[str] = []
    for ph in phases:
        if ph.kind == "sft" and ph.task and ph.task not in trained and trained:
            out.append(ph.task)
        if ph.kind in UPDATE_KINDS and ph.task and ph.task not in trained:
            trained.append(ph.task)
    return out


def with_eval_cadence(phases: tuple[Phase, ...], every: int) -> tuple[Phase, ...]:
    """``eval.every = n``: each training phase (``UPDATE_KINDS``) split into runs of ``n`` rounds with an ``eval``
    round after each full run, except where the schedule already evaluates next (the phase's last run followed by
    an ``eval`` phase). ``sft:a*5, eval`` with ``n = 2`` -> ``sft:a*2, eval, sft:a*2, eval, sft:a, eval``. The
    inserted rounds are ordinary ``eval`` rounds: the privacy plan charges them like any other."""
    if every <= 0:
        return phases
    out: list[Phase] = []
    for i, ph in enumerate(phases):
        if ph.kind not in UPDATE_KINDS:
            out.append(ph)
            continue
        nxt = phases[i + 1].kind if i + 1 < len(phases) else None
        left = ph.rounds
        while left > 0:
            n = min(every, left)
            left -= n
            out.append(Phase(ph.kind, ph.task, n))
            if n == every and not (left == 0 and nxt == "eval"):
                out.append(Phase("eval", None, 1))
    return tuple(out)


def schedule_text(schedule: Any) -> str:
    """A parsed schedule for people: ``sft:a*5 -> eval -> stats:a -> sft:b*5 -> eval (13 rounds)``."""
    return (" -> ".join(p.label() + (f"*{p.rounds}" if p.rounds > 1 else "") for p in schedule.phases)
            + f" ({schedule.total_rounds} rounds)")


def continual_schedule(tasks: Sequence[str]) -> str:
    """The schedule derived from a list of tasks, in the shape of the default one (``schedule.phases``).

    One task: ``sft:<t>, eval`` (tune, then evaluate). Several, in the given order: tune on each in
    turn, with an evaluation after each task and the router statistics of the task just tuned
    (``stats:<t>``, the anchor's next version) before the next one, e.g. ``sft:a, eval, stats:a,
    sft:b, eval``. Rounds per ``sft`` phase come from ``schedule.sft-rounds``.
    """
    tasks = list(tasks)
    if not tasks:
        raise ConfigError("config key 'schedule.phases': no tasks to derive a schedule from")
    for t in tasks:
        if not TASK_RE.match(t):
            raise ConfigError(f"config key 'schedule.phases': invalid task name {t!r} (letters, digits, '-' and '_')")
    dup = sorted({t for t in tasks if tasks.count(t) > 1})
    if dup:
        raise ConfigError(f"config key 'schedule.phases': task(s) {', '.join(dup)} listed more than once")
    phases: list[str] = []
    for i, t in enumerate(tasks):
        if i:
            phases.append(f"stats:{tasks[i - 1]}")
        phases += [f"sft:{t}", "eval"]
    return ", ".join(phases)

