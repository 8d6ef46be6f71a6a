"""The owner policy and code pin in the audit: each receipt must name the policy and pin its party's ledger recorded
at this run's setup, and a policy-bound party without a pin needs its owner's opt-out.

Two real in-process runs (``Coordinator`` over ``LocalTransport``, every party with an owner policy): run A with the
strict policy, run B where party-0 (the same work directory, so one ledger holds both runs) set up under a weaker one.
Each attack is a receipt that the party's own key signs, judged by ``distmoe audit RUN --receipt FILE``:

- a receipt naming a stricter policy than the setup ran under (the owner's node config changed after setup, or code
  that claims the owner's policy);
- a receipt naming another code pin than the setup recorded (the party's code changed within the run);
- an earlier run's setup in the same ledger does not vouch for this run (an honest receipt judged against its own
  run's setup, not the first one in the file);
- a party ledger cut before this run's setup;
- a policy-bound receipt without a code pin and without the owner's ``policy-allow-unpinned``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from distmoe.audit import audit_run
from distmoe.cli import main
from distmoe.config import parse_node_config, parse_run_config
from distmoe.deploy import pin as code_pin
from distmoe.party.policy import owner_policy
from distmoe.party.receipt import receipt_path, write_receipt
from distmoe.wire.at_rest import make_private

pytestmark = pytest.mark.integration  # whole in-process runs

PARTIES = ("party-0", "party-1", "party-2")
STRICT = {"policy": "deployed", "policy-min-parties": 2, "policy-max-rounds": 50}
WEAK = {"policy": "deployed", "policy-min-parties": 2}  # policy-max-rounds 1000: a weaker policy
PIN, OTHER_PIN = "c0" * 32, "d1" * 32


def _run(tmp: Path, make_run, node_extra: dict) -> tuple[Path, dict, str]:
    """One pinned run; -> (run dir, the run config dict, the Flower run id)."""
    coord, transport, run_dir, dirs, _ = make_run(tmp, node_extra=node_extra)
    for d in dirs:  # an owner's data is private to it (the party's pre-run privacy check refuses it otherwise)
        make_private(d)
    saved = dict(code_pin._ACTIVE)
    code_pin.set_active_digest(PIN)  # as the pinned launcher does in a deployed ClientApp process
    try:
        rec = coord.run()
    finally:
        code_pin._ACTIVE.clear()
        code_pin._ACTIVE.update(saved)
    assert rec["status"] == "completed", rec.get("error")
    return run_dir, json.loads((run_dir / "run.json").read_text())["config"], transport.run_id


@pytest.fixture(scope="module")
def runs(tmp_path_factory, make_run):
    """Run A (every party strict), then run B with party-0 in run A's work directory under the weak policy."""
    a_dir, a_cfg, a_id = _run(tmp_path_factory.mktemp("owner-a"), make_run, {p: STRICT for p in PARTIES})
    shared = str(a_dir / "work" / "party-0")
    b_dir, b_cfg, b_id = _run(tmp_path_factory.mktemp("owner-b"), make_run,
                              {"party-0": {**WEAK, "work-dir": shared}, "party-1": STRICT, "party-2": STRICT})
    return {"a": (a_dir, a_cfg, a_id), "b": (b_dir, b_cfg, b_id), "shared": Path(shared)}


def _work(run_dir: Path, p: str, runs: dict) -> Path:
    return runs["shared"] if p == "party-0" else run_dir / "work" / p


def _copy_out(runs: dict, which: str, tmp: Path) -> tuple[Path, list[Path], list[Path], str]:
    """A deployment's view of run ``which``: the run directory without party ledgers, each owner's ledger and
    receipt copied out (the owners keep them); -> (run dir, ledgers, receipts, run id)."""
    src, cfg, run_id = runs[which]
    run_dir = tmp / "run"
    shutil.copytree(src, run_dir, ignore=shutil.ignore_patterns("work"))
    ledgers, receipts = [], []
    for p in PARTIES:
        work = _work(src, p, runs)
        (tmp / p).mkdir()
        for suffix in (".jsonl", ".pub"):
            shutil.copy(work / "ledger" / f"{p}{suffix}", tmp / p / f"{p}{suffix}")
        ledgers.append(tmp / p / f"{p}.jsonl")
        receipts.append(shutil.copy(work / "receipts" / receipt_path(_node(work, p, cfg), run_id).name,
                                    tmp / p / "receipt.json"))
    return run_dir, ledgers, [Path(r) for r in receipts], run_id


def _node(work: Path, p: str, cfg: dict, policy: dict | None = None):
    nc = {"data-path": str(work), "party-name": p, "work-dir": str(work), **(policy or {})}
    return parse_node_config(nc, parse_run_config(cfg).sim)


