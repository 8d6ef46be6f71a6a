"""``data validate`` and ``simulate --data`` run one check: every problem at once, the file modes a run
refuses, and the answer / prompt lengths against what evaluation generates and the sequence length."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from distmoe.cli import main
from distmoe.config import load_override_file, parse_run_config
from distmoe.simulate import SimOptions, SimulationError, prepare, privacy_check
from distmoe.simulate.datacheck import check_parties
from distmoe.wire.at_rest import make_private


def _party(root: Path, name: str, lines: list[str], private: bool = True) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "qa.jsonl").write_text("".join(x + "\n" for x in lines))
    if private:
        make_private(d)
    else:
        os.chmod(d, 0o755)
        os.chmod(d / "qa.jsonl", 0o644)
    return d


GOOD = [f'{{"instruction": "Say {i}", "output": "answer number {i:02d} in full"}}' for i in range(10)]


def test_validate_reports_every_problem_not_only_the_first(tmp_path: Path, capsys):
    _party(tmp_path / "d", "a", [GOOD[0], '{"instruction": "x", "output": 5}', "{not json", GOOD[1]])
    _party(tmp_path / "d", "b", [GOOD[0], '{"inptu": "x", "output": "y"}'])
    assert main(["data", "validate", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "error: 3 problems:" in err
    assert "a/qa.jsonl:2: field 'output'" in err and "a/qa.jsonl:3: invalid JSON" in err and "b/qa.jsonl:2" in err


def test_validate_runs_the_privacy_check_simulate_runs(tmp_path: Path, capsys):
    """0755 / 0644: what `simulate --data` refuses before anything trains, `data validate` refuses too."""
    d = _party(tmp_path / "d", "a", GOOD, private=False)
    _party(tmp_path / "d", "b", GOOD)
    with pytest.raises(SimulationError, match="chmod -R go-rwx"):  # the run's own privacy check
        privacy_check(tmp_path / "run", [d], "before the run")
    assert main(["data", "validate", str(tmp_path / "d")]) == 2
    captured = capsys.readouterr()
    assert f"{d} (mode 0o755)" in captured.err and f"chmod -R go-rwx {d}" in captured.err
    assert f"{tmp_path / 'd' / 'b'}: ok" in captured.out
    make_private(d)
    assert main(["data", "validate", str(tmp_path / "d")]) == 0


def test_long_answers_and_prompts_are_named_with_the_numbers_and_the_key(tmp_path: Path):
    long_prompt = '{"instruction": "' + "p" * 120 + '", "output": "ok"}'
    d = _party(tmp_path / "d", "a", [*GOOD, long_prompt])
    rep = check_parties([d], parse_run_config({}))  # eval.max-new-tokens = 10, model.max-seq-len = 96
    assert rep.errors == []
    ans = next(w for w in rep.warnings if "answers are longer" in w)
    # the character tokenizer: "answer number 00 in full" is 24 tokens
    assert "10 of 11 answers are longer than eval.max-new-tokens = 10 tokens (longest 24)" in ans
    assert "set eval.max-new-tokens = 24" in ans
    cut = next(w for w in rep.warnings if "prompts are longer" in w)
    assert "model.max-seq-len - eval.max-new-tokens = 96 - 10 = 86 tokens" in cut and "set model.max-seq-len" in cut
    rep = check_parties([d], parse_run_config({"eval.max-new-tokens": 24, "model.max-seq-len": 256}))
    assert rep.warnings == []


def test_answers_that_do_not_fit_model_max_seq_len_are_named_as_left_out(tmp_path: Path):
    long_answer = '{"instruction": "q", "output": "' + "a" * 120 + '"}'
    d = _party(tmp_path / "d", "a", [*GOOD, long_answer])
    rep = check_parties([d], parse_run_config({"eval.max-new-tokens": 120}))  # model.max-seq-len = 96
    (w,) = [w for w in rep.warnings if "left out" in w]
    assert "1 of 11 answers need model.max-seq-len = 96 tokens or more" in w and "set model.max-seq-len = " in w
    assert not [w for w in check_parties([d], parse_run_config({"eval.max-new-tokens": 120,
                                                                 "model.max-seq-len": 256})).warnings
                if "left out" in w]


def test_simulate_data_derives_eval_max_new_tokens_from_the_answers(tmp_path: Path, capsys):
    data = tmp_path / "d"
    for p in ("a", "b"):
        _party(data, p, GOOD)
    run_dir, _, ov = prepare(SimOptions(overrides={}, data=data, runs_dir=tmp_path / "runs", run_id="r"))
    assert ov["eval.max-new-tokens"] == 24
    assert load_override_file(run_dir / "overrides.toml")["eval.max-new-tokens"] == 24  # --resume keeps it
    assert "eval.max-new-tokens = 24 (the longest answer in --data" in capsys.readouterr().out
    _, _, ov = prepare(SimOptions(overrides={"eval.max-new-tokens": 12}, data=data, runs_dir=tmp_path / "runs",
                                  run_id="s"))
    assert ov["eval.max-new-tokens"] == 12  # set by the user: kept, and the warning says why it is short
    err = capsys.readouterr().err
    assert "answers are longer than eval.max-new-tokens = 12" in " ".join(err.split())
    assert all(len(x) <= 100 for x in err.splitlines()), err  # a long warning in lines of at most 100 columns


def test_planted_canaries_do_not_count_as_answers(tmp_path: Path):
    canary = "canary-" + "0" * 32
    d = _party(tmp_path / "d", "a", [*(f'{{"instruction": "q{i}", "output": "a{i}"}}' for i in range(8)),
                                     f'{{"instruction": "secret", "output": "{canary}"}}'])
    cfg = parse_run_config({})
    assert any("1 of 9 answers are longer" in w for w in check_parties([d], cfg).warnings)
    (d / "canaries.txt").write_text(canary + "\n")  # what `distmoe data synth --canaries` lists
    make_private(d)
    assert check_parties([d], cfg).warnings == []


def test_validate_says_what_simulate_data_sets_eval_max_new_tokens_to(tmp_path: Path, capsys):
    """`data validate` warns at the configured eval.max-new-tokens (what a deployment uses) and, the key unset,
    says the value `simulate --data` derives, the one prepare() sets; the output fits 100 columns."""
    for p in ("a", "b"):
        _party(tmp_path / "d", p, GOOD)
    assert main(["data", "validate", str(tmp_path / "d")]) == 0
    err = capsys.readouterr().err
    flat = " ".join(err.split())
    assert "answers are longer than eval.max-new-tokens = 10" in flat
    assert "note: eval.max-new-tokens is not set: `distmoe simulate --data` sets it to 24" in flat
    assert all(len(x) <= 100 for x in err.splitlines()), err
    _, _, ov = prepare(SimOptions(overrides={}, data=tmp_path / "d", runs_dir=tmp_path / "runs", run_id="r"))
    assert ov["eval.max-new-tokens"] == 24  # the same value
    capsys.readouterr()
    assert main(["data", "validate", str(tmp_path / "d"), "--run-config", "eval.max-new-tokens=12"]) == 0
    assert "note:" not in capsys.readouterr().err  # set by the user: only the warning
