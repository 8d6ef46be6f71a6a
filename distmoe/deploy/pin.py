"""The data owner's pin of the code that runs at its SuperNode (``distmoe deploy pin``) and the check of an
app bundle (FAB) against it, made by the owner's own ``flwr-clientapp`` (:mod:`clients.pinned`) before
anything of the bundle is imported.

Why (``docs/privacy.md`` §1): in a deployment the coordinator ships the app bundle, so the ClientApp, the
party guard, the SecAgg client, the DP noise, the party ledger and the ``epsilon-max`` check are code the
coordinator chooses. Flower 1.42's app verification (``flower-supernode --trusted-entities``) does not
help on a self-hosted SuperLink: only FABs fetched from Flower Hub carry verification records; a bundle
submitted with ``flwr run <dir>`` has none and a SuperNode with trusted entities refuses *every* run
("App verification is not supported by the connected SuperLink"; flwr ``supernode/start_client_internal.py``
344-352, ``superlink/servicer/control/control_handlers.py`` 636 and 689-691). So the owner pins the
party-side code instead: the sha256 of every file of the ``distmoe`` and ``clients`` packages of a copy it
reviewed (its own install, a checkout or a wheel). A bundle passes only when

- each of its files under ``distmoe/`` and ``clients/`` is a pinned file with the pinned sha256, and every
  pinned file is in it (a modified, added or missing party module is refused);
- its ``pyproject.toml`` names the pinned ClientApp (``clients.app:app``: the entry point cannot move to
  unpinned code);
- its only other files are the coordinator's ``server/`` package and Flower's ``.info/`` metadata (no
  top-level module that could shadow a library the party imports: the bundle's directory comes first on
  ``sys.path``).

Not covered (the residual risk, ``docs/privacy.md`` §1): the run config values and the model/anchor the
coordinator sends are inputs the pinned code checks, not code; the owner's Python environment (torch,
flwr, ...) is the owner's.

Owns: the pin file format (``code-pin.json``: ``format``, ``digest``, ``files`` {path: sha256}), the
digest, the bundle rules above, the owner's launcher script ``bin/flwr-clientapp`` that Flower's
SuperExec finds first on ``PATH`` (warm: :mod:`clients.warm`; cold: :mod:`clients.pinned`), and the
digest the launcher checked in this process (``active_digest``).

Must not: import ``flwr`` (the launcher that does is :mod:`clients.pinned`), or read anything but the
source it is given and the pin.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import shlex
import sys
import tomllib
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath

from distmoe.io import write_atomic

PIN_FORMAT = "distmoe-code-pin/1"
PIN_FILE = "code-pin.json"
LAUNCHER = "flwr-clientapp"  # the executable name Flower's SuperExec starts for a ClientApp (flwr 1.42)
PINNED_PACKAGES = ("distmoe", "clients")  # the party side: the library and the ClientApp
CLIENTAPP_REF = "clients.app:app"
COORDINATOR_PACKAGE = "server"  # the ServerApp: the coordinator's own code, never imported by the party
REFUSAL_LOG = "refusals.log"
# the digest of the pin this process's bundle and install matched, set only by the pinned launcher
# (``clients.pinned``) in the ClientApp process itself (never from the environment, which a process inherits):
# the party records it in its ledger at setup (``distmoe.party.policy.ledger_facts``); None = not pinned
_ACTIVE: dict[str, str] = {}


def set_active_digest(value: str) -> None:
    _ACTIVE["digest"] = str(value)


def active_digest() -> str | None:
    return _ACTIVE.get("digest")


class CodePinError(ValueError):
    """A pin that cannot be made or read, or a bundle that does not match it (the message names the file)."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _is_pinned_path(rel: str) -> bool:
    parts = PurePosixPath(rel).parts
    return len(parts) >= 2 and parts[0] in PINNED_PACKAGES and "__pycache__" not in parts and rel.endswith(".py")


def digest(files: Mapping[str, str]) -> str:
    """sha256 over the sorted lines ``<path> <sha256>`` (one per pinned file): the pin in one value."""
    text = "".join(f"{p} {files[p]}\n" for p in sorted(files))
    return _sha256(text.encode("utf-8"))


# --------------------------------------------------------------------------------------------- sources
def files_of_dirs(package_dirs: Mapping[str, Path]) -> dict[str, str]:
    """{``<package>/<path>.py``: sha256} of every Python file under each package directory."""
    out: dict[str, str] = {}
    for pkg, d in package_dirs.items():
        if not (d / "__init__.py").is_file():
            raise CodePinError(f"{d}: not a Python package directory (no __init__.py) for '{pkg}'")
        for f in sorted(d.rglob("*.py")):
            rel = f"{pkg}/{f.relative_to(d).as_posix()}"
            if _is_pinned_path(rel):
                out[rel] = _sha256(f.read_bytes())
    return out


