"""Privacy at rest and in logs: the checks a run passes before any training and again at its end.

Owns: the private modes of a party's files (``PRIVATE_DIR`` 0700, ``PRIVATE_FILE`` 0600), making a tree
private (:func:`make_private`), and the pre-run / end-of-run check (:func:`privacy_preflight`), which fails
(:class:`PreflightError`, naming every offending path) unless

- **isolation**: every party directory given (its data copy, its work directory) and everything below it
  has no group or other permission bits (a world-readable party directory is named with its mode);
- **allow-list**: the run's allow-list (``server_guard.build_policy``) takes free text in one field only,
  ``error.reason`` (bounded), and every other entry has a byte budget and only the ``metrics.*`` pattern;
- **logging**: what a party prints to stdout about an error (``party_guard.log_detail``: the code and where
  the detail is; ``party_guard.failure_log``: type and frames for a failure with no party log) carries no
  detail or exception message: both are driven with a secret string, the check fails if it shows on
  stdout, or if the detail's own log (``<work-dir>/party.log``) is created readable by others.

Within one machine account the modes protect each party's files from other users, not from another party
run under the same account (a simulation's parties share it): per-party accounts are the deployment's.

Must not: read file contents (only modes), import ``flwr``, or change a mode it only checks.
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import stat
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import SimpleNamespace

from distmoe.rundir import WorkDir
from distmoe.wire.errors import ErrorCode
from distmoe.wire.party_guard import failure_log, log_detail

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
PRIVATE_UMASK = 0o077


class PreflightError(RuntimeError):
    """A privacy pre-run (or end-of-run) check failed; the message names each problem."""


def _walk(root: Path) -> Iterable[Path]:
    yield root
    if root.is_dir() and not root.is_symlink():
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                yield Path(dirpath) / name


def make_private(root: str | os.PathLike[str]) -> None:
    """``chmod`` ``root`` and everything below it: directories 0700, files 0600 (symlinks untouched)."""
    for p in _walk(Path(root)):
        if not p.is_symlink():
            os.chmod(p, PRIVATE_DIR if p.is_dir() else PRIVATE_FILE)


def exposed(root: str | os.PathLike[str]) -> list[str]:
    """Every path at or below ``root`` with a group or other permission bit, as ``'PATH (mode 0o755)'``."""
    out = []
    for p in _walk(Path(root)):
        if p.is_symlink():
            continue
        mode = stat.S_IMODE(p.stat().st_mode)
        if mode & 0o077:
            out.append(f"{p} (mode {mode:#o})")
    return out


def check_isolation(party_dirs: Mapping[str, Iterable[Path]]) -> list[str]:
    """Problems of each party's directories (missing ones are skipped: a work directory comes later)."""
    problems = []
    for party, dirs in party_dirs.items():
        for d in dirs:
            if not Path(d).exists():
                continue
            bad = exposed(d)
            if bad:
                shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
                problems.append(f"party {party}: readable or writable by group/others: {shown} (chmod -R go-rwx "
                                f"{d})")
    return problems


def check_allow_list(policy: Mapping) -> list[str]:
    """Problems of an allow-list: free text anywhere but a bounded ``error.reason``, or a missing budget."""
    problems = []
    err = policy.get("error")
    if not isinstance(err, Mapping) or list(err.get("keys", ())) != ["error.reason"] \
            or not 0 < int(err.get("max_bytes", 0)) <= 4096:
        problems.append("allow-list: the error entry must take error.reason only, within 4096 bytes")
    for tag, ent in policy.items():
        if not isinstance(ent, Mapping) or not isinstance(ent.get("max_bytes"), int) or ent["max_bytes"] <= 0:
            problems.append(f"allow-list: {tag!r} has no byte budget")
        elif ent.get("keys_pattern") not in (None, "metrics.*"):
            problems.append(f"allow-list: {tag!r} admits keys {ent['keys_pattern']!r}")
        elif tag != "error" and any(str(k).startswith(("error.", "text.")) for k in ent.get("keys", ())):
            problems.append(f"allow-list: {tag!r} carries a text field")
    return problems


def check_logging() -> list[str]:
    """Drive the party's stdout paths with a secret in an error's detail and an exception's message."""
    secret = "DISTMOE-PREFLIGHT-" + secrets.token_hex(8)
    problems = []

    def fail(example: str) -> None:
        raise ValueError(f"template error in answer {example!r}")

    out = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(out):
        try:
            fail(secret)
        except ValueError as exc:
            print(failure_log("preflight", "sft", exc))
            log = log_detail(SimpleNamespace(path=WorkDir(tmp).ledger("p")), ErrorCode.INTERNAL, "preflight",
                             f"ValueError: {exc}")
            if stat.S_IMODE(log.stat().st_mode) & 0o077:
                problems.append(f"logging: the party's own log is created readable by others ({log.name})")
    if secret in out.getvalue():
        problems.append("logging: a party prints error details or exception messages to stdout (training text can "
                        "reach flower.log)")
    return problems


def privacy_preflight(party_dirs: Mapping[str, Iterable[Path]], policy: Mapping | None = None, *,
                      when: str = "before the run") -> None:
    """Run the checks of the module docstring; raise :class:`PreflightError` listing every problem."""
    problems = check_isolation(party_dirs) + check_logging() + (check_allow_list(policy) if policy else [])
    if problems:
        raise PreflightError(f"privacy check {when} failed:\n  " + "\n  ".join(problems))
