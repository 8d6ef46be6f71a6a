"""Waiting for a deployed run to end: ``distmoe deploy wait RUN_DIR`` (the coordinator's step after ``flwr run``).

``flwr run --stream`` is no wait for the run in flwr 1.42: the CLI prints the SuperLink's log stream and, when that
stream ends without a transport error, returns 0 as if every log had been retrieved (``flwr/cli/log.py``:
``stream_logs`` raises ``AllLogsRetrieved`` after any end of the stream); it never asks for the run's status. The
SuperLink ends the stream when the run's task is finished or when the response's stream context is cancelled
(``superlink/servicer/control/control_handlers.py`` ``_stream_logs``, ``while is_active()``;
``supercore/protobuf/streaming.py`` cancels it on any ``http.disconnect`` the response receives and in its final
cleanup), so a stream cut short on a loaded SuperLink looks like a finished run. Without ``--stream`` the CLI returns
at once. The run's own record says when it ended: the coordinator writes ``run.json`` with ``"status": "running"``
when it starts and ``completed``, ``failed`` or ``interrupted`` (with the error) when it ends, and only then is the
run directory complete for ``distmoe report`` and ``distmoe audit``.

:func:`wait_for_run` polls that record: exit status 0 when the run completed, 1 when it ended otherwise (with the
``run.resume`` command that continues it), 124 when
``timeout`` passed first (the run may still be going, or its ServerApp was killed before it could write its end:
``flwr ls`` then shows Flower's view).

Must not: start, stop or change a run, or talk to the SuperLink.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from distmoe.rundir.layout import RUN_RECORD

RUNNING = "running"
TIMED_OUT = 124  # the exit status of timeout(1)
RESUME_HINT = ("once the cause is fixed, the run continues from its last checkpoint: flwr run <app> <connection> "
               "with the run's own run config and run.resume = '{run_dir}' added (docs/operations.md, Resume)")
NO_RECORD_HINT_S = 60.0  # the ServerApp writes run.json within seconds of its start: say so once after this long


def run_status(run_dir: Path) -> tuple[str | None, str | None]:
    """``(status, error)`` of the run record in ``run_dir``; ``(None, None)`` while it is missing or being written."""
    try:
        rec = json.loads((run_dir / RUN_RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        return None, None
    if not isinstance(rec, dict):
        return None, None
    status, error = rec.get("status"), rec.get("error")
    return (str(status) if status is not None else None), (str(error) if error else None)


def wait_for_run(run_dir: Path, timeout: float | None = None, poll: float = 2.0,
                 say: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> int:
    """Wait until ``run_dir/run.json`` leaves ``running``; the exit status (module docstring)."""
    if poll <= 0:
        raise ValueError(f"--poll: value {poll} must be > 0")
    if timeout is not None and timeout < 0:
        raise ValueError(f"--timeout: value {timeout} must be >= 0")
    start = clock()
    say(f"waiting for {run_dir / RUN_RECORD} to say the run ended"
        + (f" (at most {timeout:.0f} s)" if timeout is not None else ""))
    seen, hinted = None, False
    while True:
        status, error = run_status(run_dir)
        if status is not None and status != RUNNING:
            waited = clock() - start
            say(f"run {run_dir}: {status} (after {waited:.0f} s of waiting)" + (f": {error}" if error else ""))
            if status != "completed":
                say(RESUME_HINT.format(run_dir=run_dir))
            return 0 if status == "completed" else 1
        if status != seen and status is not None:
            say(f"run {run_dir}: {status}")
            seen = status
        if status is None and not hinted and clock() - start >= NO_RECORD_HINT_S:  # a wrong RUN_DIR waits forever
            hinted = True
            say(f"still no {run_dir / RUN_RECORD} after {NO_RECORD_HINT_S:.0f} s: is {run_dir} the run's run.dir "
                "(the path in the run config)? 'flwr ls <connection>' shows whether the run started; still waiting")
        if timeout is not None and clock() - start >= timeout:
            say(f"run {run_dir}: still {status or 'not started (no ' + RUN_RECORD + ')'} after {timeout:.0f} s; "
                "'flwr ls <connection>' shows Flower's view of the run")
            return TIMED_OUT
        sleep(poll)
