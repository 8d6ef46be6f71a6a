"""The ``distmoe`` command: ``simulate | report | audit | export | rollback | base | credentials | deploy | data |
config``.

Every user error (a config key, a data file and line, a missing directory) is printed as one
``error: ...`` line and exits with status 2; a failed run exits with 1. Output piped into a reader that
closes early (``distmoe config show | head``) ends quietly: no ``BrokenPipeError`` traceback, exit status
141 (128 + SIGPIPE, what a shell reports for a command cut off by its pipe).

Parts: ``parser`` (the arguments, the help and examples of every subcommand) and ``commands`` (what each
subcommand does); this module is the entry point.

Must not: hold logic of its own beyond argument parsing (it calls the library).
"""

from __future__ import annotations

import json
import os
import sys

from distmoe.cli.commands import schedule_option
from distmoe.cli.parser import EXAMPLES, build_parser
from distmoe.config import ConfigError
from distmoe.data.formats import DataError

__all__ = ["EXAMPLES", "EPIPE_STATUS", "build_parser", "main", "schedule_option"]

EPIPE_STATUS = 141  # 128 + SIGPIPE


def _quiet_broken_pipe() -> int:
    """stdout's reader went away: point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return EPIPE_STATUS


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # the usage of the (sub)command it was given to, not the top-level one
            args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:
        if exc.code == 2 and argv[:1] == ["audit"] and "--json" in argv:  # `audit --json`: JSON on every path
            print(json.dumps({"error": "usage error (see stderr)", "passed": False, "exit_status": 2}))
        raise
    try:
        code = int(args.fn(args) or 0)
        sys.stdout.flush()  # a reader that closed early shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except (ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP during simulate's start (distmoe.simulate.Stopped)
        print(f"interrupted{f' by {exc.args[0]}' if exc.args else ''}", file=sys.stderr)
        return int(getattr(exc, "exit_status", 130))
    except Exception as exc:
        from distmoe.simulate import SimulationError

        if isinstance(exc, SimulationError):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        raise
