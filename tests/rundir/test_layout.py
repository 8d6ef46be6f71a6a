"""The run directory's layout has one owner (``distmoe.rundir.layout``): the names are the ones old run directories
hold, the drawing in ``distmoe.rundir`` shows every one, and no other module of the package writes one as a literal
(the source is scanned with ``ast``, like ``tests/test_architecture.py``; the detector is run on a planted snippet)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import distmoe.rundir as rundir_pkg
from distmoe.rundir import RunDir, WorkDir, node_file, safe_name
from distmoe.rundir import layout as L

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("distmoe", "server", "clients")
OWNER = "distmoe/rundir/"

# literals that are a layout name by spelling but name something else, each with why
ALLOWED = {
    ("distmoe/deploy/cli.py", "config.toml"): "Flower's own config file in FLWR_HOME, not a run's",
    ("distmoe/simulate/launch.py", "flwr"): "the flwr executable beside the interpreter",
    ("distmoe/deploy/commands.py", "work"): "the owner's default work-dir inside its credentials directory "
                                            "(the credentials directory's layout: distmoe/deploy)",
}


def _names() -> tuple[set[str], set[str]]:
    """``(file names, folder names)`` of the layout: every string constant of ``layout`` plus the names it builds
    (the coordinator's ledger, key and public key; the globs)."""
    consts = {v for k, v in vars(L).items() if k.isupper() and isinstance(v, str)} - {L.COORDINATOR}
    here = RunDir(".")
    built = {here.ledger.name, here.ledger_pub.name, here.ledger_key.name, "node-*.toml", "pretask-*.safetensors"}
    files = {n for n in consts | built if "." in n}  # a folder name may also be a config key (``base-cache``)
    return files, consts - files


FILES, FOLDERS = _names()


def _literal_hits(tree: ast.AST) -> list[tuple[int, str]]:
    """Layout names written as literals: a string constant without whitespace with a ``/``-part that is a file name
    of the layout (``"run.json"``, ``"privacy/ledger.json"``), or any layout name joined onto a path
    (``run_dir / "ledger"``)."""
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value \
                and not any(c.isspace() for c in node.value):
            parts = set(node.value.split("/"))
            hits += [(node.lineno, n) for n in sorted(parts & FILES)]
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant) \
                and node.right.value in FOLDERS:
            hits.append((node.lineno, node.right.value))
    return sorted(set(hits))


def _violations(root: Path = ROOT) -> list[str]:
    bad = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(OWNER):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
            bad += [f"{rel}:{ln}: {name!r}" for ln, name in _literal_hits(tree) if (rel, name) not in ALLOWED]
    return bad


def test_no_layout_literal_outside_the_owner():
    bad = _violations()
    assert not bad, ("run-directory names written outside distmoe/rundir/ (use RunDir / WorkDir):\n"
                     + "\n".join(bad))


def test_each_allowed_literal_is_still_there():
    for (rel, name), why in ALLOWED.items():
        tree = ast.parse((ROOT / rel).read_text(encoding="utf-8"))
        assert name in {n for _, n in _literal_hits(tree)}, f"{rel} no longer writes {name!r} ({why}): remove it"


def test_detector_flags_planted_literals_and_leaves_prose():
    src = ('p = run_dir / "run.json"\n'
           'q = d / "ledger" / f"{party}.jsonl"\n'
           'r = Path(x, "privacy/ledger.json")\n'
           'g = root.glob("node-*.toml")\n'
           'msg = f"{path}: metrics.jsonl holds no row"\n'  # prose naming the file: allowed
           'k = {"privacy": 1, "work": 2}\n')  # a key that shares a folder's name: allowed
    assert _literal_hits(ast.parse(src)) == [(1, "run.json"), (2, "ledger"), (3, "ledger.json"),
                                             (4, "node-*.toml")]


def test_a_planted_literal_in_a_module_fails_the_scan(tmp_path):
    (tmp_path / "distmoe" / "report").mkdir(parents=True)
    (tmp_path / "distmoe" / "rundir").mkdir()
    (tmp_path / "distmoe" / "report" / "x.py").write_text('METRICS = "metrics.jsonl"\n')
    (tmp_path / "distmoe" / "rundir" / "layout.py").write_text('METRICS = "metrics.jsonl"\n')  # the owner may
    assert _violations(tmp_path) == ["distmoe/report/x.py:1: 'metrics.jsonl'"]


