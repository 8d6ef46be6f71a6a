"""Architecture rules from ``docs/architecture.md`` §3-§4, checked on the source with ``ast``.

- ``flwr`` is imported only in ``server/``, ``clients/`` and ``distmoe/wire/``;
- Flower records and messages are constructed only in the codec (``CODEC``: ``distmoe/wire/codec.py``, its
  two field-kind modules and its packing at the message boundary);
- ``run_config`` / ``node_config`` are read only in ``distmoe/config/``, ``server/`` and ``clients/``;
- the packages of ``distmoe`` form the layers of ``LAYERS`` (``distmoe/module_map.py``): a module imports only from
  its own package or from a lower layer (no upward or sideways imports), and ``wire`` sits directly above the
  highest layer it imports;
- no import cycle among the modules (every import counts: module level, in a function, under ``TYPE_CHECKING``,
  relative); ``KNOWN_CYCLES`` is empty, and an entry there must match a cycle exactly;
- ``wire``, ``privacy``, ``audit``, ``report`` and ``rundir`` import no torch (nor ``transformers`` / ``peft``), neither
  themselves nor through a distmoe module they import, except ``TORCH_EXCEPTIONS``;
- no module over ``MAX_LINES`` lines.

Each rule's detector is also run on a temporary tree with a planted violation.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

from distmoe.module_map import LAYERS

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("distmoe", "server", "clients")
RECORD_NAMES = {"ArrayRecord", "MetricRecord", "ConfigRecord", "RecordDict", "Message"}
CONFIG_ATTRS = {"run_config", "node_config"}

MAX_LINES = 400
CODEC = {"distmoe/wire/codec.py", "distmoe/wire/records.py", "distmoe/wire/secagg_kinds.py",
         "distmoe/wire/packing.py"}


def _sources(root: Path = ROOT) -> list[tuple[str, ast.AST]]:
    return list(_parsed(root)) if root == ROOT else _parse(root)  # the repository parsed once per session


@functools.cache
def _parsed(root: Path) -> tuple[tuple[str, ast.AST], ...]:
    return tuple(_parse(root))


def _parse(root: Path) -> list[tuple[str, ast.AST]]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
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
    assert "distmoe/wire/codec.py" in files and "distmoe/config/parse.py" in files
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
        if rel.startswith("distmoe/config/") or _is_app(rel):
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


def _module(rel: str) -> str:
    """``distmoe/coordinator/loop.py`` -> ``distmoe.coordinator.loop``; a package's ``__init__.py`` -> the package."""
    parts = rel[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _distmoe_imports(tree: ast.AST, rel: str = "") -> list[tuple[int, str]]:
    """Every import of distmoe in ``tree`` (anywhere: module level, in functions, under ``TYPE_CHECKING``) as
    ``(line, dotted target)``; ``from X import y`` gives ``X.y`` (a module or a name in ``X``); relative imports
    are resolved against ``rel``, the file's path."""
    package = _module(rel).split(".") if rel.endswith("__init__.py") else _module(rel).split(".")[:-1] if rel else []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "distmoe"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            if module == "distmoe" or module.startswith("distmoe."):
                out += [(node.lineno, f"{module}.{a.name}") for a in node.names]
    return out


def _layer_violations(sources: list[tuple[str, ast.AST]]) -> list[str]:
    rank = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    bad = []
    for rel, tree in sources:
        if not rel.startswith("distmoe/") or rel == "distmoe/__init__.py":
            continue
        me = _unit(rel[:-3].replace("/", "."))
        for line, target in _distmoe_imports(tree, rel):
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



def test_layer_check_resolves_relative_imports():
    bad = _layer_violations([("distmoe/privacy/x.py", ast.parse("from ..wire import codec\n"))])
    assert len(bad) == 1 and "upward import of distmoe.wire.codec" in bad[0], bad


def test_wire_sits_directly_above_what_it_imports():
    rank = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    imported = {_unit(t) for rel, tree in _sources() if rel.startswith("distmoe/wire/")
                for _, t in _distmoe_imports(tree, rel)} - {"wire"}
    assert imported, "the walker sees what wire imports"
    highest = max(rank[u] for u in imported)
    assert rank["wire"] == highest + 1, (f"wire imports {sorted(imported)} (highest layer {highest}) but sits in layer "
                                         f"{rank['wire']}: move it directly above them in LAYERS")


# ---------------------------------------------------------------------------------------------
# Import cycles
# ---------------------------------------------------------------------------------------------
# Cycles that exist today, each named exactly (the test fails when one changes, so the entry is kept exact, and when
# one is gone, so the entry is removed). The coordinator is a blackboard: phases/*, plane, resume, start and expand
# take the `Coordinator` type from loop.py (under TYPE_CHECKING) while loop.py imports them; it goes when the loop
# owns a pipeline of phases that return values (docs/architecture.md §4).
KNOWN_CYCLES: tuple[frozenset[str], ...] = ()  # none: every import cycle fails the test


def _import_graph(sources: list[tuple[str, ast.AST]]) -> dict[str, set[str]]:
    """Module -> the distmoe modules it imports (``from pkg import name`` counts as importing ``pkg``'s
    ``__init__`` unless ``name`` is a module)."""
    mods = {_module(rel): (rel, tree) for rel, tree in sources if rel.startswith("distmoe/")}
    graph: dict[str, set[str]] = {}
    for name, (rel, tree) in mods.items():
        targets = set()
        for _, target in _distmoe_imports(tree, rel):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; sorted by first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # iterative enough for a few hundred modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _cycle_path(graph: dict[str, set[str]], comp: list[str]) -> str:
    """One concrete cycle through the component's first module: ``a -> b -> a``."""
    inside, start = set(comp), comp[0]
    paths = {start: [start]}
    todo = [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & inside):
            if w == start:
                return " -> ".join([*paths[v], start])
            if w not in paths:
                paths[w] = [*paths[v], w]
                todo.append(w)
    return " -> ".join(comp)


def _cycle_violations(sources: list[tuple[str, ast.AST]], known=KNOWN_CYCLES) -> list[str]:
    graph = _import_graph(sources)
    comps = _cycles(graph)
    bad = [f"import cycle ({len(c)} modules): {_cycle_path(graph, c)}" for c in comps if frozenset(c) not in known]
    bad += [f"KNOWN_CYCLES lists a cycle that no longer exists as listed ({len(k)} modules, e.g. {sorted(k)[0]}): "
            "remove or correct the entry" for k in known if sorted(k) not in comps]
    return bad


def test_no_import_cycles():
    bad = _cycle_violations(_sources())
    assert not bad, "\n".join(bad)


def _tree(tmp_path: Path, files: dict[str, str]) -> list[tuple[str, ast.AST]]:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text, encoding="utf-8")
    return _sources(tmp_path)


