"""The README's install lines are true of ``pyproject.toml``: the torch they install first is one distmoe's own
requirement accepts (so ``pip install -e .`` keeps it rather than replacing it), the CPU-only alternative names the
same release, and no package-index URL is written into the repository's instructions."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _torch_requirement() -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(r for r in map(Requirement, deps) if r.name == "torch")


def test_the_torch_the_readme_installs_first_is_one_distmoe_accepts():
    readme = (ROOT / "README.md").read_text()
    commands = [x for x in readme.splitlines() if x.startswith("python3.11 -m venv .venv && ")]
    assert len(commands) == 2  # the quick start and the full test suite
    spec = _torch_requirement().specifier
    for cmd in commands:
        pins = re.findall(r"pip install torch==(\S+) && \.venv/bin/pip install -e ", cmd)
        assert len(pins) == 1, cmd  # torch first, then distmoe against it
        assert Version(pins[0]) in spec, (pins[0], str(spec))  # pip keeps it: no second, different torch
    cpu = re.findall(r"`torch==(\S+?)\+cpu`", readme)
    assert cpu and all(v == pins[0] for v in cpu)  # the CPU-only line names the same release
    assert Version(f"{pins[0]}+cpu") in spec  # and the +cpu local version meets the requirement too


def test_no_package_index_url_in_the_install_instructions():
    text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "deploy.md").read_text()
    assert not re.search(r"--(extra-)?index-url|download\.pytorch\.org|pypi\.org/simple", text)
