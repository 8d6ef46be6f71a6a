"""Everything ``distmoe simulate`` does before Flower starts: validate, then make the run directory.

Owns: ``SimOptions``; :func:`prepare` (configuration and every party's data validated first; with ``--data``
and no schedule set, the schedule derived from the data's tasks, :func:`data_schedule`; then ``runs/<id>/``
with synthetic data when none is given and one node file per virtual SuperNode, so each sees only its own
party directory); :func:`prepare_resume` (an interrupted run's directory, data and overrides, after the
resume checks); the privacy check of the party directories (:func:`privacy_check`). A start that fails
leaves no half-made run directory.

Must not: import ``flwr``, or start a process.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from distmoe.config import (
    ConfigError,
    continual_schedule,
    load_override_file,
    parse_run_config,
    schedule_text,
    to_toml,
)
from distmoe.data.formats import DataError
from distmoe.report.progress import wrap
from distmoe.rundir import RunDir
from distmoe.simulate.datacheck import check_parties, derived_max_new_tokens, length_findings, tokenizer_for
from distmoe.simulate.processes import SimulationError
from distmoe.wire.at_rest import PRIVATE_DIR, PRIVATE_UMASK, PreflightError, make_private, privacy_preflight


@dataclass(frozen=True)
class SimOptions:
    overrides: dict
    parties: int | None = None
    data: Path | None = None
    run_id: str | None = None
    runs_dir: Path = Path("runs")
    port: int | None = None
    timeout: float = 3600.0
    report: bool = True
    echo: bool = True
    cpus_per_party: int = 1
    resume: Path | None = None  # an interrupted run directory to continue


def app_dir() -> Path:
    """The Flower app directory (the source checkout holding pyproject.toml)."""
    root = Path(__file__).resolve().parents[2]
    pp = root / "pyproject.toml"
    if not pp.exists() or "[tool.flwr.app]" not in pp.read_text():
        raise SimulationError(f"the Flower app (pyproject.toml with [tool.flwr.app]) was not found at {root}; "
                              "install distmoe from its source checkout with `pip install -e .`")
    return root


def _party_dirs(data: Path) -> list[Path]:
    """Every subdirectory of ``--data`` is a party (hidden ones aside); ``load_party`` then names one without
    ``*.jsonl`` files instead of it being skipped silently."""
    if not data.is_dir():
        raise DataError(f"--data {data}: not a directory" if data.exists() else f"--data {data}: no such directory")
    if any(f.is_file() for f in data.glob("*.jsonl")):
        raise DataError(f"--data {data}: holds <task>.jsonl files itself (one party's directory?); simulate needs "
                        "one subdirectory per party: DIR/<party>/<task>.jsonl")
    dirs = sorted(p for p in data.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not dirs:
        raise DataError(f"--data {data}: no party subdirectories (expected DIR/<party>/<task>.jsonl)")
    return dirs


def _check_party_count(n: int, cfg, what: str) -> None:
    """One message when there are fewer parties than any release may be aggregated over."""
    if cfg.privacy.secure and n < cfg.privacy.min_parties:
        raise ConfigError(f"{what}: {n} part{'y' if n == 1 else 'ies'}, but a federated run needs at least "
                          f"privacy.min-parties = {cfg.privacy.min_parties} (secure aggregation never releases "
                          f"fewer parties' figures); use {cfg.privacy.min_parties} parties or more")


def data_schedule(overrides: dict, held: list[str]) -> str | None:
    """The schedule derived from the tasks of the user's data when none is set (``config.continual_schedule``
    over ``held`` in name order), or None when ``schedule.phases`` is set."""
    if "schedule.phases" in overrides:
        return None
    return continual_schedule(sorted(held))


def _check_tensorboard(cfg, opts: SimOptions) -> None:
    """``report.tensorboard = true`` without the ``tensorboard`` package: a config error before anything starts."""
    if cfg.report.tensorboard and opts.report:
        from distmoe.report.tensorboard import TensorBoardMissing, require

        try:
            require()
        except TensorBoardMissing as exc:
            raise ConfigError(f"config key 'report.tensorboard': value true: {exc}") from None


def prepare(opts: SimOptions) -> tuple[Path, list[Path], dict]:
    """Validate, create the run directory, data and node files; return (run_dir, party_dirs, overrides)."""
    overrides = dict(opts.overrides)
    cfg = parse_run_config(overrides)  # fail before anything is created
    _check_tensorboard(cfg, opts)
    run_id = opts.run_id or time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
    run_dir = (opts.runs_dir / run_id).resolve()
    if run_dir.exists() and any(run_dir.iterdir()):
        raise SimulationError(f"run directory {run_dir} already exists and is not empty")
    from distmoe.data.synth import synth_tasks

    derived = None
    notes: list[str] = []  # printed before anything starts
    if opts.data is not None:
        parties = _party_dirs(opts.data.resolve())
        if opts.parties is not None and opts.parties != len(parties):
            raise SimulationError(f"--parties {opts.parties} but --data {opts.data} has {len(parties)} "
                                  "party directories")
        _check_party_count(len(parties), cfg, f"--data {opts.data}")
        # every problem of every party at once (file, line, field; names), as `data validate` shows; the file
        # modes are checked by the privacy check before the run (the same check_isolation `data validate` runs)
        report = check_parties(parties, cfg, modes=False, lengths=False)
        report.raise_errors(f"--data {opts.data}")
        held: set[str] = set()
        plain: dict[str, str] = {}  # task -> a party holding it without preference pairs
        for name, data in report.parties.items():
            held.update(data.tasks)
            plain.update({t: name for t in data.tasks if not data.is_preference(t) and t not in plain})
        derived = data_schedule(overrides, sorted(held))
        if derived is not None:
            overrides["schedule.phases"] = derived
        tok = tokenizer_for(cfg)
        if "eval.max-new-tokens" not in overrides:  # evaluation generates as long as the longest answer
            overrides["eval.max-new-tokens"] = derived_max_new_tokens(tok, report.parties, cfg.model.max_seq_len)
            notes.append(f"eval.max-new-tokens = {overrides['eval.max-new-tokens']} (the longest answer in --data, "
                         "in tokens; set the key to choose it yourself)")
        cfg = parse_run_config(overrides)
        for name, data in report.parties.items():
            notes.extend("warning: " + w for w in length_findings(tok, name, data, cfg.eval.max_new_tokens,
                                                                   cfg.model.max_seq_len))
        for ph in cfg.schedule.phases:  # every party would refuse a dpo round on instruction data
            if ph.kind == "dpo" and ph.task in plain:
                raise DataError(f"--data {opts.data}: phase 'dpo:{ph.task}' needs preference pairs, but party "
                                f"{plain[ph.task]!r} holds {ph.task}.jsonl as instruction lines (a dpo task has "
                                "lines {\"prompt\", \"chosen\", \"rejected\"})")
    else:
        parties = None
        held = set(synth_tasks(cfg.schedule.tasks))
        _check_party_count(opts.parties if opts.parties is not None else 3, cfg,
                           f"--parties {opts.parties}" if opts.parties is not None else "the default")
    missing = [t for t in cfg.schedule.tasks if t not in held]
    if missing:
        hint = "; with --data, leave the schedule unset to derive it from the data's tasks" if opts.data else ""
        raise ConfigError(f"config key 'schedule.phases': task(s) {', '.join(missing)} are held by no "
                          f"party (tasks available: {', '.join(sorted(held))}){hint}")
    from distmoe.privacy.plan import plan_privacy

    plan_privacy(cfg.privacy, cfg.schedule)  # the budget must cover the schedule's releases (ConfigError)
    if derived is not None and opts.echo:
        print(f"distmoe simulate: schedule derived from the tasks in --data ({', '.join(sorted(held))}; name "
              f"order, set it with --schedule): {schedule_text(cfg.schedule)}", flush=True)
    for note in notes if opts.echo else ():  # a data warning is long: lines of at most 100 columns
        print("\n".join(wrap(f"distmoe simulate: {note}", 100)),
              file=sys.stderr if note.startswith("warning") else sys.stdout, flush=True)
    existed = run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        parties = _populate(opts, cfg, run_dir, parties, overrides, run_id)
    except BaseException:  # a failed start (a config error, a signal) leaves no half-made run directory
        _remove_run_dir(run_dir, existed)
        raise
    return run_dir, parties, overrides


def _remove_run_dir(run_dir: Path, keep_dir: bool = False) -> None:
    """Remove a run directory this start made (only its contents if it existed, empty, before)."""
    if keep_dir:
        for child in run_dir.iterdir():
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
    else:
        shutil.rmtree(run_dir, ignore_errors=True)


def _populate(opts: SimOptions, cfg, run_dir: Path, parties: list[Path] | None, overrides: dict,
              run_id: str) -> list[Path]:
    """The data (synthetic unless given), work and node directories and ``overrides.toml`` of a new run."""
    from distmoe.data.synth import synth_tasks, write_synthetic

    files = RunDir(run_dir)
    old_umask = os.umask(PRIVATE_UMASK)  # party files and directories are private from their creation
    try:
        files.work.mkdir(mode=PRIVATE_DIR, exist_ok=True)
        if parties is None:
            n = opts.parties if opts.parties is not None else 3
            # party-side files live under work/ (the audit checks that nothing outside it holds party data)
            parties = write_synthetic(files.synth_data, n, cfg.data.synth_examples, cfg.run.seed, canaries=1,
                                      tasks=synth_tasks(cfg.schedule.tasks))
            make_private(files.work)  # whatever the writers' own modes were
        for p in parties:
            files.party(p.name).root.mkdir(mode=PRIVATE_DIR, exist_ok=True)
    finally:
        os.umask(old_umask)
    nodes = files.nodes
    nodes.mkdir(exist_ok=True)
    for i, p in enumerate(parties):
        name = p.name
        files.node_file(i).write_text(
            f'data-path = "{p.resolve()}"\nparty-name = "{name}"\nwork-dir = "{files.party(name).root}"\n'
            # the Simulation Engine keeps each party's process, and its loaded base, across messages: no mapped copy
            'base-cache = "off"\n')
    overrides["run.dir"] = str(run_dir)
    overrides["sim.nodes-dir"] = str(nodes)
    overrides.setdefault("run.name", run_id)
    overrides.setdefault("federation.min-available", len(parties))
    if int(overrides["federation.min-available"]) > len(parties):
        raise ConfigError(f"config key 'federation.min-available': value {overrides['federation.min-available']} "
                          f"exceeds the number of parties ({len(parties)})")
    parse_run_config(overrides)
    files.overrides().write_text(to_toml(overrides))
    return parties


def prepare_resume(opts: SimOptions) -> tuple[Path, list[Path], dict]:
    """The interrupted run's directory, party directories and overrides (+ new ones, + ``run.resume``),
    after checking that it may resume; nothing is written before the checks pass."""
    import tomllib

    run_dir = Path(opts.resume).resolve()
    given = [flag for flag, v in (("--parties", opts.parties), ("--data", opts.data), ("--run-id", opts.run_id))
             if v is not None]
    if given:
        raise SimulationError(f"--resume {opts.resume}: {', '.join(given)} come from the run being resumed")
    if not run_dir.is_dir():
        raise SimulationError(f"--resume {opts.resume}: no such run directory")
    files = RunDir(run_dir)
    ov_path = files.overrides()
    if not ov_path.is_file():
        raise SimulationError(f"--resume {opts.resume}: {ov_path} not found: not a `distmoe simulate` run directory")
    try:
        overrides = load_override_file(ov_path)
    except ConfigError as exc:
        raise SimulationError(f"--resume {opts.resume}: {exc}") from None
    overrides = {**overrides, **opts.overrides, "run.resume": str(run_dir), "run.dir": str(run_dir)}
    cfg = parse_run_config(overrides)
    _check_tensorboard(cfg, opts)
    from distmoe.coordinator import RunFailed, check_resumable

    try:
        check_resumable(run_dir, cfg)
    except RunFailed as exc:
        raise SimulationError(f"--resume {opts.resume}: {exc}") from None
    node_files = files.node_files()
    if not node_files:
        raise SimulationError(f"--resume {opts.resume}: no node files in {files.nodes}")
    parties = []
    for nf in node_files:
        try:
            parties.append(Path(tomllib.loads(nf.read_text())["data-path"]))
        except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
            raise SimulationError(f"--resume {opts.resume}: node file {nf} is unreadable: {exc}") from None
    files.overrides(resume=True).write_text(to_toml(overrides))
    return run_dir, parties, overrides


def party_dirs(run_dir: Path, parties: list[Path]) -> dict[str, list[Path]]:
    """Each party's private directories: its data (copy) and its work directory."""
    return {p.name: [p, RunDir(run_dir).party(p.name).root] for p in parties}


def privacy_check(run_dir: Path, parties: list[Path], when: str) -> None:
    """The pre-run / end-of-run privacy check (``distmoe.wire.at_rest``) as a :class:`SimulationError`."""
    try:
        privacy_preflight(party_dirs(run_dir, parties), when=when)
    except PreflightError as exc:
        raise SimulationError(str(exc)) from None
