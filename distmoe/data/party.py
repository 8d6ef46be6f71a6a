"""One party's local data directory: its tasks and their deterministic train / held-out split.

Owns: task discovery (every ``*.jsonl`` directly in the party directory is one task, named by the
file stem), validation of every file through ``read_jsonl``, the split and the example caps, and the per-process
memo of each file's examples and split (``_read_split``: keyed by the SHA-256 of the file's bytes).

The split (data-independent, so that adding or removing one example never moves another): each example is
keyed by ``sha256(<canonical example JSON> + "\\n" + <seed>)`` and is held out iff the key's first 8 bytes, as
an unsigned integer, are below ``eval_fraction * 2^64``; there is no rank cut. Whether an example is held out
depends on that example alone: a task's neighbouring data set (one example added or removed) changes exactly one
of the two splits by exactly that example (``docs/privacy.md`` §2). About ``eval_fraction`` of a task is held
out; a small task may have no held-out example (or no training example). Identical examples share a key, so they
are never split across train and held-out. The result depends only on the file contents and the seed -- not on
line order, the machine or the Python hash seed. Both splits are kept in key order.

The caps take the first N of a split in key order, so they do depend on the rest of the data: with a cap that
binds, adding one example can push another out (a replace-one change of that split). So a cap is applied only
where a replace-one change is covered: ``max_eval_examples`` to the held-out examples evaluated (one held-out
sequence's evaluation vector ``s·(correct, loss, 1)`` differs from another's by at most ``s·√2`` in L2 and
``2s`` in L1, within the add/remove sensitivity ``s·√3``, ``3s`` the evaluation release is charged at), and
``max_train_examples`` (0 = no cap) to local training only, whose updates are DP, when at all, at the party
level. The router statistics, charged per sequence at add/remove sensitivity, read every training example of the
split (``stats_train``), never a capped list.

Must not: read anything outside ``data_dir``, tokenize, write files, or expose another party's data.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from distmoe.config import DataConfig
from distmoe.data.formats import DataError, Example, read_jsonl, to_dataset

if TYPE_CHECKING:
    import datasets

TASK_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


@dataclass(frozen=True)
class TaskSplit:
    source: Path
    train: tuple[Example, ...]  # after max_train_examples (local training)
    heldout: tuple[Example, ...]  # after max_eval_examples (evaluation)
    total: int  # examples in the file, before caps
    train_all: tuple[Example, ...] = ()  # the whole training split, uncapped (router statistics)


@dataclass(frozen=True)
class PartyData:
    """A party's validated tasks; read-only. Build it with ``load_party``."""

    data_dir: Path
    splits: Mapping[str, TaskSplit]  # task -> split (a read-only mapping)

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(sorted(self.splits))

    def has(self, task: str) -> bool:
        return task in self.splits

    def require(self, task: str) -> TaskSplit:
        if task not in self.splits:
            raise DataError(f"party dir {self.data_dir} has no task '{task}' "
                            f"(available: {', '.join(self.tasks) or 'none'})")
        return self.splits[task]

    def is_preference(self, task: str) -> bool:
        """Does ``task`` hold preference pairs (``{"prompt", "chosen", "rejected"}`` lines)? A file is all pairs
        or none (``read_jsonl``)."""
        split = self.require(task)
        return bool((split.train + split.heldout)[0].is_pair)

    def train(self, task: str) -> list[Example]:
        return list(self.require(task).train)

    def stats_train(self, task: str) -> list[Example]:
        """Every training example of the split, no cap: what the router statistics (charged per sequence at
        add/remove sensitivity) may read (module docstring)."""
        return list(self.require(task).train_all)

    def heldout(self, task: str) -> list[Example]:
        return list(self.require(task).heldout)

    def train_dataset(self, task: str) -> datasets.Dataset:
        return to_dataset(self.require(task).train)

    def heldout_dataset(self, task: str) -> datasets.Dataset:
        return to_dataset(self.require(task).heldout)

    def counts(self) -> dict[str, tuple[int, int]]:
        """task -> (train examples, held-out examples), after caps."""
        return {t: (len(s.train), len(s.heldout)) for t, s in sorted(self.splits.items())}


def split_key(example: Example, seed: int) -> bytes:
    """The stable per-example split key: sha256 of the canonical JSON and the seed."""
    return hashlib.sha256(f"{example.to_json()}\n{seed}".encode()).digest()


