"""Attacks on the coordinator's own ledger of a whole run, each judged by ``distmoe audit``.

The coordinator holds its ledger key (``RUN/keys/coordinator.key``). Before the fix, dropping the tail of
``ledger/coordinator.jsonl`` (no key needed) or deleting the router-statistics release and re-signing the
chain with that key passed the audit with epsilon 0, even given the party ledgers. Each test runs the
attack on a real in-process run and asserts that ``distmoe audit`` exits 1 naming the check that stops it:

- ``run-end``: the ledger must end with the ``run-end`` entry the coordinator writes however the run ends;
- ``coordinator-heads``: each party recorded the coordinator's ledger head of every instruction it got in
  its own signed ledger; a cut or re-signed ledger no longer holds those heads;
- ``release-coverage``: a round with unmask replies has a release; a DP input received is in one;
- ``epsilon``: each party's epsilon is at least its own signed charges, whatever the coordinator kept.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from distmoe.audit import audit_run
from distmoe.cli import main
from distmoe.ledger import GENESIS, SIG_DOMAIN, entry_hash, load_signing_key

pytestmark = pytest.mark.integration  # every test here judges a whole in-process run

PARTIES = ("party-0", "party-1", "party-2")


def _entries(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x]


def _write(path: Path, entries: list[dict]) -> None:
    path.write_text("".join(json.dumps(e, sort_keys=True, separators=(",", ":")) + "\n" for e in entries))


def _resign(run_dir: Path, entries: list[dict]) -> list[dict]:
    """What an attacker with the run's coordinator key does: renumber, re-chain and re-sign every entry."""
    key = load_signing_key(run_dir / "keys" / "coordinator.key")
    prev = GENESIS
    out = []
    for seq, e in enumerate(entries):
        e = {k: v for k, v in e.items() if k not in ("hash", "sig")}
        e["seq"], e["prev"] = seq, prev
        h = entry_hash(e)
        out.append({**e, "hash": h, "sig": key.sign(SIG_DOMAIN + h.encode("ascii")).hex()})
        prev = h
    return out


def _coord(run_dir: Path) -> Path:
    return run_dir / "ledger" / "coordinator.jsonl"


def _index(entries: list[dict], payload_type: str, nth: int = 0) -> int:
    return [i for i, e in enumerate(entries) if e["payload_type"] == payload_type][nth]


def _copy(src: Path, tmp: Path, party_ledgers: bool) -> Path:
    run_dir = tmp / "run"
    shutil.copytree(src, run_dir)
    if not party_ledgers:  # a deployment: each party keeps its own ledger, the run directory has none
        for p in PARTIES:
            shutil.rmtree(run_dir / "work" / p / "ledger")
    return run_dir


def _audit_fails(run_dir: Path, capsys, *names: str) -> None:
    """``distmoe audit`` exits 1 and names each check (and the library API agrees)."""
    assert main(["audit", str(run_dir)]) == 1
    out = capsys.readouterr().out
    failed = set(audit_run(run_dir).failed)
    for name in names:
        assert name in failed, (name, failed)
        assert name in out, out


@pytest.fixture(scope="module")
def honest(tmp_path_factory, make_run):
    """``sft:arith, stats:arith, eval``: the router-stats release is followed by the eval round."""
    coord, _, run_dir, _, _ = make_run(tmp_path_factory.mktemp("cut"))
    coord.run()
    return run_dir


@pytest.fixture(scope="module")
def stats_last(tmp_path_factory, make_run):
    """``sft:arith, stats:arith``: the router-stats release is the run's last message (no instruction after)."""
    coord, _, run_dir, _, _ = make_run(
        tmp_path_factory.mktemp("cut-last"), {"schedule.phases": "sft:arith, stats:arith"}
    )
    coord.run()
    return run_dir


# ------------------------------------------------------------------------------------------------ honest
def test_honest_run_passes_with_every_head_recorded(honest):
    result = audit_run(honest)
    assert result.passed, [(c.name, c.findings) for c in result.checks if c.status == "fail"]
    for name in ("run-end", "coordinator-heads", "release-coverage"):
        assert result.check(name).status == "pass", result.check(name).details
    coord = {e["seq"]: e for e in _entries(_coord(honest))}
    for p in PARTIES:
        inbound = [e for e in _entries(honest / "work" / p / "ledger" / f"{p}.jsonl") if e["direction"] == "in"]
        assert inbound and all(coord[e["anchor"]["seq"]]["hash"] == e["anchor"]["hash"] for e in inbound)
        row = result.epsilon[p]  # the party charged at the threshold: its own figure is the larger
        assert row["party_epsilon"] >= row["coordinator_epsilon"] > 0
        assert row["epsilon"] == max(row["party_epsilon"], row["coordinator_epsilon"]) <= 8.0


