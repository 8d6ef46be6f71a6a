"""The ``distmoe`` command: user errors are one clear line and exit 2, nothing half-created."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from distmoe.cli import main


def test_config_show_resolves_overrides(capsys, tmp_path: Path):
    f = tmp_path / "o.toml"
    f.write_text("[routing]\nanchor-kl-coef = 0.25\n")
    assert main(["config", "show", "--config", str(f), "--run-config", "schedule.sft-rounds=2"]) == 0
    out = capsys.readouterr().out
    assert "anchor-kl-coef = 0.25" in out
    assert "sft-rounds = 2" in out
    assert "# derived:" in out and "rounds" in out


def test_config_validate_names_the_bad_key(capsys, tmp_path: Path):
    f = tmp_path / "bad.toml"
    f.write_text("[routing]\nanchor-coef = 0.25\n")
    assert main(["config", "validate", str(f)]) == 2
    err = capsys.readouterr().err
    assert "routing.anchor-coef" in err and "anchor-kl-coef" in err  # names the key and the near ones


def test_config_validate_privacy_lines_say_training_metrics_leave_only_as_update_sum_slots(capsys, tmp_path: Path):
    # the training figures ride in the update's secure sum (a learning curve every round): the privacy summary of
    # `config validate` must say so, not that they stay at the parties
    f = tmp_path / "o.toml"
    f.write_text('[schedule]\nphases = "sft:lookup, eval"\n')
    assert main(["config", "validate", str(f)]) == 0
    out = capsys.readouterr().out
    assert "stay at the parties" not in out
    assert "training metrics only as bounded slots of the update's secure sum" in out


def test_config_validate_names_key_value_and_range(capsys, tmp_path: Path):
    f = tmp_path / "bad.toml"
    f.write_text("[model]\ntop-k = 9\n")
    assert main(["config", "validate", str(f)]) == 2
    err = capsys.readouterr().err
    assert "model.top-k" in err and "9" in err and "<= 8" in err


def test_data_synth_then_validate(capsys, tmp_path: Path):
    assert main(["data", "synth", "--out", str(tmp_path / "d"), "--parties", "2", "--examples", "12"]) == 0
    assert main(["data", "validate", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "party-0: ok" in out and "party-1: ok" in out and "lookup:" in out
    # private to its owner, as the pre-run privacy check of `distmoe simulate --data` requires
    from distmoe.wire.at_rest import exposed

    assert exposed(tmp_path / "d" / "party-0") == [] and exposed(tmp_path / "d" / "party-1") == []


def test_data_validate_reports_file_line_field(capsys, tmp_path: Path):
    d = tmp_path / "p"
    d.mkdir()
    (d / "t.jsonl").write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": 5}\n')
    assert main(["data", "validate", str(d)]) == 2
    err = capsys.readouterr().err
    assert "t.jsonl:2" in err and "'output'" in err


def test_simulate_rejects_bad_config_before_creating_anything(capsys, tmp_path: Path):
    runs = tmp_path / "runs"
    code = main(["simulate", "--runs-dir", str(runs), "--run-config", "routing.anchor-granularity='x'"])
    assert code == 2
    assert "routing.anchor-granularity" in capsys.readouterr().err
    assert not runs.exists()


def test_simulate_rejects_schedule_task_no_party_holds(capsys, tmp_path: Path):
    runs = tmp_path / "runs"
    code = main(["simulate", "--runs-dir", str(runs), "--parties", "2",
                 "--run-config", "schedule.phases='sft:poetry' data.synth-examples=12"])
    assert code == 2
    assert "poetry" in capsys.readouterr().err
    assert not runs.exists()


def test_console_script_is_installed():
    exe = Path(sys.executable).parent / "distmoe"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "simulate" in out.stdout


# ---- own data, no schedule to write --------------------------------------------------------
def _own_data(root: Path, tasks=("train", "support"), parties=("a", "b")) -> Path:
    """DIR/<party>/<task>.jsonl named after the user's tasks, private to its owner like real party data."""
    for p in parties:
        d = root / p
        d.mkdir(parents=True)
        for t in tasks:
            (d / f"{t}.jsonl").write_text("".join(f'{{"instruction": "{t} {p} {i}", "output": "r{i}"}}\n'
                                                  for i in range(8)))
    return root


def _prepare(tmp_path: Path, data: Path, overrides: dict | None = None):
    from distmoe.simulate import SimOptions, prepare

    return prepare(SimOptions(overrides=dict(overrides or {}), data=data, runs_dir=tmp_path / "runs", run_id="r"))


