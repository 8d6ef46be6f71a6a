"""The ``distmoe`` command: user errors are one clear line and exit 2, nothing half-created."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
