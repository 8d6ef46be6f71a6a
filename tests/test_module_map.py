"""The module map of ``docs/architecture.md`` §5 is generated from the module docstrings and must not drift."""

from __future__ import annotations

from pathlib import Path

import pytest

from distmoe.module_map import SYNC_COMMAND, MapError, first_sentence, main, render_module_map

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_module_map_matches_the_docstrings():
    rows = render_module_map(ROOT)
    assert rows in (ROOT / "docs/architecture.md").read_text(encoding="utf-8"), \
        f"docs/architecture.md's module map is out of date: run `{SYNC_COMMAND}`"
    for path in [p for top in ("distmoe", "server", "clients") for p in (ROOT / top).rglob("*.py")]:
        rel = path.relative_to(ROOT).as_posix()  # every module with a docstring is on the map
        assert rel == "distmoe/__init__.py" or f"| `{rel}` |" in rows or not path.read_text().strip(), rel


def test_first_sentence_stops_at_the_first_sentence_in_markdown():
    assert first_sentence("The ledger (see :mod:`~distmoe.io`), e.g. ``x``.\nOwns: more. Must not: this.") == \
        "The ledger (see `distmoe.io`), e.g. `x`"
    assert first_sentence("Bonawitz et al. 2017, no period at the end\n\nSecond paragraph.") == \
        "Bonawitz et al. 2017, no period at the end"


def _repo(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in {"docs/architecture.md": "# A\n\n<!-- module-map:begin -->\n<!-- module-map:end -->\n",
                      **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text, encoding="utf-8")
    return tmp_path


def test_a_drifted_docstring_is_caught_and_rewritten(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("distmoe.module_map.MAP_BEGIN", "<!-- module-map:begin -->")
    root = _repo(tmp_path, {"distmoe/__init__.py": "", "distmoe/io.py": '"""Atomic writes. More."""\n'})
    assert main(["--root", str(root), "--check"]) == 1
    assert main(["--root", str(root)]) == 0
    assert "| `distmoe/io.py` | Atomic writes |" in (root / "docs/architecture.md").read_text()
    assert main(["--root", str(root), "--check"]) == 0
    (root / "distmoe/io.py").write_text('"""Crash-safe writes."""\n')
    assert main(["--root", str(root), "--check"]) == 1
    capsys.readouterr()


@pytest.mark.parametrize("files,match", [
    ({"distmoe/io.py": "x = 1\n"}, "distmoe/io.py: no module docstring"),
    ({"distmoe/newpkg/a.py": '"""A."""\n'}, "'newpkg' is in no layer"),
])
def test_a_module_that_cannot_be_mapped_is_named(tmp_path, files, match):
    root = _repo(tmp_path, {"distmoe/__init__.py": "", **files})
    with pytest.raises(MapError, match=match):
        render_module_map(root)