@pytest.mark.parametrize("path,rel", [
    (lambda r: r.record, "run.json"), (lambda r: r.metrics, "metrics.jsonl"),
    (lambda r: r.metrics_lost, "metrics.lost.jsonl"), (lambda r: r.config, "config.toml"),
    (lambda r: r.ledger, "ledger/coordinator.jsonl"), (lambda r: r.ledger_pub, "ledger/coordinator.pub"),
    (lambda r: r.ledger_key, "keys/coordinator.key"), (lambda r: r.accounts, "privacy/ledger.json"),
    (lambda r: r.secagg_state, "privacy/secagg-server.state"), (lambda r: r.checkpoints, "checkpoints"),
    (lambda r: r.anchors, "anchors"), (lambda r: r.report_md, "report/report.md"),
    (lambda r: r.report_plot("loss"), "report/loss.png"), (lambda r: r.tensorboard, "tensorboard"),
    (lambda r: r.audit, "audit"), (lambda r: r.export, "export"), (lambda r: r.simulate_record, "simulate.json"),
    (lambda r: r.lock, "simulate.lock"), (lambda r: r.flower_log, "flower.log"),
    (lambda r: r.overrides(), "overrides.toml"), (lambda r: r.overrides(resume=True), "overrides.resume.toml"),
    (lambda r: r.node_file(2), "nodes/node-2.toml"), (lambda r: r.flwr_home, "flwr"), (lambda r: r.ray, "ray"),
    (lambda r: r.synth_data, "work/data"), (lambda r: r.party("p0").root, "work/p0"),
])
def test_run_dir_names_are_those_old_runs_hold(path, rel):
    assert path(RunDir("RUN")) == Path("RUN") / rel
    assert RunDir("runs/RUN").base_cache == Path("runs/base-cache")  # beside the run, shared by the runs there


def test_work_dir_names_are_those_old_work_dirs_hold():
    w = WorkDir("W")
    assert w.ledger("p0") == Path("W/ledger/p0.jsonl")
    assert w.ledger_key("p0") == Path("W/keys/p0-ledger.key")
    assert w.secagg_state("p0", "run:7") == Path("W/secagg/p0-run_7.state")
    assert w.facts("p0", "7") == Path("W/privacy/p0-7.json")
    assert w.accountant("p0", "7") == Path("W/privacy/p0-7.accountant.json")
    assert w.receipt("p0", "7") == Path("W/receipts/p0-7.json")
    assert w.metrics("p0") == Path("W/metrics/p0.jsonl")
    assert w.policy_runs == Path("W/policy/runs.json")
    assert w.pretask("ab12") == Path("W/retention/pretask-ab12.safetensors")
    assert (w.party_log, w.base_cache, w.privacy) == (Path("W/party.log"), Path("W/base-cache"), Path("W/privacy"))
    assert WorkDir.of_ledger("W/ledger/p0.jsonl") == w
    assert node_file("N", 3) == Path("N/node-3.toml")
    assert safe_name("a/b c") == "a_b_c" and safe_name("") == "run" and len(safe_name("x" * 200)) == 80


def test_report_plot_refuses_a_name_the_report_does_not_write():
    with pytest.raises(ValueError, match="'notes' is not a plot of the report"):
        RunDir("RUN").report_plot("notes")


def test_the_drawing_shows_every_name():
    doc = rundir_pkg.__doc__
    missing = sorted(n for n in FILES | FOLDERS if n not in doc)
    assert not missing, f"the layout drawing in distmoe/rundir/__init__.py lacks {missing}"


def test_the_operations_guide_shows_every_name():
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    tree = text.split("### What a run directory holds", 1)[1].split("## Where the logs are", 1)[0]
    missing = sorted(n for n in FILES | FOLDERS if n not in tree)
    assert not missing, f"docs/operations.md, 'What a run directory holds', lacks {missing}"