def test_simulate_derives_the_continual_schedule_from_own_tasks(capsys, tmp_path: Path):
    """Today: 'task(s) lookup, arith are held by no party'. Now: name order, stats and eval between tasks."""
    run_dir, parties, ov = _prepare(tmp_path, _own_data(tmp_path / "d"))
    assert ov["schedule.phases"] == "sft:support, eval, stats:support, sft:train, eval"
    out = capsys.readouterr().out
    assert "schedule derived from the tasks in --data (support, train" in out
    assert "sft:support*5 -> eval -> stats:support -> sft:train*5 -> eval (13 rounds)" in out
    # written to the run's overrides, so --resume keeps it
    from distmoe.config import load_override_file

    assert load_override_file(run_dir / "overrides.toml")["schedule.phases"] == ov["schedule.phases"]


def test_simulate_one_own_task_is_tune_then_evaluate(capsys, tmp_path: Path):
    _, _, ov = _prepare(tmp_path, _own_data(tmp_path / "d", tasks=("qa",)))
    assert ov["schedule.phases"] == "sft:qa, eval"


def test_simulate_schedule_option_orders_tasks_or_sets_phases(capsys, tmp_path: Path):
    from distmoe.cli import schedule_option

    assert schedule_option("train,support") == "sft:train, eval, stats:train, sft:support, eval"
    assert schedule_option("sft:train*3, eval") == "sft:train*3, eval"
    _, _, ov = _prepare(tmp_path, _own_data(tmp_path / "d"), {"schedule.phases": schedule_option("train,support")})
    assert ov["schedule.phases"].startswith("sft:train, eval, stats:train")
    assert "derived" not in capsys.readouterr().out  # a set schedule is not replaced


def test_simulate_set_schedule_naming_absent_task_is_refused_with_hint(capsys, tmp_path: Path):
    runs = tmp_path / "runs"
    code = main(["simulate", "--data", str(_own_data(tmp_path / "d")), "--runs-dir", str(runs),
                 "--schedule", "train,poetry"])
    assert code == 2
    err = capsys.readouterr().err
    assert "poetry" in err and "tasks available: support, train" in err
    assert not runs.exists()


def test_simulate_reports_malformed_own_file_by_file_line_field_first(capsys, tmp_path: Path):
    data = _own_data(tmp_path / "d")
    with (data / "b" / "support.jsonl").open("a") as fh:
        fh.write('{"instruction": "x", "inptu": "y", "output": "z"}\n')
    runs = tmp_path / "runs"
    assert main(["simulate", "--data", str(data), "--runs-dir", str(runs)]) == 2
    err = capsys.readouterr().err
    assert "b/support.jsonl:9: field 'inptu': unknown field" in err and "instruction, input, output" in err
    assert not runs.exists()


# ---- data and CLI details ------------------------------------------------------------------
def test_simulate_names_party_dir_without_jsonl(capsys, tmp_path: Path):
    """Today such a directory was skipped silently and surfaced as a schedule or min-parties error."""
    data = _own_data(tmp_path / "d")
    (data / "c").mkdir()
    (data / "c" / "train.csv").write_text("instruction,output\na,b\n")
    runs = tmp_path / "runs"
    assert main(["simulate", "--data", str(data), "--runs-dir", str(runs)]) == 2
    err = capsys.readouterr().err
    assert "party dir" in err and "/c: no *.jsonl task files (found train.csv" in err
    assert "schedule" not in err and not runs.exists()


def test_data_synth_tasks_writes_the_preference_task(capsys, tmp_path: Path):
    assert main(["data", "synth", "--out", str(tmp_path / "d"), "--parties", "2", "--examples", "12",
                 "--tasks", "pref,arith"]) == 0
    assert sorted(p.name for p in (tmp_path / "d" / "party-0").glob("*.jsonl")) == ["arith.jsonl", "pref.jsonl"]
    assert main(["data", "validate", str(tmp_path / "d")]) == 0
    assert "pref:" in capsys.readouterr().out
    assert main(["data", "synth", "--out", str(tmp_path / "e"), "--tasks", "prefs"]) == 2
    assert "prefs" in capsys.readouterr().err


def test_simulate_refuses_a_dpo_phase_on_instruction_data(capsys, tmp_path: Path):
    """A dpo phase on a task a party holds as instruction lines: every such party would refuse every round."""
    data = _own_data(tmp_path / "d")
    runs = tmp_path / "runs"
    assert main(["simulate", "--data", str(data), "--runs-dir", str(runs), "--schedule", "sft:train, dpo:train*2"]) == 2
    err = capsys.readouterr().err
    assert "phase 'dpo:train' needs preference pairs, but party 'a' holds train.jsonl as instruction lines" in err
    assert not runs.exists()


def test_simulate_data_that_is_one_party_dir_is_named(capsys, tmp_path: Path):
    data = _own_data(tmp_path / "d") / "a"
    assert main(["simulate", "--data", str(data), "--runs-dir", str(tmp_path / "runs")]) == 2
    assert "holds <task>.jsonl files itself" in capsys.readouterr().err