def test_interrupted_run_closes_its_ledger_as_interrupted(tmp_path, make_run, monkeypatch):
    """Ctrl-C mid-run: the ledger ends with ``run-end`` status ``interrupted``; run-end passes and says so."""
    coord, _, run_dir, _, _ = make_run(tmp_path)
    real = coord.play_round

    def play(index, phase):
        if coord.s.round == 2:
            raise KeyboardInterrupt
        return real(index, phase)

    monkeypatch.setattr(coord, "play_round", play)
    with pytest.raises(KeyboardInterrupt):
        coord.run()
    last = _entries(_coord(run_dir))[-1]
    assert last["payload_type"] == "run-end" and last["info"]["status"] == "interrupted"
    result = audit_run(run_dir)
    assert result.check("run-end").status == "pass"
    assert any("ended interrupted" in d for d in result.check("run-end").details)
    assert json.loads((run_dir / "run.json").read_text())["status"] == "interrupted"


# --------------------------------------------------------------------------------------------- truncation
@pytest.mark.parametrize("party_ledgers", [True, False])
@pytest.mark.parametrize("cut", ["after-stats-release", "mid-round", "before-run-end"])
def test_cut_coordinator_ledger_fails(honest, tmp_path, capsys, cut, party_ledgers):
    """``head -n`` on the coordinator ledger (no key needed). Defence: ``run-end`` (the cut ledger is not
    closed) and, with party ledgers, ``coordinator-heads`` (the parties recorded heads past the cut)."""
    run_dir = _copy(honest, tmp_path, party_ledgers)
    entries = _entries(_coord(run_dir))
    keep = {
        "after-stats-release": _index(entries, "release:router-stats") + 1,
        "mid-round": _index(entries, "masked-input:router-stats", 1) + 1,  # masked inputs in, nothing unmasked
        "before-run-end": len(entries) - 1,
    }[cut]
    _write(_coord(run_dir), entries[:keep])
    names = ["run-end"] + (["coordinator-heads"] if party_ledgers and cut != "before-run-end" else [])
    _audit_fails(run_dir, capsys, *names)
    if cut == "after-stats-release":  # the stats charge is in what is left; the parties' charges remain too
        assert all(r["epsilon"] > 0 for r in audit_run(run_dir).epsilon.values())


def test_cut_and_resigned_with_a_new_run_end_fails_on_the_party_heads(honest, tmp_path, capsys):
    """The attacker holds the key: cut after the stats release and append a fresh, signed ``run-end``.
    Defence: ``coordinator-heads`` (the eval instructions the parties recorded are gone)."""
    run_dir = _copy(honest, tmp_path, True)
    entries = _entries(_coord(run_dir))
    cut = entries[: _index(entries, "release:router-stats") + 1] + [entries[-1]]
    _write(_coord(run_dir), _resign(run_dir, cut))
    _audit_fails(run_dir, capsys, "coordinator-heads")
    result = audit_run(run_dir)
    assert result.check("run-end").status == "pass" and result.check("ledger-integrity").status == "pass"
    assert any("was cut" in f for f in result.check("coordinator-heads").findings)


# ----------------------------------------------------------------------------------- deletion, re-signed
@pytest.mark.parametrize("party_ledgers", [True, False])
def test_deleted_stats_release_resigned_fails(honest, tmp_path, capsys, party_ledgers):
    """The router-statistics release deleted and the chain re-signed with the run's own key (it verifies).
    Defence: ``coordinator-heads`` (every later head differs) and ``release-coverage`` (round 2 has unmask
    replies and no release); epsilon keeps each party's own signed charge for it."""
    run_dir = _copy(honest, tmp_path, party_ledgers)
    entries = _entries(_coord(run_dir))
    stats = entries.pop(_index(entries, "release:router-stats"))
    _write(_coord(run_dir), _resign(run_dir, entries))
    names = ["release-coverage"] + (["coordinator-heads"] if party_ledgers else [])
    _audit_fails(run_dir, capsys, *names)
    result = audit_run(run_dir)
    assert result.check("ledger-integrity").status == "pass"  # the forgery verifies: other checks stop it
    assert any(f.startswith(f"round {stats['round']}:") for f in result.check("release-coverage").findings)
    if party_ledgers:
        assert all(r["epsilon"] >= r["party_epsilon"] > 7.0 for r in result.epsilon.values())