def files_of_wheel(wheel: Path) -> dict[str, str]:
    """{path: sha256} of the party-side Python files in a wheel (or any zip with the packages at its root)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            return {n: _sha256(z.read(n)) for n in z.namelist() if _is_pinned_path(n)}
    except (OSError, zipfile.BadZipFile) as exc:
        raise CodePinError(f"{wheel}: not a readable wheel ({type(exc).__name__}: {exc})") from None


def installed_package_dirs() -> dict[str, Path]:
    """Where this Python imports ``distmoe`` and ``clients`` from (the owner's install)."""
    out = {}
    for pkg in PINNED_PACKAGES:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise CodePinError(
                f"package '{pkg}' is not installed in {sys.executable}; install distmoe "
                "(pip install <wheel or checkout>) or pass --source"
            )
        out[pkg] = Path(next(iter(spec.submodule_search_locations))).resolve()
    return out


def source_files(source: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """The party-side files of ``source``: a wheel, a directory holding ``distmoe/`` and ``clients/``
    (a checkout or an unpacked wheel), or ``None`` for this Python's install."""
    if source is None:
        files = files_of_dirs(installed_package_dirs())
    else:
        src = Path(source).expanduser()
        if src.is_file():
            files = files_of_wheel(src)
        elif src.is_dir():
            files = files_of_dirs({pkg: src / pkg for pkg in PINNED_PACKAGES})
        else:
            raise CodePinError(f"--source: {src} is neither a wheel nor a directory")
    for pkg in PINNED_PACKAGES:
        if f"{pkg}/__init__.py" not in files:
            raise CodePinError(f"{source or sys.executable}: no '{pkg}' package in it (nothing to pin)")
    if "clients/app.py" not in files:
        raise CodePinError(f"{source or sys.executable}: no clients/app.py (the ClientApp) in it")
    return files


def make_pin(files: Mapping[str, str]) -> dict:
    return {
        "format": PIN_FORMAT,
        "clientapp": CLIENTAPP_REF,
        "digest": digest(files),
        "files": dict(sorted(files.items())),
    }


def load_pin(path: str | os.PathLike[str]) -> dict:
    """A pin file, its digest recomputed from its file list (an edited list is an error)."""
    path = Path(path)
    try:
        pin = json.loads(path.read_text())
    except FileNotFoundError:
        raise CodePinError(f"{path} not found: make it with 'distmoe deploy pin'") from None
    except (OSError, ValueError) as exc:
        raise CodePinError(f"{path} is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(pin, dict) or pin.get("format") != PIN_FORMAT or not isinstance(pin.get("files"), dict):
        raise CodePinError(f"{path}: not a {PIN_FORMAT} file")
    if digest(pin["files"]) != pin.get("digest"):
        raise CodePinError(f"{path}: its digest does not match its file list (the file was edited)")
    return pin


# --------------------------------------------------------------------------------------------- checks
def _check_pyproject(data: bytes) -> list[str]:
    try:
        cfg = tomllib.loads(data.decode("utf-8"))
        ref = cfg["tool"]["flwr"]["app"]["components"]["clientapp"]
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, KeyError, TypeError):
        return ["pyproject.toml: no [tool.flwr.app.components] clientapp"]
    return [] if ref == CLIENTAPP_REF else [f"pyproject.toml: clientapp is {ref!r}, the pin allows {CLIENTAPP_REF!r}"]


def check_files(files: Mapping[str, bytes], pin: Mapping) -> list[str]:
    """What keeps a bundle's files (``{posix path: content}``) from matching ``pin``; ``[]`` = it matches."""
    pinned: Mapping[str, str] = pin["files"]
    problems, seen = [], set()
    for rel, data in sorted(files.items()):
        p = PurePosixPath(rel)
        if p.is_absolute() or ".." in p.parts or not p.parts:
            problems.append(f"{rel}: path outside the bundle")
            continue
        top = p.parts[0]
        if top == ".info" or (len(p.parts) > 1 and top == COORDINATOR_PACKAGE):
            continue  # Flower's metadata; the coordinator's ServerApp package
        if rel == "pyproject.toml":
            problems += _check_pyproject(data)
            continue
        if "__pycache__" in p.parts:
            problems.append(f"{rel}: compiled file in the bundle")
        elif rel not in pinned:
            problems.append(f"{rel}: not in the pin (an added or renamed module)")
        elif _sha256(data) != pinned[rel]:
            problems.append(f"{rel}: differs from the pinned version")
        seen.add(rel)
    problems += [f"{rel}: pinned but missing from the bundle" for rel in sorted(set(pinned) - seen)]
    if "pyproject.toml" not in files:
        problems.append("pyproject.toml: missing")
    return problems


def fab_files(fab: bytes) -> dict[str, bytes]:
    """The files of a FAB (a zip), ``{entry name: content}``; raises ``zipfile.BadZipFile``, ``OSError`` or
    ``ValueError`` on an unreadable one."""
    with zipfile.ZipFile(io.BytesIO(fab)) as z:
        return {i.filename: z.read(i) for i in z.infolist() if not i.is_dir()}


def check_fab(fab: bytes, pin: Mapping) -> list[str]:
    """:func:`check_files` on the entries of a FAB (a zip); an unreadable FAB is one problem."""
    try:
        files = fab_files(fab)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        return [f"the bundle is not a readable zip ({type(exc).__name__})"]
    return check_files(files, pin)


def check_dir(app_dir: Path, pin: Mapping) -> list[str]:
    """:func:`check_files` on an installed app directory (Python's own ``__pycache__`` is skipped)."""
    files = {
        f.relative_to(app_dir).as_posix(): f.read_bytes()
        for f in sorted(app_dir.rglob("*"))
        if f.is_file() and "__pycache__" not in f.relative_to(app_dir).parts
    }
    return check_files(files, pin)


# --------------------------------------------------------------------------------------------- owner's files
def launcher_script(pin_file: Path, python: str, *, warm: bool = True) -> str:
    """``bin/flwr-clientapp``: this owner's Python runs the pinned launcher with the pin (``-P``: the current
    directory is not put on ``sys.path``, so no file there can stand in for the launcher). ``warm``: the
    SuperNode's warm worker serves the message in a forked child (:mod:`clients.warm`); otherwise a cold
    process per message (:mod:`clients.pinned`). Both make the same pin checks."""
    module = "clients.warm" if warm else "clients.pinned"
    return (
        "#!/bin/sh\n# distmoe code pin: Flower's SuperExec starts this instead of flwr's own flwr-clientapp\n"
        f'exec {shlex.quote(python)} -P -m {module} --code-pin {shlex.quote(str(pin_file))} "$@"\n'
    )


def write_pin(
    out: str | os.PathLike[str], files: Mapping[str, str], *, python: str | None = None, force: bool = False,
    warm: bool = True,
) -> tuple[Path, dict]:
    """Write ``OUT/code-pin.json`` and ``OUT/bin/flwr-clientapp``; returns (pin file, pin)."""
    out = Path(out).expanduser().resolve()
    pin_file, launcher = out / PIN_FILE, out / "bin" / LAUNCHER
    if not force:
        for t in (pin_file, launcher):
            if t.exists():
                raise CodePinError(f"{t} already exists; refusing to overwrite it (use --force)")
    pin = make_pin(files)
    for d in (out, out / "bin"):
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(d, 0o700)
    write_atomic(pin_file, (json.dumps(pin, indent=1) + "\n").encode("utf-8"), mode=0o644, replace=force)
    write_atomic(
        launcher, launcher_script(pin_file, python or sys.executable, warm=warm).encode("utf-8"), mode=0o755,
        replace=force
    )
    return pin_file, pin


def pin_dir_of(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """(pin file, launcher directory) of a directory made by :func:`write_pin`, both checked."""
    d = Path(path).expanduser().resolve()
    pin_file, bindir = d / PIN_FILE, d / "bin"
    load_pin(pin_file)
    if not os.access(bindir / LAUNCHER, os.X_OK):
        raise CodePinError(f"{bindir / LAUNCHER} is missing or not executable: run 'distmoe deploy pin --out {d}'")
    return pin_file, bindir


def summary(pin_file: Path, pin: Mapping, sources: Iterable[str]) -> str:
    return "\n".join(
        [
            f"code pin {pin['digest']}",
            f"  {len(pin['files'])} party-side files from {', '.join(sources)}",
            f"  pin file: {pin_file}",
            f"  launcher: {pin_file.parent / 'bin' / LAUNCHER}",
            f"next: distmoe deploy supernode ... --code-pin {pin_file.parent}",
        ]
    )
