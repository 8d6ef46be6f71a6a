"""The party service builds every secure release from its release module (``distmoe.privacy.releases``), the one
the coordinator opens the sum with: no spec, layout or DP event of a release is built in ``distmoe/party``."""

from __future__ import annotations

import ast
from pathlib import Path

import distmoe.party
from distmoe.privacy.releases import RELEASES

# what only a release module may build (its spec or layout, its DP event): built elsewhere, the two sides could drift
RELEASE_OWNED = {"SkellamSpec", "EvalSpec", "UpdateLayout", "StatsLayout", "PrivacyEvent", "stats_spec", "eval_spec",
                 "stats_event", "update_event"}


def _built(path: Path) -> set[str]:
    """The names of what ``path`` calls (``f(...)``, ``x.f(...)``, ``UpdateLayout.build(...)``) or imports."""
    tree = ast.parse(path.read_text(), str(path))
    out = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module != "distmoe.privacy.accountant"
           for a in n.names}  # the accountant's PrivacyEvent type: charged, never built, at the party
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            f = n.func
            out.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                out.add(f.value.id)  # UpdateLayout.build(...)
    return out


def test_the_party_takes_every_release_spec_from_its_release_module():
    party = Path(distmoe.party.__file__).parent
    found = {p.name: sorted(_built(p) & RELEASE_OWNED) for p in sorted(party.glob("*.py"))}
    assert {k: v for k, v in found.items() if v} == {}
    service = (party / "service.py").read_text()
    for kind, module in RELEASES.items():  # and the service reaches each release through the table's module
        assert f"R.{module.__name__.rsplit('.', 1)[1]}.spec(" in service or kind == "update", kind
    assert "R.update.layout(" in service