def test_deleted_last_release_and_its_unmask_replies_fails_on_the_party_ledgers(stats_last, tmp_path, capsys):
    """The release was the run's last message, so no later head exposes its deletion: the coordinator also
    drops the unmask replies and re-signs. Defence: ``release-coverage`` from the parties' own unmask
    replies, and ``epsilon`` from the parties' own signed charges (not 0)."""
    run_dir = _copy(stats_last, tmp_path, True)
    entries = _entries(_coord(run_dir))
    rnd = entries[_index(entries, "release:router-stats")]["round"]
    entries = [
        e
        for e in entries
        if not (e["round"] == rnd and e["payload_type"] in ("release:router-stats", "unmask-response"))
    ]  # everything after the last instruction (unmask request)
    _write(_coord(run_dir), _resign(run_dir, entries))
    _audit_fails(run_dir, capsys, "release-coverage")
    result = audit_run(run_dir)
    assert result.check("coordinator-heads").status == "pass"  # every instruction is still there
    for p in PARTIES:
        row = result.epsilon[p]
        assert row["releases"] == 0 and row["coordinator_epsilon"] == 0  # the forged ledger charges nothing
        assert row["epsilon"] == row["party_epsilon"] > 7.0  # the parties' own signed charges


# -------------------------------------------------------------------------------------------- reordering
@pytest.mark.parametrize("party_ledgers", [True, False])
def test_reordered_and_resigned_ledger_fails(honest, tmp_path, capsys, party_ledgers):
    """The stats release moved after the eval round (as if the statistics were released last), re-signed.
    Defence: ``coordinator-heads``; without party ledgers the chain is self-consistent and nothing can
    tell (documented), so only the party-ledger case must fail."""
    run_dir = _copy(honest, tmp_path, party_ledgers)
    entries = _entries(_coord(run_dir))
    stats = entries.pop(_index(entries, "release:router-stats"))
    entries.insert(len(entries) - 1, stats)
    _write(_coord(run_dir), _resign(run_dir, entries))
    if party_ledgers:
        _audit_fails(run_dir, capsys, "coordinator-heads")
        assert any("rewritten" in f for f in audit_run(run_dir).check("coordinator-heads").findings)
    else:
        assert audit_run(run_dir).check("coordinator-heads").status == "skipped"
    assert audit_run(run_dir).verdict != "pass"  # reordered: a violation, or unverified without the parties


# ------------------------------------------------------------------- the forged cut, and the parties' receipts
def _receipt_files(run_dir: Path) -> list[Path]:
    """The receipts the parties wrote into their work dirs during the run (``distmoe.party.receipt``)."""
    files = sorted(run_dir.glob("work/*/receipts/*.json"))
    assert [f.parent.parent.name for f in files] == list(PARTIES), files
    return files


def _forge_without_the_stats_round(run_dir: Path) -> None:
    """The forged cut: every coordinator entry of the router-statistics round deleted and the chain re-signed with
    the run's key, and the run's other records rewritten to match (privacy/ledger.json without those charges,
    metrics.jsonl without the stats row, run.json and run-end with the smaller epsilon, no anchor files)."""
    from distmoe.privacy.accountant import Accountant

    entries = _entries(_coord(run_dir))
    rnd = entries[_index(entries, "release:router-stats")]["round"]
    entries = [e for e in entries if e["round"] != rnd]
    ledger = json.loads((run_dir / "privacy" / "ledger.json").read_text())
    eps = {}
    for p, st in ledger["parties"].items():
        st["events"] = [e for e in st["events"] if not e["label"].startswith("router-stats")]
        prv, rdp = Accountant.from_state_dict(st).epsilon()
        eps[p] = {"prv": prv, "rdp": rdp}
    (run_dir / "privacy" / "ledger.json").write_text(json.dumps(ledger))
    entries[-1]["info"]["epsilon"] = eps
    _write(_coord(run_dir), _resign(run_dir, entries))
    meta = json.loads((run_dir / "run.json").read_text())
    meta["privacy"]["epsilon_spent"] = eps
    (run_dir / "run.json").write_text(json.dumps(meta))
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("".join(r + "\n" for r in rows if json.loads(r).get("event") != "stats"))
    for f in (run_dir / "anchors").glob("*"):
        f.unlink()
    shutil.rmtree(run_dir / "report", ignore_errors=True)


