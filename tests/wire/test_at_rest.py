"""Privacy at rest and in logs: simulate writes party files private, and the pre-run
check refuses a world-readable party directory, an allow-list with free text, and a log line with data."""

from __future__ import annotations

import inspect
import os
import stat

import numpy as np
import pytest

from distmoe import simulate
from distmoe.data.synth import write_synthetic
from distmoe.simulate import SimOptions, SimulationError, launch, prepare, privacy_check
from distmoe.wire import party_guard
from distmoe.wire.at_rest import (
    PreflightError,
    check_allow_list,
    check_logging,
    exposed,
    privacy_preflight,
)
from distmoe.wire.party_guard import failure_log


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_simulate_writes_party_data_and_work_dirs_private(tmp_path):
    old = os.umask(0o022)  # an ordinary user's umask: simulate must not depend on it
    try:
        run_dir, parties, _ = prepare(SimOptions(overrides={}, parties=2, runs_dir=tmp_path / "runs", run_id="r"))
    finally:
        os.umask(old)
    work = run_dir / "work"
    paths = [work, *work.rglob("*")]
    assert any(p.name == "canaries.txt" for p in paths) and any(p.suffix == ".jsonl" for p in paths)
    for p in paths:
        assert _mode(p) == (0o700 if p.is_dir() else 0o600), (p, oct(_mode(p)))
    for p in parties:
        assert (work / p.name).is_dir() and _mode(work / p.name) == 0o700
    privacy_check(run_dir, parties, "before the run")  # passes


def test_world_readable_party_dir_fails_the_pre_run_check(tmp_path):
    run_dir, parties, _ = prepare(SimOptions(overrides={}, parties=2, runs_dir=tmp_path / "runs", run_id="r"))
    bad = parties[1]
    os.chmod(bad, 0o755)
    with pytest.raises(SimulationError) as ei:
        privacy_check(run_dir, parties, "before the run")
    msg = str(ei.value)
    assert "privacy check before the run failed" in msg and f"party {bad.name}" in msg
    assert f"{bad} (mode 0o755)" in msg and "chmod -R go-rwx" in msg
    os.chmod(bad, 0o700)
    os.chmod(next(bad.glob("*.jsonl")), 0o644)  # one world-readable data file is named too
    with pytest.raises(SimulationError, match=r"\.jsonl \(mode 0o644\)"):
        privacy_check(run_dir, parties, "at the end of the run")


def test_simulate_refuses_readable_data_before_flower_starts(tmp_path, monkeypatch):
    old = os.umask(0o022)
    try:
        write_synthetic(tmp_path / "data", 2, 4, 0)  # the user's own data, 0755/0644
    finally:
        os.umask(old)
    monkeypatch.setattr(launch, "_flwr_bin", lambda: pytest.fail("Flower started despite the privacy check"))
    with pytest.raises(SimulationError, match=str(tmp_path / "data" / "party-0")):
        simulate.run(SimOptions(overrides={}, data=tmp_path / "data", runs_dir=tmp_path / "runs", run_id="x",
                                echo=False, report=False))


def test_failure_log_never_prints_the_exception_message():
    secret = "SECRET-ANSWER-" + os.urandom(4).hex()

    def tokenize(text):
        raise ValueError(f"chat template failed on {text!r}")

    try:
        tokenize(secret)
    except ValueError as exc:
        line = failure_log("p0", "sft", exc)
    assert secret not in line and "ValueError (message withheld)" in line and "in tokenize" in line
    assert check_logging() == []  # log_detail prints only the code; its party.log is created 0600
    # no traceback printer with messages left on the ClientApp's stdout paths (the guard's go to party.log)
    from clients import app

    assert "format_exc" not in inspect.getsource(app) and "print_exc" not in inspect.getsource(app)
    assert "print(" not in inspect.getsource(party_guard.serve)


def test_allow_list_check():
    from distmoe.wire.server_guard import build_policy

    policy = build_policy(secure=True, n_parties=3, trainable={"w": (2, 3)}, layers=2, experts=4, update_length=16,
                          stats_length=8 + 2048, rl_update_length=16, tasks=("arith",), eval_length=8)
    assert check_allow_list(policy) == []
    assert check_allow_list({**policy, "eval-reply": {**policy["masked-input:eval"], "keys_pattern": "text.*"}})
    assert check_allow_list({**policy, "error": {**policy["error"], "max_bytes": 1 << 20}})
    with pytest.raises(PreflightError, match="error.reason only"):
        privacy_preflight({}, {**policy, "error": {"keys": ["error.reason", "error.example"], "max_bytes": 64}})


def test_exposed_lists_group_and_other_bits(tmp_path):
    d = tmp_path / "p"
    d.mkdir(mode=0o700)
    f = d / "x"
    f.write_bytes(np.zeros(1).tobytes())
    os.chmod(f, 0o640)
    assert exposed(d) == [f"{f} (mode 0o640)"]
