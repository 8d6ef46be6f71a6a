"""What each ``distmoe`` subcommand does, as a function of its parsed arguments (``cmd_<name>``).

Every user error (a config key, a data file and line, a missing directory) is raised (``ConfigError``,
``DataError``) or printed as one ``error: ...`` line with exit status 2; a failed run exits with 1.

Must not: hold logic of its own beyond calling the library and printing what it returns; parse arguments
(``distmoe.cli.parser``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from distmoe.config import (
    ConfigError,
    continual_schedule,
    load_override_file,
    parse_kv_pairs,
    parse_run_config,
    schedule_text,
    to_toml,
)
from distmoe.data.formats import DataError
from distmoe.rundir import RunDir
from distmoe.wire.at_rest import PRIVATE_UMASK, make_private


def _overrides(args) -> dict:
    out: dict = {}
    if getattr(args, "config", None):
        out.update(load_override_file(args.config))
    for text in getattr(args, "run_config", None) or []:
        out.update(parse_kv_pairs(text))
    if getattr(args, "rounds", None) is not None:
        out["schedule.sft-rounds"] = args.rounds
    if getattr(args, "schedule", None):
        out["schedule.phases"] = schedule_option(args.schedule)
    return out


def schedule_option(text: str) -> str:
    """``--schedule``: phases in the ``schedule.phases`` grammar (``sft:a, eval, ...``), or, with no ``:``, an
    order of tasks (``train,support``) that becomes the continual schedule over them (``continual_schedule``)."""
    if ":" in text:
        return text
    return continual_schedule([t.strip() for t in text.replace("->", ",").split(",") if t.strip()])


def cmd_simulate(args) -> int:
    from distmoe.simulate import SimOptions, run

    overrides = _overrides(args)
    if args.parties is not None and args.parties < 1:
        raise ConfigError(f"--parties: value {args.parties} must be >= 1")
    opts = SimOptions(overrides=overrides, parties=args.parties,
                      data=Path(args.data) if args.data else None, run_id=args.run_id,
                      runs_dir=Path(args.runs_dir), port=args.port, timeout=args.timeout,
                      report=not args.no_report, resume=Path(args.resume) if args.resume else None)
    code, _ = run(opts)
    return code


def cmd_report(args) -> int:
    from distmoe.report.report import write_report

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"error: {run_dir}: no such run directory", file=sys.stderr)
        return 2
    if not RunDir(run_dir).metrics.exists():
        print(f"error: {run_dir}: no {RunDir(run_dir).metrics.name} (not a distmoe run directory?)", file=sys.stderr)
        return 2
    if args.tensorboard:
        from distmoe.report.tensorboard import TensorBoardMissing, require

        try:
            require()  # before anything is written
        except TensorBoardMissing as exc:
            print(f"error: --tensorboard: {exc}", file=sys.stderr)
            return 2
    print(write_report(run_dir))
    if args.tensorboard:
        from distmoe.report.tensorboard import write_tensorboard

        out = write_tensorboard(run_dir)
        print(out)
        print(f"view: tensorboard --logdir {out}", file=sys.stderr)
    return 0


def cmd_audit(args) -> int:
    from distmoe.audit import cli_audit

    return cli_audit(args.run_dir, party_ledgers=args.party_ledger, canaries=args.canaries, as_json=args.json,
                     out=args.out, receipts=args.receipt)


def cmd_export(args) -> int:
    from distmoe.export import ExportError, export_run

    try:
        out = export_run(args.run_dir, round_num=args.round, out=args.out, model_path=args.model_path or "",
                         drop_routing_bias=args.drop_routing_bias)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


def cmd_rollback(args) -> int:
    from distmoe.checkpoint import CheckpointError, copy_checkpoint, kept_rounds, rollback_point

    run = Path(args.run_dir)
    try:
        if args.round is None:
            rounds = kept_rounds(RunDir(run).checkpoints)
            if not rounds:
                raise CheckpointError(f"{run}: no checkpoints")
            for n, path, why in rounds:
                print(f"round {n}: {path}" + (f"  [{why}]" if why else ""))
            return 0
        path = rollback_point(run, args.round)
        if args.out:
            path = copy_checkpoint(path, Path(args.out))
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"run.init-from={path.resolve()}")
    print(f"# start a new run from it: distmoe simulate --run-config \"run.init-from={path.resolve()}\" ...",
          file=sys.stderr)
    return 0


def cmd_base_build(args) -> int:
    from distmoe.train.warmup import BaseError, build_base

    cfg = parse_run_config(_overrides(args))
    steps = args.steps or cfg.model.warmup_steps
    if not steps:
        raise ConfigError("distmoe base build: give --steps N or model.warmup-steps")
    try:
        path = build_base(cfg, steps, Path(args.cache or cfg.model.warmup_cache or "base-cache"),
                          log=lambda t: print(t, file=sys.stderr))
    except BaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"run.init-from={path.resolve()}")
    return 0


def cmd_data_synth(args) -> int:
    from distmoe.data.synth import TASK_FAMILIES, write_synthetic

    cfg = parse_run_config({})
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip()) if args.tasks else TASK_FAMILIES
    old = os.umask(PRIVATE_UMASK)  # each party's data is private to its owner (simulate refuses it otherwise)
    try:
        dirs = write_synthetic(Path(args.out), args.parties, args.examples or cfg.data.synth_examples,
                               args.seed, overwrite=args.force, canaries=args.canaries, tasks=tasks)
    finally:
        os.umask(old)
    for d in dirs:
        make_private(d)
        print(d)
    return 0


def cmd_data_validate(args) -> int:
    """Every problem of every party directory at once, with the same file-mode check a run makes before it
    starts, and the length warnings (``distmoe.simulate.datacheck``); exit 2 when anything must be fixed."""
    from distmoe.report.progress import wrap
    from distmoe.simulate.datacheck import check_parties, derived_max_new_tokens, party_dirs_of, tokenizer_for

    cfg = parse_run_config(_overrides(args))
    root = Path(args.dir)
    if not root.is_dir():
        raise DataError(f"{root}: {'not a directory' if root.exists() else 'no such directory'}")
    dirs = party_dirs_of(root)  # a party directory itself, or a directory of them
    report = check_parties(dirs, cfg, names=dirs != [root])
    for name, party in report.parties.items():
        counts = ", ".join(f"{t}: {len(party.train(t))} train / {len(party.heldout(t))} held-out"
                           for t in party.tasks)
        where = next(d for d in dirs if d.name == name)
        clean = not any(str(where) in e for e in report.errors)
        print(f"{where}: {'ok' if clean else 'lines valid, see the problems below'} ({counts})")
    notes = [f"warning: {w}" for w in report.warnings]
    if report.parties and "eval.max-new-tokens" not in _overrides(args):  # what `simulate --data` would use
        n = derived_max_new_tokens(tokenizer_for(cfg), report.parties, cfg.model.max_seq_len)
        if n != cfg.eval.max_new_tokens:
            notes.append(f"note: eval.max-new-tokens is not set: `distmoe simulate --data` sets it to {n} (the "
                         f"longest answer, in tokens); a deployment uses the run config's value "
                         f"({cfg.eval.max_new_tokens})")
    for note in notes:  # lines of at most 100 columns
        print("\n".join(wrap(note, 100)), file=sys.stderr)
    if report.errors:
        n = len(report.errors)
        print(f"error: {n} problem{'s' if n > 1 else ''}:\n  " + "\n  ".join(report.errors), file=sys.stderr)
        return 2
    return 0


def _privacy_lines(cfg) -> list[str]:
    from distmoe.privacy.plan import plan_privacy

    p, plan = cfg.privacy, plan_privacy(cfg.privacy, cfg.schedule)
    if not p.secure:
        return ["# privacy: PLAINTEXT baseline: no secure aggregation, no DP (the audit fails such a run)"]
    z = (f"z = {plan.noise_multiplier:.4f} (derived from privacy.epsilon)" if plan.derived
         else f"z = {plan.noise_multiplier:g} (privacy.noise-multiplier)")
    out = [f"# privacy: secure aggregation of every reply; router statistics {z} over {plan.stats_releases} "
           f"release(s)",
           f"# privacy: planned epsilon {plan.planned_epsilon:.4f} (max of PRV, RDP) <= budget privacy.epsilon = "
           f"{p.epsilon:g} at delta = {p.delta:g}, per party, unit = one sequence"]
    if plan.update_releases:
        out.append(f"# privacy: client-level DP on {plan.update_releases} update release(s) at z = "
                   f"{plan.update_noise_multiplier:g}")
    if plan.eval_releases:
        out.append(f"# privacy: evaluation figures with distributed DP on {plan.eval_releases} release(s) at z_m = "
                   f"{plan.metric_noise_multiplier:g}; uniform FedAvg weights; training metrics only as "
                   "bounded slots of the update's secure sum")
    return out


def cmd_config_show(args) -> int:
    from distmoe.privacy.plan import plan_privacy

    cfg = parse_run_config(_overrides(args))
    flat = cfg.as_flat()
    if args.json:
        print(json.dumps({**flat, "derived": {"privacy": plan_privacy(cfg.privacy, cfg.schedule).as_dict(),
                                              "rounds": cfg.schedule.total_rounds}}, indent=2, sort_keys=True))
    else:
        print(to_toml(flat), end="")
        print(f"\n# derived: {len(cfg.schedule.phases)} phases, {cfg.schedule.total_rounds} rounds: "
              + schedule_text(cfg.schedule).rsplit(" (", 1)[0])
        print("\n".join(_privacy_lines(cfg)))
    return 0


def cmd_config_validate(args) -> int:
    from distmoe.privacy.plan import plan_privacy

    cfg = parse_run_config(load_override_file(args.file))
    plan_privacy(cfg.privacy, cfg.schedule)  # the budget must cover the planned releases
    print(f"{args.file}: ok")
    print("\n".join(_privacy_lines(cfg)))
    return 0


def cmd_config_sync(args) -> int:
    from distmoe.config_sync import SYNC_COMMAND, sync

    changed = sync(Path(args.root), write=not args.check)
    for rel in changed:
        print(f"{rel}: {'out of date (run: ' + SYNC_COMMAND + ')' if args.check else 'rewritten'}")
    if not changed:
        print("pyproject.toml and docs/configuration.md match distmoe/config/")
    return 1 if (args.check and changed) else 0