def test_simulate_one_party_is_one_clear_message(capsys, tmp_path: Path):
    runs = tmp_path / "runs"
    assert main(["simulate", "--parties", "1", "--runs-dir", str(runs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--parties 1: 1 party" in err[0] and "privacy.min-parties = 2" in err[0]
    assert not runs.exists()
    assert main(["simulate", "--data", str(_own_data(tmp_path / "d", parties=("a",))), "--runs-dir", str(runs)]) == 2
    assert "1 party, but a federated run needs at least" in capsys.readouterr().err


def _all_parsers():
    import argparse

    from distmoe.cli import build_parser

    out, todo = [], [((), build_parser())]
    while todo:
        path, p = todo.pop()
        out.append((path, p))
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += [(path + (n,), sp) for n, sp in a.choices.items()]
    return out


def test_every_subcommand_help_has_description_defaults_example():
    import argparse

    from distmoe.cli import EXAMPLES

    parsers = [(path, p) for path, p in _all_parsers() if path]
    assert {" ".join(path) for path, _ in parsers} == set(EXAMPLES)  # a new subcommand needs its example
    for path, p in parsers:
        text = p.format_help()
        name = " ".join(path)
        assert p.description, f"distmoe {name}: no description"
        assert "example" in text and f"distmoe {name}" in text.split("example", 1)[1], f"distmoe {name}: no example"
        for a in p._actions:
            if a.help == argparse.SUPPRESS or isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert a.help, f"distmoe {name} {a.dest}: no help"  # positional arguments included
            shown = p.formatter_class(prog="x")._get_help_string(a)
            if a.option_strings and a.default not in (None, False) and not isinstance(a.default, list):
                assert "default" in shown, f"distmoe {name} {a.option_strings}: default {a.default!r} not shown"


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"distmoe {version('distmoe')}"


def test_audit_help_states_exit_codes():
    parser = dict(_all_parsers())[("audit",)]
    text = parser.format_help()
    assert "0  every check passed" in text and "1  a check failed" in text and "2  unusable input" in text
    assert "3  unverified" in text and "--receipt" in text


def test_audit_json_prints_json_on_error_paths(capsys, tmp_path: Path):
    import json

    assert main(["audit", "--json", str(tmp_path / "missing")]) == 2
    got = json.loads(capsys.readouterr().out)
    assert got["exit_status"] == 2 and "no such run directory" in got["error"]
    with pytest.raises(SystemExit):
        main(["audit", "--json", str(tmp_path), "--bogus"])
    assert json.loads(capsys.readouterr().out)["exit_status"] == 2


def test_mistyped_option_prints_the_subcommand_usage(capsys, tmp_path: Path):
    with pytest.raises(SystemExit) as exc:
        main(["data", "validate", str(tmp_path), "--confg", "x.toml"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "usage: distmoe data validate" in err and "unrecognized arguments: --confg" in err


def test_missing_directory_is_named_by_report_audit_resume(capsys, tmp_path: Path):
    missing = tmp_path / "nope"
    for argv in (["report", str(missing)], ["audit", str(missing)], ["simulate", "--resume", str(missing)]):
        assert main(argv) == 2, argv
        assert "no such run directory" in capsys.readouterr().err, argv


def test_data_validate_names_missing_dir_and_csv_only_party(capsys, tmp_path: Path):
    assert main(["data", "validate", str(tmp_path / "nope")]) == 2
    assert "nope: no such directory" in capsys.readouterr().err
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "train.csv").write_text("a,b\n")
    assert main(["data", "validate", str(tmp_path / "p")]) == 2
    assert "no *.jsonl task files (found train.csv" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["config", "show"], ["data", "validate", "{data}"], ["rollback", "{run}"]])
def test_output_piped_into_a_reader_that_closes_early_ends_quietly(tmp_path, argv, monkeypatch, capsys):
    """``distmoe config show | head``: a reader that has left gives no BrokenPipeError traceback; the exit status
    is 141 (128 + SIGPIPE), as for any command cut off by its pipe. stdout is a real pipe whose read end is
    closed before the command writes (what ``head`` leaves behind once it has its lines)."""
    from distmoe.data.synth import write_synthetic
    from distmoe.wire.at_rest import make_private

    data = tmp_path / "data"
    for d in write_synthetic(data, 2, 4, 0):
        make_private(d)
    for n in range(3):  # `rollback` lists the kept rounds
        (tmp_path / "run" / "checkpoints" / f"round-{n}").mkdir(parents=True)
    args = [a.format(data=data, run=tmp_path / "run") for a in argv]
    r, w = os.pipe()
    os.close(r)  # the reader is gone
    with capsys.disabled():
        out = os.fdopen(w, "w")
        monkeypatch.setattr(sys, "stdout", out)
        code = main(args)  # raises BrokenPipeError without the entry point's handling
        monkeypatch.undo()
        out.close() if not out.closed else None
    assert code == 141