def test_coordinator_only_audit_of_a_forged_cut_is_unverified_and_a_violation_with_the_receipts(honest, tmp_path,
                                                                                               capsys):
    """The forged cut passed ``distmoe audit RUN_DIR`` without party ledgers (exit 0, epsilon ~1.25 instead of ~8).
    Defence: without a ledger or receipt of every party the verdict is UNVERIFIED (exit 3, never 0); with the
    parties' signed receipts the rewritten chain is a violation (``receipts``: the last instruction each party
    received has another hash) and epsilon is at least each receipt's charge."""
    run_dir = _copy(honest, tmp_path, party_ledgers=False)
    receipts = _receipt_files(run_dir)
    _forge_without_the_stats_round(run_dir)
    result = audit_run(run_dir)
    assert result.failed == [] and result.verdict == "unverified", result.failed
    assert set(result.unwitnessed) == set(PARTIES)
    assert max(r["epsilon"] for r in result.epsilon.values()) < 4.0  # the forged story charges far less
    assert main(["audit", str(run_dir)]) == 3
    assert "UNVERIFIED" in capsys.readouterr().out
    assert main(["audit", str(run_dir), "--json"]) == 3
    body = json.loads(capsys.readouterr().out)
    assert body["verdict"] == "unverified" and body["verified"] is False and body["exit_status"] == 3

    args = [a for f in receipts for a in ("--receipt", str(f))]
    assert main(["audit", str(run_dir), *args]) == 1
    result = audit_run(run_dir, receipt_files=receipts)
    assert result.verdict == "fail" and "receipts" in result.failed, result.failed
    findings = result.check("receipts").findings
    for p in PARTIES:  # the chain up to each party's last instruction changed, and its unmasked round has no release
        mine = [f for f in findings if f.startswith(f"{p}-")]
        assert any("was cut" in f or "rewritten" in f for f in mine), findings
        assert any("revealed its unmask shares" in f for f in mine), findings
    assert all(r["epsilon"] >= r["party_epsilon"] > 7.0 for r in result.epsilon.values())


def test_a_forged_cut_that_leaves_the_records_is_a_violation_without_receipts(honest, tmp_path, capsys):
    """The same deletion, re-signed, but privacy/ledger.json, metrics.jsonl and run.json left as the run wrote them:
    ``release-records`` finds the releases they show and the ledger no longer holds, with no party's help."""
    run_dir = _copy(honest, tmp_path, party_ledgers=False)
    entries = _entries(_coord(run_dir))
    rnd = entries[_index(entries, "release:router-stats")]["round"]
    _write(_coord(run_dir), _resign(run_dir, [e for e in entries if e["round"] != rnd]))
    _audit_fails(run_dir, capsys, "release-records")
    findings = audit_run(run_dir).check("release-records").findings
    assert any("privacy/ledger.json charges the release 'router-stats round" in f for f in findings), findings
    assert any(f.startswith("metrics.jsonl:") for f in findings), findings


def test_receipts_of_an_honest_run_verify_it_without_the_party_ledgers(honest, tmp_path, capsys):
    """A deployment's coordinator-side audit: no party ledger in the run directory, every owner's receipt given."""
    run_dir = _copy(honest, tmp_path, party_ledgers=False)
    receipts = _receipt_files(run_dir)
    result = audit_run(run_dir, receipt_files=receipts)
    assert result.passed, [(c.name, c.findings) for c in result.checks if c.status == "fail"]
    assert result.witnessed == {p: "receipt" for p in PARTIES}
    for p in PARTIES:
        body = json.loads((run_dir / "work" / p / "receipts").glob("*.json").__next__().read_text())["body"]
        assert result.epsilon[p]["party_epsilon"] == body["epsilon"] > 7.0
        assert body["unmasked"] and body["coordinator_head"] is not None
    assert main(["audit", str(run_dir), *(a for f in receipts[:2] for a in ("--receipt", str(f)))]) == 3  # one short
    assert main(["audit", str(run_dir), *(a for f in receipts for a in ("--receipt", str(f)))]) == 0
