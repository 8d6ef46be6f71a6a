"""Verifiable rewards for RL on the synthetic (or any verifiable) tasks, selected by name.

Owns: the reward registry ``REWARDS`` and ``get_reward(name)``; every reward has the signature
``reward(completion, expected, task="", prompt_text="") -> float`` in [0, 1] and is a pure function
of its arguments.

Must not: touch models or tokenizers, decode tokens, or compute advantages (that is GRPO's job).

Built in: ``exact_match`` (stripped equality), ``numeric`` (parsed numbers within ``NUMERIC_TOL``
relative tolerance), ``format`` (the raw completion fully matches the answer format of its task
family -- non-empty, no spaces or newlines beyond that format), ``task`` (the task family's own
verifier, ``distmoe.data.synth.check_answer``).

Adding a reward: write one function with the signature above, e.g.::

    def _prefix(completion, expected, task="", prompt_text=""):
        return float(completion.strip().startswith(expected.strip()))

and add one registry entry, ``REWARDS["prefix"] = _prefix`` (in the dict literal below).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from distmoe.data.synth import _parse_number, check_answer, family_of

Reward = Callable[..., float]

NUMERIC_TOL = 1e-6  # relative tolerance of ``numeric`` (times max(1, |expected|))

# answer format per task family; fullmatch on the raw completion (no surrounding whitespace)
FORMATS: dict[str, re.Pattern] = {
    "arith": re.compile(r"[+-]?\d+(\.\d+)?"),
    "strings": re.compile(r"[A-Za-z]+"),
    "lookup": re.compile(r"[A-Z]{3}"),
}
DEFAULT_FORMAT = re.compile(r"\S+")  # unknown family: one non-empty token without whitespace


def _exact_match(completion: str, expected: str, task: str = "", prompt_text: str = "") -> float:
    return float(completion.strip() == expected.strip())


def _numeric(completion: str, expected: str, task: str = "", prompt_text: str = "") -> float:
    got, want = _parse_number(completion), _parse_number(expected)
    if got is None or want is None:
        return 0.0
    return float(abs(got - want) <= NUMERIC_TOL * max(1.0, abs(want)))


def _format(completion: str, expected: str = "", task: str = "", prompt_text: str = "") -> float:
    family = family_of(task) if task else None
    pattern = FORMATS.get(family, DEFAULT_FORMAT) if family else DEFAULT_FORMAT
    return float(bool(completion) and pattern.fullmatch(completion) is not None)


def _task(completion: str, expected: str, task: str = "", prompt_text: str = "") -> float:
    return float(check_answer(task, prompt_text, completion, expected))


REWARDS: dict[str, Reward] = {
    "exact_match": _exact_match,
    "numeric": _numeric,
    "format": _format,
    "task": _task,
}


def get_reward(name: str) -> Reward:
    """The reward function registered as ``name`` (ValueError listing the valid names otherwise)."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; valid rewards: {', '.join(sorted(REWARDS))}")
    return REWARDS[name]


def compute_rewards(name: str, completions: Sequence[str], expected: Sequence[str],
                    tasks: Sequence[str] | str = "", prompt_texts: Sequence[str] | str = "") -> list[float]:
    """Reward ``name`` for every completion (``tasks`` / ``prompt_texts``: one per row or one for all)."""
    fn = get_reward(name)
    n = len(completions)
    if len(expected) != n:
        raise ValueError(f"compute_rewards: {n} completions but {len(expected)} expected answers")
    tasks = [tasks] * n if isinstance(tasks, str) else list(tasks)
    prompt_texts = [prompt_texts] * n if isinstance(prompt_texts, str) else list(prompt_texts)
    rows = zip(completions, expected, tasks, prompt_texts, strict=True)
    return [fn(c, e, task=t, prompt_text=p) for c, e, t, p in rows]
