"""The ``distmoe`` argument parser: every subcommand, its options with their defaults, and its examples.

Must not: do the work of a command (``distmoe.cli.commands``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from distmoe.cli.commands import (
    cmd_audit,
    cmd_base_build,
    cmd_config_show,
    cmd_config_sync,
    cmd_config_validate,
    cmd_data_synth,
    cmd_data_validate,
    cmd_export,
    cmd_report,
    cmd_rollback,
    cmd_simulate,
)

EXAMPLES: dict[str, tuple[str, ...]] = {  # `distmoe <command> --help` ends with these (a test checks every one)
    "simulate": ("distmoe simulate --parties 3 --rounds 2",
                 "distmoe simulate --data my-data/          # DIR/<party>/<task>.jsonl; schedule from its tasks",
                 "distmoe simulate --data my-data/ --schedule train,support",
                 "distmoe simulate --config configs/continual.toml --run-id continual-s0",
                 "distmoe simulate --resume runs/continual-s0"),
    "report": ("distmoe report runs/continual-s0      # writes runs/continual-s0/report/report.md",),
    "audit": ("distmoe audit runs/continual-s0",
              "distmoe audit runs/continual-s0 --json --canaries my-data/party-0/canaries.txt"),
    "export": ("distmoe export runs/continual-s0 --round 12 --out exported/",),
    "plan": ("distmoe plan --model qwen3-30b-a3b --device h100",
             "distmoe plan --model ckpt-olmoe --batch 4 --seq 512 --dtype bfloat16 --gradient-checkpointing"),
    "rollback": ("distmoe rollback runs/continual-s0              # list the kept rounds",
                 "distmoe rollback runs/continual-s0 --round 6 --out starts/before-arith",
                 "distmoe simulate --run-config \"run.init-from=starts/before-arith\""),
    "base": ("distmoe base build --steps 600 --cache base-cache",),
    "base build": ("distmoe base build --steps 600 --cache base-cache --run-config 'run.seed=1'",),
    "data": ("distmoe data synth --out my-data --parties 3", "distmoe data validate my-data"),
    "data synth": ("distmoe data synth --out my-data --parties 3 --examples 120",),
    "data validate": ("distmoe data validate my-data            # every party directory under it",
                      "distmoe data validate my-data/party-0    # one party directory"),
    "config": ("distmoe config show --config configs/continual.toml", "distmoe config validate configs/rl.toml"),
    "config show": ("distmoe config show --run-config 'schedule.sft-rounds=2' --json",),
    "config validate": ("distmoe config validate configs/continual.toml",),
    "config sync": ("distmoe config sync --check",),
    "credentials": ("distmoe credentials --out ~/distmoe-creds --owner-keys hospital-a.public.json,"
                    "hospital-b.public.json --san superlink.example.org",
                    "distmoe credentials --out /tmp/creds --parties a,b,c     # development only"),
    "deploy": ("distmoe deploy superlink --credentials ~/distmoe-creds --host 0.0.0.0",
               "distmoe deploy supernode --credentials ~/distmoe/hospital-a --superlink superlink.example.org:9092 "
               "--data-path /data/hospital-a"),
    "deploy superlink": ("distmoe deploy superlink --credentials ~/distmoe-creds --host 0.0.0.0 --port 9092",),
    "deploy supernode": ("distmoe deploy supernode --credentials ~/distmoe/hospital-a --superlink "
                         "superlink.example.org:9092 --data-path /data/hospital-a --code-pin ~/distmoe/pin",),
    "deploy owner-keys": ("distmoe deploy owner-keys --party hospital-a --out ~/distmoe/hospital-a",),
    "deploy pin": ("distmoe deploy pin --out ~/distmoe/pin",),
    "deploy register": ("distmoe deploy register --credentials ~/distmoe-creds --connection distmoe --exec",),
    "deploy connection": ("distmoe deploy connection --credentials ~/distmoe-creds --address "
                          "superlink.example.org:9092 --write",),
    "deploy wait": ("distmoe deploy wait ~/distmoe-coordinator/runs/exp1",
                    "distmoe deploy wait ~/distmoe-coordinator/runs/exp1 --timeout 3600"),
}

AUDIT_EXIT = """exit status:
  0  every check passed and every party witnessed the run (its ledger or its receipt was given)
  1  a check failed (the summary and RUN_DIR/audit/audit.md say which)
  2  unusable input: no such run directory, an unreadable ledger, record or receipt, or a usage error
  3  unverified: no check failed, but a party gave neither its ledger nor its receipt (never a pass)
with --json, stdout is one JSON object on every path: the audit, or {"error": ..., "exit_status": 2}"""


def _version() -> str:
    """The installed distribution's version (the one pip reports), else the source tree's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("distmoe")
    except PackageNotFoundError:
        return "0.1.0 (source tree)"