def _resign_receipt(receipt: Path, work: Path, p: str, cfg: dict, run_id: str, policy: dict, pin: str | None) -> None:
    """What the party's code writes as its receipt under ``policy`` and ``pin`` (its own key signs it)."""
    node = _node(work, p, cfg, policy)
    path = receipt_path(node, run_id)
    saved, honest = dict(code_pin._ACTIVE), path.read_bytes()
    code_pin._ACTIVE.clear()
    if pin is not None:
        code_pin.set_active_digest(pin)
    try:
        assert write_receipt(parse_run_config(cfg), node, run_id, owner_policy(node)) == path
        shutil.copy(path, receipt)
    finally:  # the party's own receipt stays as the run left it, for the other tests
        code_pin._ACTIVE.clear()
        code_pin._ACTIVE.update(saved)
        path.write_bytes(honest)


def _findings(result) -> list[str]:
    return result.check("receipts").findings


def test_honest_policy_bound_pinned_runs_verify_from_the_receipts(runs, tmp_path, capsys):
    run_dir, ledgers, receipts, _ = _copy_out(runs, "a", tmp_path)
    result = audit_run(run_dir, party_ledgers=[], receipt_files=receipts)
    assert result.verdict == "pass", (result.failed, _findings(result))
    notes = " ".join(result.check("receipts").details)
    assert f"code pin {PIN[:16]}" in notes and "owner policy" in notes and "no owner policy" not in notes
    assert audit_run(run_dir, party_ledgers=ledgers, receipt_files=receipts).verdict == "pass"
    assert main(["audit", str(run_dir), *(a for f in receipts for a in ("--receipt", str(f)))]) == 0
    capsys.readouterr()


def test_a_receipt_naming_a_stricter_policy_than_the_setup_ran_under_is_a_violation(runs, tmp_path, capsys):
    run_dir, ledgers, receipts, run_id = _copy_out(runs, "b", tmp_path)
    _resign_receipt(receipts[0], runs["shared"], "party-0", runs["b"][1], run_id, STRICT, PIN)
    result = audit_run(run_dir, party_ledgers=ledgers, receipt_files=receipts)
    assert result.failed == ["receipts"], result.failed
    assert any("did not run under the policy its receipt names" in f for f in _findings(result)), _findings(result)
    assert main(["audit", str(run_dir), *(a for f in ledgers for a in ("--party-ledger", str(f))),
                 *(a for f in receipts for a in ("--receipt", str(f)))]) == 1
    capsys.readouterr()


def test_a_receipt_naming_another_code_pin_than_the_setup_recorded_is_a_violation(runs, tmp_path):
    run_dir, ledgers, receipts, run_id = _copy_out(runs, "a", tmp_path)
    work = runs["a"][0] / "work" / "party-1"
    _resign_receipt(receipts[1], work, "party-1", runs["a"][1], run_id, STRICT, OTHER_PIN)
    result = audit_run(run_dir, party_ledgers=ledgers, receipt_files=receipts)
    assert result.failed == ["receipts"], result.failed
    assert any(f.startswith("receipt.json: party-1#") and "the party's code changed within the run" in f
               for f in _findings(result)), _findings(result)


def test_an_earlier_runs_setup_in_the_same_ledger_does_not_vouch_for_this_run(runs, tmp_path):
    """party-0's ledger holds run A's strict setup before run B's weak one: its honest receipt of run B (weak) is
    judged against run B's setup only, and one claiming strict is not saved by run A's."""
    run_dir, ledgers, receipts, run_id = _copy_out(runs, "b", tmp_path)
    entries = [json.loads(x) for x in ledgers[0].read_text().splitlines() if x]
    assert [e["run"] for e in entries if e["payload_type"] == "key-advert" and e["direction"] == "out"] == [
        runs["a"][2], run_id]
    result = audit_run(run_dir, party_ledgers=ledgers, receipt_files=receipts)
    assert result.verdict == "pass", (result.failed, _findings(result))


def test_a_party_ledger_cut_before_this_runs_setup_leaves_the_policy_unwitnessed(runs, tmp_path):
    run_dir, ledgers, receipts, run_id = _copy_out(runs, "b", tmp_path)
    lines = ledgers[0].read_text().splitlines(keepends=True)
    first_b = next(i for i, x in enumerate(lines) if json.loads(x)["run"] == run_id)
    ledgers[0].write_text("".join(lines[:first_b]))  # the ledger as it was before run B: verifies on its own
    result = audit_run(run_dir, party_ledgers=ledgers, receipt_files=receipts)
    assert "receipts" in result.failed, (result.failed, _findings(result))
    assert any(f"holds no setup (key-advert) of run {run_id!r}" in f for f in _findings(result)), _findings(result)


def test_a_policy_bound_receipt_without_a_code_pin_needs_the_owners_opt_out(runs, tmp_path):
    run_dir, _, receipts, run_id = _copy_out(runs, "a", tmp_path)
    for p, receipt, policy in (("party-1", receipts[1], STRICT),
                               ("party-2", receipts[2], {**STRICT, "policy-allow-unpinned": True})):
        _resign_receipt(receipt, runs["a"][0] / "work" / p, p, runs["a"][1], run_id, policy, None)
    result = audit_run(run_dir, party_ledgers=[], receipt_files=receipts)
    assert result.failed == ["receipts"], result.failed
    unpinned = [f for f in _findings(result) if "ran without a code pin" in f]
    assert len(unpinned) == 1 and "party-1" in unpinned[0], _findings(result)