def test_cycle_check_flags_a_planted_cycle(tmp_path):
    src = _tree(tmp_path, {
        "distmoe/__init__.py": "",
        "distmoe/model/__init__.py": "",
        "distmoe/model/a.py": "from distmoe.model.b import f\n",
        "distmoe/model/b.py": "def f():\n    from . import c\n",  # relative, inside a function
        "distmoe/model/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from distmoe.model import a\n",
        "distmoe/model/d.py": "from distmoe.model import a\n",  # imports into the cycle, is not part of it
    })
    bad = _cycle_violations(src, known=())
    assert bad == ["import cycle (3 modules): distmoe.model.a -> distmoe.model.b -> distmoe.model.c -> "
                   "distmoe.model.a"], bad
    # a listed cycle passes; a listed cycle that is gone must leave the list
    cycle = frozenset({"distmoe.model.a", "distmoe.model.b", "distmoe.model.c"})
    assert _cycle_violations(src, known=(cycle,)) == []
    (tmp_path / "distmoe/model/c.py").write_text("x = 1\n")
    assert "no longer exists" in _cycle_violations(_sources(tmp_path), known=(cycle,))[0]


# ---------------------------------------------------------------------------------------------
# Torch-free layers
# ---------------------------------------------------------------------------------------------
TORCH_FREE = ("wire", "privacy", "audit", "report", "rundir")
HEAVY = ("torch", "transformers", "peft", "opacus")  # opacus imports torch
# module -> the heavy package it may import, and why. The accountant's PRV and RDP analysis are opacus's
# (privacy/accountant.py); opacus imports torch, so importing the accountant, and the audit that replays it, loads
# torch.
TORCH_EXCEPTIONS = {"distmoe/privacy/accountant.py": "opacus"}