class _Help(argparse.RawDescriptionHelpFormatter):
    """Descriptions and examples as written; each option's default appended unless its help states one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.default in (None, False, argparse.SUPPRESS)
                or isinstance(action.default, list)):
            return text
        return text + " (default: %(default)s)"


def _finish(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> None:
    """Every (sub)command: the help formatter, a description (its one-line help when it has none), its
    examples as the epilog, and ``_parser`` (the deepest parser, whose usage an unknown option prints)."""
    parser.formatter_class = _Help
    parser.set_defaults(_parser=parser)
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {a.dest: a.help for a in action._choices_actions}
        for name, sp in action.choices.items():
            full = path + (name,)
            if not sp.description:
                sp.description = helps.get(name)
            lines = EXAMPLES.get(" ".join(full), ())
            examples = ("example" + ("s" if len(lines) > 1 else "") + ":\n  " + "\n  ".join(lines)) if lines else ""
            sp.epilog = "\n\n".join(x for x in (sp.epilog, examples) if x)
            _finish(sp, full)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="distmoe", description="Privacy-preserving federated instruction tuning of "
                                "Mixture-of-Experts models on Flower:\nsimulate a run, report and audit it, deploy it.",
                                epilog="examples:\n  distmoe simulate                 # 3 parties, synthetic tasks\n"
                                       "  distmoe simulate --data my-data/ # your own DIR/<party>/<task>.jsonl\n\n"
                                       "run 'distmoe <command> --help' for a command's options and an example")
    p.add_argument("--version", action="version", version=f"distmoe {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="<command>")

    def add_cfg(sp):
        sp.add_argument("--config", metavar="FILE", help="TOML file of run-config overrides (e.g. configs/*.toml)")
        sp.add_argument("--run-config", action="append", metavar='"k=v ..."',
                        help="run-config overrides in Flower's key=value syntax (repeatable)")

    s = sub.add_parser("simulate", help="run a federated simulation on Flower's Simulation Engine",
                       description="Run a whole federated run on Flower's Simulation Engine, in runs/<id>/: "
                                   "synthetic tasks for --parties parties, or your own data with --data. With "
                                   "--data and no schedule set (--schedule, schedule.phases), the schedule is "
                                   "derived from the tasks in it: one task: sft then eval; several (name order): "
                                   "sft:<a>, eval, stats:<a>, sft:<b>, eval, ...")
    s.add_argument("--parties", type=int, help="number of parties (default 3, or one per --data subdirectory)")
    s.add_argument("--rounds", type=int, help="rounds per sft phase (schedule.sft-rounds; default 5)")
    s.add_argument("--data", metavar="DIR", help="DIR/<party>/<task>.jsonl; default: synthetic tasks")
    s.add_argument("--schedule", metavar="PHASES|TASKS",
                   help="the schedule: phases in the schedule.phases grammar ('sft:train, eval'), or an order of "
                        "tasks ('train,support'), made the continual schedule over them; overrides schedule.phases "
                        "(default: schedule.phases, or with --data the tasks in it in name order)")
    add_cfg(s)
    s.add_argument("--run-id", help="name of the run directory (default: timestamp)")
    s.add_argument("--runs-dir", default="runs", help="where run directories are created")
    s.add_argument("--port", type=int, help="local SuperLink port (default: a free port)")
    s.add_argument("--timeout", type=float, default=3600.0, help="overall time limit in seconds")
    s.add_argument("--no-report", action="store_true", help="skip the report at the end")
    s.add_argument("--resume", metavar="RUN_DIR",
                   help="continue an interrupted run from its last good checkpoint (docs/operations.md)")
    s.set_defaults(fn=cmd_simulate)

    r = sub.add_parser("report", help="write the Markdown report with plots for a run")
    r.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (runs/<id>) with its metrics.jsonl")
    r.add_argument("--tensorboard", action="store_true",
                   help="also write every aggregate metric as TensorBoard scalars under RUN_DIR/tensorboard "
                        "(needs the extra distmoe[tensorboard]; view: tensorboard --logdir RUN_DIR/tensorboard)")
    r.set_defaults(fn=cmd_report)

    a = sub.add_parser("audit", help="audit a run's privacy from its ledgers and run records", epilog=AUDIT_EXIT)
    a.add_argument("run_dir", metavar="RUN_DIR", help="the run directory to audit (runs/<id>)")
    a.add_argument("--party-ledger", action="append", metavar="PATH",
                   help="audit only this party ledger (its .pub next to it; repeatable; "
                        "default: every party ledger under the run directory's work dir)")
    a.add_argument("--receipt", action="append", metavar="FILE",
                   help="a party's signed run receipt (<work-dir>/receipts/<party>-<run>.json; repeatable): a run is "
                        "verified only with a receipt or a ledger of every party")
    a.add_argument("--canaries", metavar="FILE", help="canary strings, one per line (default: the run's)")
    a.add_argument("--json", action="store_true", help="print the audit JSON instead of the summary")
    a.add_argument("--out", metavar="DIR", help="write audit.json and audit.md here instead of RUN/audit (a data "
                   "owner's own audit, kept apart from the coordinator's; a directory outside the run)")
    a.set_defaults(fn=cmd_audit)

    e = sub.add_parser("export", help="write a run's checkpoint as a standalone Hugging Face model (adapters merged)")
    e.add_argument("run_dir", metavar="RUN_DIR", help="the run directory whose checkpoint is exported")
    e.add_argument("--round", type=int, metavar="N", help="the checkpoint of round N (default: the latest)")
    e.add_argument("--out", metavar="DIR", help="output directory (default: RUN_DIR/export/round-<n>)")
    e.add_argument("--model-path", metavar="BASE",
                   help="the base checkpoint the adapters are merged into (default: model.path of the run's config)")
    e.add_argument("--drop-routing-bias", action="store_true",
                   help="export a run trained with routing.balance = bias without its routing bias (refused "
                        "otherwise: Hugging Face model classes cannot hold it, so the exported model routes "
                        "differently)")
    e.set_defaults(fn=cmd_export)

    rb = sub.add_parser("rollback", help="name (or copy) a kept checkpoint of a run as a new run's starting point")
    rb.add_argument("run_dir", metavar="RUN", help="the run directory")
    rb.add_argument("--round", type=int, help="the round to start from (omit to list the kept rounds)")
    rb.add_argument("--out", metavar="DIR", help="copy the checkpoint to this new directory (the new run then does not "
                    "depend on RUN)")
    rb.set_defaults(fn=cmd_rollback)

    b = sub.add_parser("base", help="the warm-up base of the tiny default model")
    bsub = b.add_subparsers(dest="base_cmd", required=True, metavar="<command>")
    bb = bsub.add_parser("build", help="build (or reuse) the cached warm-up base and print its run.init-from")
    add_cfg(bb)
    bb.add_argument("--steps", type=int, help="warm-up steps (default: model.warmup-steps)")
    bb.add_argument("--cache", metavar="DIR", help="cache directory (default: model.warmup-cache, else ./base-cache)")
    bb.set_defaults(fn=cmd_base_build)

    d = sub.add_parser("data", help="party data tools")
    dsub = d.add_subparsers(dest="data_cmd", required=True, metavar="<data command>")
    ds = dsub.add_parser("synth", help="write deterministic synthetic instruction tasks for N parties")
    ds.add_argument("--out", required=True, metavar="DIR", help="where <party>/<task>.jsonl are written")
    ds.add_argument("--parties", type=int, default=3, help="number of party directories")
    ds.add_argument("--examples", type=int, help="examples per task per party (default: data.synth-examples, 240)")
    ds.add_argument("--seed", type=int, default=0, help="generator seed (same seed, same bytes)")
    ds.add_argument("--force", action="store_true", help="overwrite existing party files")
    ds.add_argument("--canaries", type=int, default=1, metavar="K",
                    help="secret canary strings planted per party, listed in <party>/canaries.txt (default 1)")
    ds.add_argument("--tasks", metavar="A,B", help="comma-separated task families (default: arith,strings,lookup; "
                                                   "also: pref, preference pairs for dpo phases)")
    ds.set_defaults(fn=cmd_data_synth)
    dv = dsub.add_parser("validate", help="validate party data (a party dir or a dir of party dirs); errors name "
                                          "file, line and field")
    dv.add_argument("dir", metavar="DIR", help="a party directory (<task>.jsonl files) or a directory of them")
    add_cfg(dv)
    dv.set_defaults(fn=cmd_data_validate)

    c = sub.add_parser("config", help="show or validate the run configuration")
    csub = c.add_subparsers(dest="config_cmd", required=True, metavar="<config command>")
    cs = csub.add_parser("show", help="print the resolved configuration, its schedule and privacy plan")
    add_cfg(cs)
    cs.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    cs.set_defaults(fn=cmd_config_show)
    cv = csub.add_parser("validate", help="validate a TOML override file")
    cv.add_argument("file", metavar="FILE", help="a TOML file of run-config overrides")
    cv.set_defaults(fn=cmd_config_validate)
    cy = csub.add_parser("sync", help="rewrite the run-config blocks of pyproject.toml and docs/configuration.md "
                                      "from the key declaration in distmoe/config/")
    cy.add_argument("--root", default=str(Path(__file__).resolve().parents[2]),
                    help="the repository root (default: the one this distmoe was imported from)")
    cy.add_argument("--check", action="store_true", help="change nothing; exit 1 when a file is out of date")
    cy.set_defaults(fn=cmd_config_sync)

    from distmoe.deploy.cli import add_parsers as add_deploy_parsers
    from distmoe.model.memory_plan import add_parser as add_plan_parser

    add_plan_parser(sub)  # distmoe plan

    add_deploy_parsers(sub)  # distmoe credentials, distmoe deploy superlink|supernode|register|connection
    _finish(p)
    return p
