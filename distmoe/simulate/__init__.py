"""``distmoe simulate``: a whole federated run on Flower's Simulation Engine, owned end to end.

Its parts, in the order a run uses them:

- ``prepare``: validates the configuration and every party's data first (with ``--data`` and no schedule
  set, it derives the schedule from the data's tasks and prints it), creates ``runs/<id>/`` with synthetic
  data when none is given and one node file per virtual SuperNode (each sees only its own party
  directory); ``--resume RUN_DIR`` continues an interrupted run in its own directory, refused before Flower
  starts when the run already completed or a key that matters changed.
- ``ports``: this run's own local SuperLink, on a port verified to be held by this run's process (two runs
  starting at once never share one).
- ``launch``: ``flwr run <app> local --stream`` with Flower's and Ray's state inside the run directory,
  progress lines once each, the outcome in ``run.json`` (``completed``, ``failed`` with the reason, or
  ``interrupted``) and the next step on the terminal.
- ``processes``: every process of the run stopped by PID (per-run token), the run-directory lock, and
  SIGINT / SIGTERM / SIGHUP as one clean stop.

Must not: import ``flwr`` (it drives the ``flwr`` command like a user would).
"""

from distmoe.simulate.launch import AF_UNIX_MAX, ProgressFilter, flower_reason, retry_command, run
from distmoe.simulate.ports import PortTaken, free_port, port_owner, start_superlink
from distmoe.simulate.prepare import (
    SimOptions,
    app_dir,
    data_schedule,
    party_dirs,
    prepare,
    prepare_resume,
    privacy_check,
)
from distmoe.simulate.processes import (
    RUN_LOCK,
    STOP_SIGNALS,
    TOKEN_ENV,
    RunLock,
    SimulationError,
    Stopped,
    _proc_start,
    processes_with_token,
    stop_processes,
)

__all__ = [
    "AF_UNIX_MAX", "RUN_LOCK", "STOP_SIGNALS", "TOKEN_ENV", "PortTaken", "ProgressFilter", "RunLock", "SimOptions",
    "SimulationError", "Stopped", "_proc_start", "app_dir", "data_schedule", "flower_reason", "free_port",
    "party_dirs", "port_owner", "prepare", "prepare_resume", "privacy_check", "processes_with_token",
    "retry_command", "run", "start_superlink", "stop_processes",
]
