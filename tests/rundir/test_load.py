"""The one reader of a run directory (``distmoe.rundir.load_run``): a partial run loads, and a file a reader needs
that is missing or bad is an error naming that file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distmoe.rundir import LoadedRun, MissingRunFile, RunDir, RunFileError, load_run, read_json, read_ledger
from distmoe.rundir.metrics import MetricsLog


def _entry(seq: int, run: str, kind: str = "instruction", **info) -> str:
    return json.dumps({"seq": seq, "run": run, "payload_type": kind, **({"info": info} if info else {})})


@pytest.fixture
def partial(tmp_path) -> Path:
    """A run that stopped after one round: a record, two metrics rows and a torn third; no ledger, no
    accountants, no party work."""
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.record.write_text(json.dumps({"run_id": "r1", "status": "running"}))
    log = MetricsLog(run.metrics)
    log.append({"event": "run_start"})
    log.append({"event": "train", "round": 1, "party": "all", "loss": 1.5})
    with run.metrics.open("a") as fh:
        fh.write('{"event": "eval", "rou')  # the crash tore the last line
    return run.root


def test_a_partial_run_loads_what_it_has(partial):
    run = load_run(partial)
    assert isinstance(run, LoadedRun) and run.root == partial
    assert run.record == {"run_id": "r1", "status": "running"} and run.record_problem is None
    assert [e["event"] for e in run.metrics] == ["run_start", "train"] and run.metrics.skipped == 1
    assert run.accounts is None  # no release yet: nothing to read, no error
    assert run.party_ledgers() == {}


def test_a_missing_ledger_is_an_error_naming_it_only_when_asked_for(partial):
    run = load_run(partial)
    with pytest.raises(MissingRunFile, match=r"ledger/coordinator\.jsonl: the coordinator ledger is missing"):
        _ = run.coordinator_ledger
    assert run.record["run_id"] == "r1"  # the rest still loads


@pytest.mark.parametrize("text,why", [
    (None, "run.json: the run record is missing"),
    ("{not json", "run.json: the run record is not valid JSON"),
    ("[1, 2]", "run.json: the run record is not a JSON object"),
])
def test_a_bad_run_record_names_the_file(partial, text, why):
    path = RunDir(partial).record
    path.unlink()
    if text is not None:
        path.write_text(text)
    run = load_run(partial)
    with pytest.raises(RunFileError, match=why) as exc:
        _ = run.record
    assert exc.value.path == path
    assert run.record_problem == exc.value.brief and run.record_problem.startswith("run.json ")
    assert len(run.metrics) == 2  # the metrics still load: the report shows a run without its record


def test_missing_metrics_are_a_file_not_found_naming_the_log(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(FileNotFoundError, match=r"metrics\.jsonl: the run's metrics log is missing"):
        _ = load_run(tmp_path / "run").metrics


def test_a_corrupt_metrics_line_before_the_last_names_its_line(partial):
    path = RunDir(partial).metrics
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "{broken", lines[1]]) + "\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl: line 2: malformed metrics line"):
        _ = load_run(partial).metrics


def test_no_run_directory(tmp_path):
    with pytest.raises(MissingRunFile, match="no such run directory"):
        load_run(tmp_path / "nope")


def test_unreadable_accounts_name_the_file(partial):
    acc = RunDir(partial).accounts
    acc.parent.mkdir()
    acc.write_text("{")
    with pytest.raises(RunFileError, match=r"privacy/ledger\.json: the server's privacy ledger is not valid JSON"):
        _ = load_run(partial).accounts
    acc.write_text('{"parties": {}}')
    assert load_run(partial).accounts == {"parties": {}}


def test_ledgers_are_parsed_leniently_and_a_party_keeps_this_runs_entries(partial):
    run = RunDir(partial)
    run.ledger.parent.mkdir()
    run.ledger.write_text("\n".join([_entry(0, "r1"), "garbage", _entry(1, "r2", "run-resume", session="r2")]) + "\n")
    run.ledger_pub.write_text("ab" * 32 + "\n")
    led = run.party("p0").ledger("p0")
    led.parent.mkdir(parents=True)
    led.write_text("\n".join([_entry(0, "old-run"), _entry(1, "r1"), _entry(2, "r2")]) + "\n")
    files = load_run(partial)
    coord = files.coordinator_ledger
    assert [e["seq"] for e in coord.entries] == [0, 1] and coord.pub == "ab" * 32  # the garbage line is skipped
    assert files.run_ids() == {"r1", "r2"}  # the resumed session's id counts as this run's
    [(name, party)] = files.party_ledgers().items()
    assert name == "p0" and sorted(party.by_seq) == [1, 2] and party.pub is None


def test_given_party_ledgers_must_exist_and_be_one_per_node(partial, tmp_path):
    run = RunDir(partial)
    run.ledger.parent.mkdir()
    run.ledger.write_text(_entry(0, "r1") + "\n")
    files = load_run(partial)
    with pytest.raises(MissingRunFile, match=r"p9\.jsonl: a party ledger is missing"):
        files.party_ledgers([tmp_path / "p9.jsonl"])
    a, b = tmp_path / "a" / "p0.jsonl", tmp_path / "b" / "p0.jsonl"
    for p in (a, b):
        p.parent.mkdir()
        p.write_text(_entry(0, "r1") + "\n")
    with pytest.raises(RunFileError, match="a second ledger for node 'p0'"):
        files.party_ledgers([a, b])
    with pytest.raises(MissingRunFile, match="the ledger of x is missing"):
        read_ledger("x", tmp_path / "x.jsonl")


def test_read_json_names_what_it_reads(tmp_path):
    with pytest.raises(MissingRunFile, match=r"r\.json: receipt is missing"):
        read_json(tmp_path / "r.json", "receipt")
    (tmp_path / "r.json").write_text("[]")
    assert read_json(tmp_path / "r.json", "receipt") == []
    with pytest.raises(RunFileError, match="receipt is not a JSON object"):
        read_json(tmp_path / "r.json", "receipt", obj=True)
