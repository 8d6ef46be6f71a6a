"""Architecture rules from DESIGN.md section 2, checked on the source with ``ast``.

- ``flwr`` is imported only in ``server/``, ``clients/`` and ``distmoe/wire/``;
- Flower records and messages are constructed only in ``distmoe/wire/codec.py``;
- ``run_config`` / ``node_config`` are read only in ``distmoe/config.py``, ``server/`` and ``clients/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("distmoe", "server", "clients")
RECORD_NAMES = {"ArrayRecord", "MetricRecord", "ConfigRecord", "RecordDict", "Message"}
CONFIG_ATTRS = {"run_config", "node_config"}


def _sources() -> list[tuple[str, ast.AST]]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            out.append((rel, ast.parse(path.read_text(encoding="utf-8"), filename=rel)))
    return out


def _flwr_imports(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            if any(a.name == "flwr" or a.name.startswith("flwr.") for a in node.names):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "flwr" or node.module.startswith("flwr."):
                lines.append(node.lineno)
    return lines


def _record_calls(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in RECORD_NAMES:
                found.append((node.lineno, name))
    return found


def _config_reads(tree: ast.AST) -> list[tuple[int, str]]:
    return [(n.lineno, n.attr) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in CONFIG_ATTRS]


def _is_app(rel: str) -> bool:
    return rel.startswith(("server/", "clients/"))


def test_sources_found():
    files = [rel for rel, _ in _sources()]
    assert "distmoe/wire/codec.py" in files and "distmoe/config.py" in files
    assert "server/app.py" in files and "clients/app.py" in files


def test_flwr_imported_only_in_apps_and_wire():
    offending, allowed_hits = [], 0
    for rel, tree in _sources():
        lines = _flwr_imports(tree)
        if _is_app(rel) or rel.startswith("distmoe/wire/"):
            allowed_hits += len(lines)
            continue
        offending += [f"{rel}:{ln}" for ln in lines]
    assert allowed_hits > 0  # the walker does see flwr imports where they belong
    assert not offending, "flwr imported outside server/, clients/, distmoe/wire/: " + ", ".join(offending)


def test_records_built_only_in_codec():
    offending, codec_hits = [], 0
    for rel, tree in _sources():
        calls = _record_calls(tree)
        if rel == "distmoe/wire/codec.py":
            codec_hits += len(calls)
            continue
        offending += [f"{rel}:{ln} ({name})" for ln, name in calls]
    assert codec_hits > 0
    assert not offending, "Flower records/messages built outside distmoe/wire/codec.py: " + ", ".join(offending)


def test_run_and_node_config_read_only_by_parser_and_apps():
    offending, allowed_hits = [], 0
    for rel, tree in _sources():
        reads = _config_reads(tree)
        if rel == "distmoe/config.py" or _is_app(rel):
            allowed_hits += len(reads)
            continue
        offending += [f"{rel}:{ln} (.{attr})" for ln, attr in reads]
    assert allowed_hits > 0
    assert not offending, ("run_config/node_config read outside distmoe/config.py, server/, clients/: "
                           + ", ".join(offending))


def test_detectors_flag_violations():
    src = ("import os\nimport flwr.app as fa\nfrom flwr.serverapp import Grid\nfrom .flwr import x\n"
           "r = fa.ArrayRecord({})\nm = Message(content=r)\ny = ArrayRecordLike()\n"
           "c = context.run_config\nn = ctx.node_config['data-path']\nz = getattr(a, 'run_config')\n")
    tree = ast.parse(src)
    assert _flwr_imports(tree) == [2, 3]
    assert sorted(_record_calls(tree)) == [(5, "ArrayRecord"), (6, "Message")]
    assert sorted(_config_reads(tree)) == [(8, "run_config"), (9, "node_config")]
