"""The data owner's ``flwr-clientapp``: Flower's own ClientApp process, with the app bundle checked against the
owner's code pin (:mod:`distmoe.deploy.pin`) before anything of it is installed or imported.

Started by Flower's SuperExec (it finds ``<pin-dir>/bin/flwr-clientapp`` first on the ``PATH`` that
``distmoe deploy supernode --code-pin`` sets) as ``python -P -m clients.pinned --code-pin FILE <flwr args>``.
It runs from the owner's install, never from a bundle: this module, :mod:`distmoe.deploy.pin` and flwr are
imported before any bundle is on ``sys.path``. Because ``distmoe`` and ``clients`` are then already imported
from the owner's install, every party module the ClientApp imports later resolves there too (Python looks
submodules up in the imported package's own path), not in the bundle. It replaces one step of flwr 1.42's
``flwr.supernode.runtime.run_clientapp.run_clientapp``, the FAB installation, by: check the owner's
install against the pin (an install changed after pinning, or pinned from another source, is refused);
check the FAB's bytes against the pin (same party code, so the coordinator's ServerApp speaks the same
protocol; the ClientApp entry point is ``clients.app:app``; no top-level module that would shadow a
library the party imports later); install it (Flower's code), or, for a FAB Flower has installed before (every
message of a run after its first), take the directory Flower would return without Flower's extraction of the
whole FAB (:func:`installed_before`); check the installed directory. It also
shortens Flower's back-off when the message's content is not yet at the SuperNode (``PULL_BACKOFF_S``). A mismatch
raises :class:`PinRefused` inside Flower's task, so Flower answers the
message with its own error reply (``ClientApp raised an exception``) carrying only this module's fixed
text: no party code ran, nothing of the party's data was read. Which files differed goes to
``<pin-dir>/refusals.log`` (the owner's), and to stderr.

Must not: import anything of the bundle, or send anything but Flower's error reply on a refusal.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import sys
import zipfile
from collections.abc import Mapping
from pathlib import Path

from distmoe.deploy import pin as code_pin

# The ClientApp process is started as soon as the SuperNode has the message, often before the SuperNode has
# fetched its content from the SuperLink; flwr 1.42 then retries each missing object after 1, 2, 4, 8 s
# (``supercore/constant.py`` PULL_INITIAL_BACKOFF = 1, PULL_BACKOFF_CAP = 10): 4-18 s per message stage spent
# sleeping. Retried here after 50 ms, doubling up to 0.5 s (a local request to the SuperNode each).
PULL_BACKOFF_S, PULL_BACKOFF_CAP_S = 0.05, 0.5
REFUSAL = "distmoe code pin: the app bundle's party code is not the version this data owner pinned"
PASSED = "distmoe code pin: the app bundle's party code matches the pin"  # + the digest, on stderr (the owner's log)


class PinRefused(RuntimeError):
    """The bundle does not match the owner's pin (the text is fixed; the detail is in the refusal log)."""


def _refuse(pin_file: Path, problems: list[str], where: str) -> None:
    stamp = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    lines = [f"{stamp} refused ({where}): {p}" for p in problems]
    try:
        with (pin_file.parent / code_pin.REFUSAL_LOG).open("a") as fh:
            fh.write("\n".join(lines) + "\n")
    except OSError:
        pass
    print("\n".join(lines), file=sys.stderr, flush=True)
    raise PinRefused(REFUSAL)


def install_problems(pin: dict) -> list[str]:
    """How this process's own ``distmoe`` and ``clients`` (the ones it imported and will run) differ from the pin."""
    try:
        files = code_pin.files_of_dirs(code_pin.installed_package_dirs())
    except code_pin.CodePinError as exc:
        return [str(exc)]
    pinned = pin["files"]
    return (
        [
            f"{p}: the installed file differs from the pinned version"
            for p in sorted(files)
            if p in pinned and files[p] != pinned[p]
        ]
        + [f"{p}: installed but not in the pin" for p in sorted(set(files) - set(pinned))]
        + [f"{p}: pinned but not installed" for p in sorted(set(pinned) - set(files))]
    )