def held_out(key: bytes, eval_fraction: float) -> bool:
    """Is the example with split key ``key`` held out: its first 8 bytes below ``eval_fraction * 2^64``."""
    return int.from_bytes(key[:8], "big") < eval_fraction * 2.0**64


def split_examples(examples: list[Example], eval_fraction: float, seed: int
                   ) -> tuple[list[Example], list[Example]]:
    """(train, held-out), each in split-key order; each example's side depends on it alone (module docstring)."""
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
    keyed = sorted(((split_key(ex, seed), i) for i, ex in enumerate(examples)))
    heldout = [examples[i] for k, i in keyed if held_out(k, eval_fraction)]
    train = [examples[i] for k, i in keyed if not held_out(k, eval_fraction)]
    return train, heldout


_READ: dict[str, tuple[tuple, tuple[list[Example], list[Example], list[Example]]]] = {}  # path -> (key, split)


def _content_key(path: Path) -> bytes:
    try:
        return hashlib.sha256(path.read_bytes()).digest()
    except OSError:
        return b""  # not memoised: ``read_jsonl`` names the problem


def _read_split(path: Path, eval_fraction: float, seed: int) -> tuple[list[Example], list[Example], list[Example]]:
    """``(examples, train, held-out)`` of one task file, memoised per process by the SHA-256 of the file's bytes, the
    fraction and the seed: the split is a pure function of those, so a party's next round on the Simulation Engine
    parses and splits nothing again, and a changed file is read afresh. A file that fails validation is never
    memoised (``DataError`` every time). The lists are shared between calls: callers copy before changing them."""
    digest = _content_key(path)
    key = (digest, eval_fraction, seed)
    hit = _READ.get(str(path))
    if digest and hit is not None and hit[0] == key:
        return hit[1]
    examples = read_jsonl(path)
    train_all, heldout = split_examples(examples, eval_fraction, seed)
    if digest and _content_key(path) == digest:  # unchanged while it was read
        _READ[str(path)] = (key, (examples, train_all, heldout))
    return examples, train_all, heldout


def load_party(data_dir: Path, cfg: DataConfig) -> PartyData:
    """Discover, validate and split every task in ``data_dir``; any problem raises ``DataError``."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"party dir {data_dir}: not a directory")
    try:
        files = sorted(p for p in data_dir.iterdir() if p.suffix == ".jsonl" and not p.is_dir())
    except OSError as exc:
        raise DataError(f"party dir {data_dir}: cannot list ({exc.strerror or exc})") from None
    if not files:
        others = sorted(p.name for p in data_dir.iterdir() if not p.name.startswith("."))
        found = (f"found {', '.join(others[:5])}{', ...' if len(others) > 5 else ''}" if others
                 else "it is empty")
        raise DataError(f"party dir {data_dir}: no *.jsonl task files ({found}; expected <task>.jsonl, "
                        "e.g. arith.jsonl, one JSON object per line)")
    splits: dict[str, TaskSplit] = {}
    for path in files:
        task = path.stem
        if not TASK_NAME_RE.match(task):
            raise DataError(f"{path}: task name {task!r} must start with a letter or digit and use only "
                            "letters, digits, '-' and '_'")
        examples, train_all, heldout = _read_split(path, cfg.eval_fraction, cfg.seed)
        train = train_all[: cfg.max_train_examples] if cfg.max_train_examples > 0 else train_all
        if cfg.max_eval_examples > 0:
            heldout = heldout[: cfg.max_eval_examples]
        splits[task] = TaskSplit(source=path, train=tuple(train), heldout=tuple(heldout),
                                 total=len(examples), train_all=tuple(train_all))
    return PartyData(data_dir=data_dir, splits=MappingProxyType(splits))


def party_problems(data_dir: Path) -> list[str]:
    """Every problem of a party directory at once (``load_party`` stops at the first): the directory, each
    task name, and each line of each task file, in file and line order."""
    data_dir = Path(data_dir)
    try:
        files = sorted(p for p in data_dir.iterdir() if p.suffix == ".jsonl" and not p.is_dir())
    except OSError:
        files = []
    if not files:
        try:
            load_party(data_dir, DataConfig())
        except DataError as exc:
            return [str(exc)]
    problems: list[str] = []
    for path in files:
        if not TASK_NAME_RE.match(path.stem):
            problems.append(f"{path}: task name {path.stem!r} must start with a letter or digit and use only "
                            "letters, digits, '-' and '_'")
        read_jsonl(path, problems)
    return problems