def _heavy_imports(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
        out += [(node.lineno, n.split(".")[0]) for n in names if n.split(".")[0] in HEAVY]
    return out


def _torch_violations(sources: list[tuple[str, ast.AST]], exceptions=TORCH_EXCEPTIONS) -> list[str]:
    """A module of a torch-free layer that imports a heavy package, itself or through the distmoe modules it
    imports (the chain is named)."""
    rel_of = {_module(rel): rel for rel, _ in sources}
    heavy = {}
    for rel, tree in sources:
        hits = [(ln, pkg) for ln, pkg in _heavy_imports(tree) if exceptions.get(rel) != pkg]
        if hits:
            heavy[_module(rel)] = hits[0]
    graph = _import_graph(sources)
    bad = []
    for rel, _ in sources:
        if not rel.startswith(tuple(f"distmoe/{u}/" for u in TORCH_FREE)):
            continue
        paths = {_module(rel): [_module(rel)]}
        todo = [_module(rel)]
        while todo:
            v = todo.pop(0)
            if v in heavy:
                ln, pkg = heavy[v]
                bad.append(f"{rel}: imports {pkg} via " + " -> ".join(paths[v]) + f" ({rel_of[v]}:{ln})")
                break
            for w in sorted(graph.get(v, ())):
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    todo.append(w)
    return bad


def test_torch_free_layers_import_no_torch():
    bad = _torch_violations(_sources())
    assert not bad, "torch-free layers (" + ", ".join(TORCH_FREE) + ") that import torch:\n" + "\n".join(bad)
    for rel, pkg in TORCH_EXCEPTIONS.items():  # each exception is still needed
        tree = ast.parse((ROOT / rel).read_text(encoding="utf-8"))
        assert pkg in {p for _, p in _heavy_imports(tree)}, f"{rel} no longer imports {pkg}: remove the exception"


def test_wire_report_and_rundir_load_no_torch_at_run_time():
    mods = sorted(_module(rel) for rel, _ in _sources()
                  if rel.startswith(("distmoe/wire/", "distmoe/report/", "distmoe/rundir/")))
    code = f"import sys\nfor m in {mods!r}:\n    __import__(m)\nprint(sorted(set(sys.modules) & {set(HEAVY)!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing wire, report and rundir loaded {out.stdout.strip()}"


def test_torch_check_flags_a_planted_torch_import(tmp_path):
    src = _tree(tmp_path, {
        "distmoe/__init__.py": "",
        "distmoe/privacy/__init__.py": "",
        "distmoe/privacy/x.py": "def f():\n    import torch.nn\n",
        "distmoe/privacy/y.py": "from distmoe.model.z import g\n",  # through a distmoe module
        "distmoe/model/__init__.py": "",
        "distmoe/model/z.py": "from transformers import AutoModel\n",
        "distmoe/privacy/accountant.py": "from opacus.accountants import PRVAccountant\n",
    })
    bad = _torch_violations(src)
    assert bad == ["distmoe/privacy/x.py: imports torch via distmoe.privacy.x (distmoe/privacy/x.py:2)",
                   "distmoe/privacy/y.py: imports transformers via distmoe.privacy.y -> distmoe.model.z "
                   "(distmoe/model/z.py:1)"], bad
    assert len(_torch_violations(src, exceptions={})) == 3  # without its exception the accountant is flagged


# ---------------------------------------------------------------------------------------------
# The 400-line cap
# ---------------------------------------------------------------------------------------------
def _over_cap(root: Path) -> list[str]:
    bad = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            n = len(path.read_text(encoding="utf-8").splitlines())
            if n > MAX_LINES:
                bad.append(f"{rel}: {n} lines (over {MAX_LINES}: split it by what its parts own)")
    return bad


def test_no_module_over_the_line_cap():
    bad = _over_cap(ROOT)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("n,flagged", [(401, True), (400, False)])
def test_line_cap_flags_a_planted_module(tmp_path, n, flagged):
    _tree(tmp_path, {"clients/x.py": "x = 1\n" * n})
    bad = _over_cap(tmp_path)
    assert bool(bad) == flagged, bad
