"""The data owner's code pin (``distmoe.deploy.pin``, ``distmoe deploy pin``) and the launcher's check
(``clients.pinned``): hashing, the bundle rules, and the refusal before any bundle code is installed.

Each attack is a bundle a coordinator could ship; the defence exercised is :func:`distmoe.deploy.pin.check_fab`
(without it the bundle would be installed and imported as is: Flower checks only the FAB's own hash list).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from clients import pinned
from distmoe.deploy import pin as cp

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pin() -> dict:
    return cp.make_pin(cp.source_files(REPO))


def _repo_files() -> dict[str, bytes]:
    """The bundle ``flwr run`` builds from this repository (pyproject's fab-include: distmoe, server, clients)."""
    files = {"pyproject.toml": (REPO / "pyproject.toml").read_bytes()}
    for pkg in ("distmoe", "server", "clients"):
        for f in (REPO / pkg).rglob("*.py"):
            if "__pycache__" not in f.parts:
                files[f.relative_to(REPO).as_posix()] = f.read_bytes()
    return files


def _fab(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(".info/CONTENT", "whatever Flower lists\n")
    return buf.getvalue()


def test_digest_is_order_free_and_changes_with_one_byte():
    a = {"distmoe/a.py": "00" * 32, "clients/app.py": "11" * 32}
    assert cp.digest(a) == cp.digest(dict(reversed(list(a.items()))))
    assert cp.digest(a) != cp.digest({**a, "distmoe/a.py": "00" * 31 + "01"})
    assert cp.digest(a) != cp.digest({**a, "distmoe/b.py": "00" * 32})


def test_source_files_cover_the_party_side_only(pin):
    files = pin["files"]
    assert "clients/app.py" in files and "distmoe/party/session.py" in files and "clients/pinned.py" in files
    assert not any(p.startswith("server/") or "__pycache__" in p for p in files)
    assert all(p.endswith(".py") for p in files)
    import hashlib

    assert files["clients/app.py"] == hashlib.sha256((REPO / "clients" / "app.py").read_bytes()).hexdigest()


def test_a_wheel_pins_the_same_as_its_directory(tmp_path, pin):
    wheel = tmp_path / "distmoe-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for rel in pin["files"]:
            z.write(REPO / rel, rel)
        z.writestr("distmoe-0.1.0.dist-info/RECORD", "")
    assert cp.make_pin(cp.source_files(wheel))["digest"] == pin["digest"]


def test_flowers_own_bundle_of_this_repository_matches_the_pin(pin):
    from flwr.cli.build import build_fab_from_disk

    assert cp.check_fab(build_fab_from_disk(REPO), pin) == []


def test_the_honest_bundle_and_a_changed_serverapp_pass(pin):
    files = _repo_files()
    assert cp.check_fab(_fab(files), pin) == []
    files["server/app.py"] += b"\n# the coordinator's own ServerApp may change\n"
    files["server/extra.py"] = b"x = 1\n"
    assert cp.check_fab(_fab(files), pin) == []


@pytest.mark.parametrize(
    "attack, expect",
    [
        (
            lambda f: f.__setitem__("distmoe/party/session.py", f["distmoe/party/session.py"] + b"\nLEAK = 1\n"),
            "distmoe/party/session.py: differs from the pinned version",
        ),
        (lambda f: f.__setitem__("distmoe/party/helper.py", b"x = 1\n"), "distmoe/party/helper.py: not in the pin"),
        (lambda f: f.__setitem__("numpy.py", b"# shadows the party's numpy\n"), "numpy.py: not in the pin"),
        (
            lambda f: f.__setitem__("distmoe/__pycache__/io.cpython-311.pyc", b"\0"),
            "distmoe/__pycache__/io.cpython-311.pyc: compiled file",
        ),
        (lambda f: f.pop("distmoe/wire/party_guard.py"), "distmoe/wire/party_guard.py: pinned but missing"),
        (
            lambda f: f.__setitem__(
                "pyproject.toml",
                f["pyproject.toml"].replace(b'clientapp = "clients.app:app"', b'clientapp = "server.evil:app"'),
            ),
            "pyproject.toml: clientapp is 'server.evil:app'",
        ),
        (lambda f: f.__setitem__("../escape.py", b""), "../escape.py: path outside the bundle"),
    ],
)
def test_a_modified_bundle_is_refused_naming_the_file(pin, attack, expect):
    files = _repo_files()
    attack(files)
    problems = cp.check_fab(_fab(files), pin)
    assert any(p.startswith(expect) for p in problems), problems


def test_a_bundle_that_is_not_a_zip_is_refused(pin):
    assert cp.check_fab(b"not a zip", pin) == ["the bundle is not a readable zip (BadZipFile)"]


def test_an_edited_pin_file_is_refused(tmp_path, pin):
    pin_file, _ = cp.write_pin(tmp_path / "p", pin["files"])
    doc = json.loads(pin_file.read_text())
    doc["files"]["distmoe/party/session.py"] = "00" * 32  # "allow" a modified session.py
    pin_file.write_text(json.dumps(doc))
    with pytest.raises(cp.CodePinError, match="digest does not match its file list"):
        cp.load_pin(pin_file)


def test_the_launcher_refuses_before_installing_and_logs_the_file(tmp_path, pin):
    pin_file, _ = cp.write_pin(tmp_path / "p", pin["files"])
    installed = []
    install = pinned.checked_installer(pin_file, lambda fab, *a, **k: installed.append(fab) or tmp_path / "x")
    files = _repo_files()
    files["distmoe/privacy/dp.py"] += b"\n"
    with pytest.raises(pinned.PinRefused) as err:
        install(_fab(files), skip_prompt=True)
    assert str(err.value) == pinned.REFUSAL and "dp.py" not in str(err.value)  # the fixed text only leaves
    assert installed == []  # nothing of the bundle was installed (so nothing of it can be imported)
    assert "distmoe/privacy/dp.py: differs from the pinned version" in (tmp_path / "p" / cp.REFUSAL_LOG).read_text()


def test_the_launcher_checks_the_installed_directory_too(tmp_path, pin):
    """An app directory left from before (Flower reuses an existing one of the same short hash) is checked."""
    pin_file, _ = cp.write_pin(tmp_path / "p", pin["files"])
    app = tmp_path / "app"
    for rel, data in _repo_files().items():
        (app / rel).parent.mkdir(parents=True, exist_ok=True)
        (app / rel).write_bytes(data)
    (app / "distmoe" / "__pycache__").mkdir(exist_ok=True)
    (app / "distmoe" / "__pycache__" / "io.cpython-311.pyc").write_bytes(b"\0")  # Python's own: skipped
    install = pinned.checked_installer(pin_file, lambda fab, *a, **k: app)
    assert install(_fab(_repo_files())) == app
    (app / "distmoe" / "ledger.py").write_bytes(b"# replaced\n")
    with pytest.raises(pinned.PinRefused):
        install(_fab(_repo_files()))


def _flower_fab(files: dict[str, bytes]) -> bytes:
    """A FAB as ``flwr build`` writes it: the files and Flower's manifest (path, sha256, size per line)."""
    manifest = "".join(f"{rel},{hashlib.sha256(data).hexdigest()},{len(data)}\n" for rel, data in files.items())
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(".info/CONTENT", manifest)
    return buf.getvalue()


def test_a_bundle_flower_installed_before_is_checked_again_without_flowers_extraction(tmp_path, pin, monkeypatch):
    """Each message of a run carries the same FAB; flwr 1.42 extracts all of it to a temporary directory before it
    returns the app directory it installed at the first message. The launcher takes that directory from the FAB's
    bytes instead (Flower's path, Flower's manifest check): Flower's install runs once per FAB, and both pin checks,
    the bundle's and the installed directory's, still run for every message."""
    from flwr.cli.install import install_from_fab

    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr"))
    pin_file, _ = cp.write_pin(tmp_path / "p", pin["files"])
    flower_runs = []
    install = pinned.checked_installer(pin_file, lambda fab, *a, **k: flower_runs.append(1) or install_from_fab(
        fab, *a, **k))
    fab = _flower_fab(_repo_files())
    assert pinned.installed_before(fab, cp.fab_files(fab)) is None  # not installed yet: Flower installs
    app_dir = install(fab, skip_prompt=True)
    assert flower_runs == [1]
    assert pinned.installed_before(fab, cp.fab_files(fab)) == app_dir == install_from_fab(fab, skip_prompt=True)
    assert install(fab, skip_prompt=True) == app_dir and install(fab, skip_prompt=True) == app_dir
    assert flower_runs == [1]  # the second and third message: no extraction
    (app_dir / "distmoe" / "ledger.py").write_bytes(b"# replaced\n")  # the reused directory is still checked
    with pytest.raises(pinned.PinRefused):
        install(fab, skip_prompt=True)
    files = _repo_files()
    bad = _fab(files)  # the same files under a manifest that does not list them: Flower's own check decides
    assert pinned.installed_before(bad, cp.fab_files(bad)) is None
    files["distmoe/privacy/dp.py"] += b"\n"  # and the bundle's pin check still comes first
    with pytest.raises(pinned.PinRefused):
        install(_flower_fab(files), skip_prompt=True)
    assert flower_runs == [1]


@pytest.mark.slow  # a real subprocess (imports torch, transformers and distmoe afresh)
def test_deploy_pin_prints_the_digest_and_writes_the_launcher(tmp_path, pin):
    out = tmp_path / "pin"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run(
        [sys.executable, "-m", "distmoe.cli", "deploy", "pin", "--out", str(out), "--source", str(REPO)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == f"code pin {pin['digest']}"
    assert f"{len(pin['files'])} party-side files from {REPO}" in lines[1]
    assert lines[-1] == f"next: distmoe deploy supernode ... --code-pin {out.resolve()}"
    launcher = out / "bin" / "flwr-clientapp"
    assert stat.S_IMODE(launcher.stat().st_mode) == 0o755 and stat.S_IMODE(out.stat().st_mode) == 0o700
    text = launcher.read_text()
    assert f"-P -m clients.warm --code-pin {out.resolve() / 'code-pin.json'}" in text and sys.executable in text
    cold = cp.launcher_script(out.resolve() / "code-pin.json", sys.executable, warm=False)  # deploy pin --cold
    assert f"-P -m clients.pinned --code-pin {out.resolve() / 'code-pin.json'}" in cold
    assert cp.load_pin(out / "code-pin.json")["digest"] == pin["digest"]
    again = subprocess.run(
        [sys.executable, "-m", "distmoe.cli", "deploy", "pin", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert again.returncode == 2 and "already exists; refusing to overwrite it" in again.stderr


def test_pin_sources_that_are_not_distmoe_are_refused(tmp_path):
    (tmp_path / "distmoe").mkdir()
    with pytest.raises(cp.CodePinError, match="not a Python package directory"):
        cp.source_files(tmp_path)
    with pytest.raises(cp.CodePinError, match="neither a wheel nor a directory"):
        cp.source_files(tmp_path / "missing")


def test_an_owner_install_that_differs_from_the_pin_is_refused(tmp_path, pin):
    """The code that runs is the owner's install (the launcher imported it first): an install changed after
    pinning, or a pin of another release, refuses every bundle, even one that matches the pin."""
    files = dict(pin["files"])
    files["distmoe/party/session.py"] = "00" * 32  # the pin says one thing, the install holds another
    pin_file, other = cp.write_pin(tmp_path / "p", files)
    assert pinned.install_problems(other) == [
        "distmoe/party/session.py: the installed file differs from the pinned version"
    ]
    install = pinned.checked_installer(pin_file, lambda fab, *a, **k: pytest.fail("installed"))
    with pytest.raises(pinned.PinRefused):
        install(_fab(_repo_files()))
    assert "refused (this data owner's install)" in (tmp_path / "p" / cp.REFUSAL_LOG).read_text()
    assert pinned.install_problems(pin) == []


@pytest.mark.slow  # a real subprocess (imports torch, transformers and distmoe afresh)
def test_party_modules_resolve_to_the_owners_install_once_the_launcher_imported_it(tmp_path):
    """Python semantics the launcher relies on: after ``distmoe`` is imported from the owner's install, a bundle
    directory put first on ``sys.path`` (as Flower does) does not supply ``distmoe`` submodules."""
    bundle = tmp_path / "bundle"
    (bundle / "distmoe" / "party").mkdir(parents=True)
    (bundle / "distmoe" / "__init__.py").write_text("")
    (bundle / "distmoe" / "party" / "__init__.py").write_text("")
    (bundle / "distmoe" / "party" / "session.py").write_text("raise SystemExit('bundle code ran')\n")
    code = (
        "import sys, clients.pinned; "
        f"sys.path.insert(0, {str(bundle)!r}); import distmoe.party.session as s; print(s.__file__)"
    )
    res = subprocess.run(
        [sys.executable, "-P", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=str(tmp_path),
    )
    assert res.returncode == 0, res.stderr
    assert all(p.startswith(str(REPO)) for p in res.stdout.split()), res.stdout


def test_the_coordinators_run_config_file_does_not_land_in_the_bundle(tmp_path, pin):
    """The run-config file of a deployment run (``exp1.toml`` next to ``pyproject.toml``, docs/deploy.md §1.5)
    is not shipped: pyproject's ``fab-include`` takes only ``*.py`` of distmoe/, server/, clients/, so Flower's
    own build of ``flwr run .`` leaves it out (wherever the coordinator puts it) and the bundle still matches the
    owners' pin; a bundle that did carry it would be refused by every pinned SuperNode."""
    import shutil

    from flwr.cli.build import build_fab_from_disk

    app = tmp_path / "checkout"
    app.mkdir()
    shutil.copy2(REPO / "pyproject.toml", app / "pyproject.toml")
    for pkg in ("distmoe", "server", "clients", "configs"):
        shutil.copytree(REPO / pkg, app / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    run_config = (REPO / "configs" / "continual.toml").read_text() + "\n[federation]\nmin-available = 3\n"
    for where in ("exp1.toml", "configs/exp1.toml", "distmoe/exp1.toml", "server/exp1.toml"):
        (app / where).write_text(run_config)
    with zipfile.ZipFile(io.BytesIO(build_fab_from_disk(app))) as z:
        names = z.namelist()
        shipped = {n: z.read(n) for n in names if not n.startswith(".info/")}
    assert not [n for n in names if n.endswith(".toml") and n != "pyproject.toml"], names
    assert not any(n.startswith("configs/") for n in names)
    assert cp.check_fab(_fab(shipped), pin) == []
    assert cp.check_fab(_fab({**shipped, "exp1.toml": run_config.encode()}), pin) == [
        "exp1.toml: not in the pin (an added or renamed module)"]