def installed_before(fab: bytes, files: Mapping[str, bytes]) -> Path | None:
    """The directory flwr 1.42's ``install_from_fab`` returns for ``fab`` (its ``files``) without installing anything,
    or None (then Flower installs, and raises its own errors). Flower returns an app directory that exists
    (``get_project_dir``: ``<FLWR_HOME>/apps/<publisher>.<name>.<version>.<first 8 hex digits of the FAB's sha256>``)
    as it is, but only after extracting the whole FAB to a temporary directory to check its manifest
    (``.info/CONTENT``: path, sha256, size per line): 0.3 s of CPU and some 200 files written and removed per
    message, every message of a run after its first. Here the same decision from the FAB's bytes in memory: Flower's
    metadata of its ``pyproject.toml`` (validated as Flower validates it), Flower's directory, and every line of the
    manifest naming a file of the FAB with that sha256. The caller still checks the directory against the pin."""
    from flwr.common.config import get_fab_config, get_metadata_from_config, get_project_dir

    try:
        fab_id, version = get_metadata_from_config(get_fab_config(fab))
        app_dir = get_project_dir(fab_id, version, hashlib.sha256(fab).hexdigest())
        manifest = files[".info/CONTENT"].decode("utf-8").strip().split("\n")
    except Exception:  # noqa: BLE001 - anything Flower's own install would refuse: let it (and its error) decide
        return None
    for line in manifest:
        parts = line.split(",")
        if len(parts) != 3 or parts[0] not in files or hashlib.sha256(files[parts[0]]).hexdigest() != parts[1]:
            return None
    return app_dir if app_dir.is_dir() else None


def checked_installer(pin_file: Path, install):
    """``install`` (flwr's ``install_from_fab``) with the pin checked: this owner's install (what runs), then
    the bundle before it is installed, then the installed directory."""
    pin = code_pin.load_pin(pin_file)
    installed = install_problems(pin)

    def install_checked(fab_file, *args, **kwargs):
        if installed:
            _refuse(pin_file, installed, "this data owner's install")
        if not isinstance(fab_file, bytes):
            _refuse(pin_file, [f"unexpected FAB argument {type(fab_file).__name__}"], "bundle")
        try:
            files = code_pin.fab_files(fab_file)
        except (zipfile.BadZipFile, OSError, ValueError):
            files = None
        problems = code_pin.check_fab(fab_file, pin) if files is None else code_pin.check_files(files, pin)
        if problems:
            _refuse(pin_file, problems, "bundle")
        app_dir = installed_before(fab_file, files) or Path(install(fab_file, *args, **kwargs))
        problems = code_pin.check_dir(app_dir, pin)
        if problems:
            _refuse(pin_file, problems, f"installed {app_dir}")
        print(f"{PASSED} {pin['digest']}", file=sys.stderr, flush=True)
        code_pin.set_active_digest(pin["digest"])  # recorded in the party's ledger at setup
        return app_dir

    return install_checked


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] != "--code-pin":
        print("usage: python -m clients.pinned --code-pin FILE <flwr-clientapp arguments>", file=sys.stderr)
        raise SystemExit(2)
    pin_file = Path(argv[1]).resolve()
    try:
        code_pin.load_pin(pin_file)
    except code_pin.CodePinError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    from flwr.supernode.cli.flwr_clientapp import flwr_clientapp
    from flwr.supernode.runtime import run_clientapp as rc

    rc.install_from_fab = checked_installer(pin_file, rc.install_from_fab)
    rc.pull_and_inflate_object_from_tree = functools.partial(
        rc.pull_and_inflate_object_from_tree, initial_backoff=PULL_BACKOFF_S, backoff_cap=PULL_BACKOFF_CAP_S)
    sys.argv = ["flwr-clientapp", *argv[2:]]
    flwr_clientapp()


if __name__ == "__main__":
    main()
