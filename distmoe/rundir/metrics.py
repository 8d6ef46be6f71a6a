"""The run's append-only metrics log (``metrics.jsonl``): its line format, crash-safe appends and tolerant reading.

Owns: the on-disk format of ``metrics.jsonl`` (one JSON object per line, non-finite floats stored as
``null``, a unix ``"time"`` on every event), crash-safe appends (the whole line in one ``os.write`` on an
``O_APPEND`` descriptor, then ``fsync``: ``distmoe.io``) and tolerant reading (a torn trailing line from a
crash is skipped and counted; corruption anywhere else is an error naming file and line). A party's own
``<work-dir>/metrics/<party>.jsonl`` has the same format.

Must not: import ``flwr`` or ``torch``, interpret events (that is the report's job), name where the log lies
(``distmoe.rundir.layout``), or buffer events in memory: every ``append`` is durable when it returns.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distmoe.io import append_durable, sanitize

__all__ = ["MetricsLog", "MetricsRecords", "read_metrics"]

log = logging.getLogger(__name__)


def _dumps_line(event: Mapping[str, Any]) -> bytes:
    return (json.dumps(sanitize(event), allow_nan=False, separators=(",", ":")) + "\n").encode("utf-8")


class MetricsLog:
    """Append-only JSON-lines log. Each :meth:`append` is one durable ``os.write`` of one full line."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def append(self, event: Mapping[str, Any]) -> dict[str, Any]:
        """Write ``event`` as one line (adding ``"time"`` if missing) and fsync; return what was written."""
        if not isinstance(event, Mapping):
            raise TypeError(f"metrics event must be a mapping, got {type(event).__name__}")
        record = dict(event)
        record.setdefault("time", time.time())
        line = _dumps_line(record)  # fully built before the file is touched: a failure writes nothing
        append_durable(self.path, line)
        return json.loads(line)

    def __repr__(self) -> str:
        return f"MetricsLog({str(self.path)!r})"


class MetricsRecords(list):
    """The events of a metrics file (a ``list[dict]``) plus ``skipped``: torn trailing lines dropped."""

    skipped: int = 0


def _is_padding(raw: bytes) -> bool:
    return not raw.strip(b" \t\r\n\x00")


def read_metrics(path: str | os.PathLike[str]) -> MetricsRecords:
    """Read every event of a ``metrics.jsonl``.

    A last line that does not parse (a write torn by a crash, or NUL padding after a power loss) is
    skipped and counted in ``result.skipped``; a malformed or non-object line anywhere before it raises
    :class:`ValueError` naming the file and the 1-based line number. Blank lines are ignored.
    """
    path = Path(path)
    data = path.read_bytes()
    lines = data.split(b"\n")
    # Index of the last line with content: only that one may be a torn write.
    last = max((i for i, raw in enumerate(lines) if not _is_padding(raw)), default=-1)
    out = MetricsRecords()
    for i, raw in enumerate(lines):
        if _is_padding(raw):
            continue
        try:
            obj = json.loads(raw.decode("utf-8"))
            if not isinstance(obj, dict):
                raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if i == last:
                out.skipped += 1
                log.warning("%s: skipping partial trailing line %d (%s)", path, i + 1, exc)
                continue
            raise ValueError(f"{path}: line {i + 1}: malformed metrics line: {exc}") from exc
        out.append(obj)
    return out
