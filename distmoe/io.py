"""Crash-safe file writes, the one implementation every module uses.

Owns: ``write_atomic`` (temp file in the same directory, ``fsync``, then ``os.replace``, or ``os.link``
when an existing file must not be replaced; the file mode is set on the temp file, so a private key
is never readable by others, not even for a moment; without ``mode`` a file keeps ``mkstemp``'s 0600),
its text/JSON forms ``write_text_atomic`` and ``write_json_atomic``, ``fsync_dir`` (makes a rename
durable), ``append_durable`` (one whole line in one ``O_APPEND`` write, then ``fsync``; a new file is
0600), and ``sanitize`` (the JSON-safe copy used by every JSON file a run writes: non-finite floats
become ``null``).

Must not: import anything of distmoe (this is the base layer), or interpret what it writes.
Why hand-written: the standard library has ``os.replace`` and ``tempfile`` but no atomic, durable
replace-or-refuse write; the maintained packages for it (``atomicwrites``) are archived.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["append_durable", "fsync_dir", "sanitize", "write_atomic", "write_json_atomic", "write_text_atomic"]


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename inside ``directory`` durable where the platform allows opening directories."""
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a file's bytes, read in 4 MiB chunks (memory stays flat whatever the file's size)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_all(fd: int, data: bytes, sync: bool = True) -> None:
    """Write every byte (a short write is finished, never left torn), then fsync (unless ``sync`` is False)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    if sync:
        os.fsync(fd)


def _holds(path: Path, data: bytes, mode: int | None) -> bool:
    """Whether ``path`` already holds exactly ``data`` (and ``mode``, when given): then rewriting it is a no-op."""
    try:
        st = path.stat()
        if st.st_size != len(data) or (mode is not None and (st.st_mode & 0o777) != mode):
            return False
        return path.read_bytes() == data
    except OSError:
        return False


def write_atomic(path: str | os.PathLike[str], data: bytes, *, mode: int | None = None,
                 replace: bool = True, changed_only: bool = False, durable: bool = True) -> bool:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one, never a part.
    Returns whether it wrote.

    ``mode``: the file's permission bits (independent of the umask), e.g. ``0o600`` for a secret.
    ``replace=False``: refuse (``FileExistsError``) when ``path`` exists, also when it appeared meanwhile
    (the final name is created with ``os.link``, which never replaces).
    ``changed_only=True``: skip the write (and its two fsyncs) when ``path`` already holds exactly ``data``
    with that mode; a file this function wrote is already durable, so nothing is lost.
    ``durable=False``: no fsync (of the file or its directory), for a cache whose loss or an older version of it
    after a crash costs only time (still atomic: never a part of the file).
    """
    path = Path(path)
    if changed_only and replace and _holds(path, data, mode):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            if mode is not None:
                os.fchmod(fd, mode)
            _write_all(fd, data, durable)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
            os.unlink(tmp)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)
    return True


def write_text_atomic(path: str | os.PathLike[str], text: str | bytes, *, changed_only: bool = False) -> bool:
    """Replace ``path`` with ``text`` (UTF-8) atomically (``changed_only``: as in :func:`write_atomic`)."""
    return write_atomic(path, text.encode("utf-8") if isinstance(text, str) else text, changed_only=changed_only)


def sanitize(obj: Any) -> Any:
    """Return a JSON-safe copy of ``obj``: NaN/Inf floats become ``None`` (recursively).

    Mappings become dicts with string keys, tuples/lists/sets become lists, and array-likes or scalars
    exposing ``tolist()`` (NumPy and similar, duck-typed, never imported) are converted first. Other
    objects are returned unchanged, so ``json.dumps`` rejects them loudly.
    """
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [sanitize(v) for v in obj]
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return sanitize(tolist())
    return obj


def write_json_atomic(path: str | os.PathLike[str], obj: Any, *, changed_only: bool = False) -> bool:
    """Atomically replace ``path`` with ``obj`` as indented JSON (non-finite floats written as null)."""
    return write_text_atomic(path, json.dumps(sanitize(obj), allow_nan=False, indent=2, sort_keys=False) + "\n",
                             changed_only=changed_only)


def append_durable(path: str | os.PathLike[str], data: bytes) -> None:
    """Append ``data`` (one whole record) with a single ``O_APPEND`` write, finished if short, then fsync."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # private: a party's log or ledger
    try:
        _write_all(fd, data)
    finally:
        os.close(fd)
