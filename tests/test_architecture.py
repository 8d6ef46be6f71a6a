"""Architecture rules from ``docs/architecture.md`` §3-§4, checked on the source with ``ast``.

- ``flwr`` is imported only in ``server/``, ``clients/`` and ``distmoe/wire/``;
- Flower records and messages are constructed only in the codec (``CODEC``: ``distmoe/wire/codec.py`` and its
  two field-kind modules);
- ``run_config`` / ``node_config`` are read only in ``distmoe/config.py``, ``server/`` and ``clients/``;
- the packages of ``distmoe`` form the layers of ``LAYERS``: a module imports only from its own package
  or from a lower layer (no upward or sideways imports, hence no import cycle between packages);
- ``coordinator``, ``wire`` and ``audit`` have no module over ``MAX_LINES`` lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("distmoe", "server", "clients")
RECORD_NAMES = {"ArrayRecord", "MetricRecord", "ConfigRecord", "RecordDict", "Message"}
CONFIG_ATTRS = {"run_config", "node_config"}

# distmoe's top-level modules and packages, lowest layer first (docs/architecture.md, Layering)
LAYERS = (
    {"io"},  # base: atomic files
    {"config", "ledger"},  # base: the one config parser, the signed ledger
    {"data", "model", "checkpoint", "aggregate", "report", "deploy"},
    {"routing", "privacy"},
    {"train"},
    {"rl"},
    {"wire"},  # schema, codec, inspection, the two guards, error codes
    {"party", "coordinator", "audit"},
    {"inprocess", "simulate", "config_sync", "export"},
    {"cli"},
)
MAX_LINES = 400
CODEC = {"distmoe/wire/codec.py", "distmoe/wire/records.py", "distmoe/wire/secagg_kinds.py"}


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
        if rel in CODEC:
            codec_hits += len(calls)
            continue
        offending += [f"{rel}:{ln} ({name})" for ln, name in calls]
    assert codec_hits > 0
    assert not offending, f"Flower records/messages built outside {sorted(CODEC)}: " + ", ".join(offending)


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


def _unit(module: str) -> str:
    """``distmoe.coordinator.loop`` -> ``coordinator``; ``distmoe`` itself -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _distmoe_imports(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "distmoe"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "distmoe":
                out += [(node.lineno, f"distmoe.{a.name}") for a in node.names]
            elif node.module.startswith("distmoe."):
                out.append((node.lineno, node.module))
    return out


def _layer_violations(sources: list[tuple[str, ast.AST]]) -> list[str]:
    rank = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    bad = []
    for rel, tree in sources:
        if not rel.startswith("distmoe/") or rel == "distmoe/__init__.py":
            continue
        me = _unit(rel[:-3].replace("/", "."))
        for line, target in _distmoe_imports(tree):
            them = _unit(target)
            if them == me:
                continue
            if me not in rank or them not in rank:
                bad.append(f"{rel}:{line}: {target} ({me or them!r} is in no layer of LAYERS)")
            elif rank[them] >= rank[me]:
                how = "sideways" if rank[them] == rank[me] else "upward"
                bad.append(f"{rel}:{line}: {how} import of {target} ({me} is layer {rank[me]}, {them} layer "
                           f"{rank[them]})")
    return bad


def test_every_package_has_a_layer():
    units = {p.stem if p.is_file() else p.name for p in (ROOT / "distmoe").iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    layered = set().union(*LAYERS)
    assert units - layered == set(), f"give these a layer in LAYERS: {sorted(units - layered)}"
    assert layered - units == set(), f"LAYERS names what does not exist: {sorted(layered - units)}"


def test_imports_follow_the_layers():
    bad = _layer_violations(_sources())
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_layer_check_flags_upward_and_sideways_imports():
    src = [("distmoe/privacy/x.py", ast.parse("from distmoe.wire import codec\nimport distmoe.config\n")),
           ("distmoe/party/y.py", ast.parse("from distmoe.coordinator import loop\nfrom distmoe.party import z\n")),
           ("distmoe/wire/z.py", ast.parse("from distmoe import party\n"))]
    bad = _layer_violations(src)
    assert len(bad) == 3, bad
    assert "upward import of distmoe.wire" in bad[0] and "sideways import of distmoe.coordinator" in bad[1]
    assert "upward import of distmoe.party" in bad[2]


def test_coordinator_wire_and_audit_modules_stay_small():
    big = {}
    for pkg in ("coordinator", "wire", "audit"):
        for path in sorted((ROOT / "distmoe" / pkg).rglob("*.py")):
            n = len(path.read_text(encoding="utf-8").splitlines())
            if n > MAX_LINES:
                big[path.relative_to(ROOT).as_posix()] = n
    assert not big, f"modules over {MAX_LINES} lines (split them by what they own): {big}"
