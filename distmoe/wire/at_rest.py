"""Privacy at rest and in logs: the checks a run passes before any training and again at its end.

Owns: the private modes of a party's files (``PRIVATE_DIR`` 0700, ``PRIVATE_FILE`` 0600), making a tree
private (:func:`make_private`), and the pre-run / end-of-run check (:func:`privacy_preflight`), which fails
(:class:`PreflightError`, naming every offending path) unless

- **isolation**: every party directory given (its data copy, its work directory) and everything below it
  has no group or other permission bits (a world-readable party directory is named with its mode);
- **allow-list**: the run's allow-list (``server_guard.build_policy``) takes free text in one field only,
  ``error.reason`` (bounded), and every other entry has a byte budget and only the ``metrics.*`` pattern;
- **logging**: the party's failure log line (``party_guard.failure_log``, what a party prints about a
  failed instruction) does not carry an exception's message or values: it is driven with a secret string
  in the message and in a local variable, and the check fails if the secret shows.

Within one machine account the modes protect each party's files from other users, not from another party
run under the same account (a simulation's parties share it): per-party accounts are the deployment's.

Must not: read file contents (only modes), import ``flwr``, or change a mode it only checks.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

from distmoe.wire.party_guard import failure_log

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
    """Drive the party's failure log with a secret in an exception's message and in a local value."""
    secret = "DISTMOE-PREFLIGHT-" + secrets.token_hex(8)

    def fail(example: str) -> None:
        raise ValueError(f"template error in answer {example!r}")

    try:
        fail(secret)
    except ValueError as exc:
        line = failure_log("preflight", "sft", exc)
    return [] if secret not in line else ["logging: the party's failure log prints exception messages (training "
                                          "text can reach flower.log)"]


def privacy_preflight(party_dirs: Mapping[str, Iterable[Path]], policy: Mapping | None = None, *,
                      when: str = "before the run") -> None:
    """Run the checks of the module docstring; raise :class:`PreflightError` listing every problem."""
    problems = check_isolation(party_dirs) + check_logging() + (check_allow_list(policy) if policy else [])
    if problems:
        raise PreflightError(f"privacy check {when} failed:\n  " + "\n  ".join(problems))
