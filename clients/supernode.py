"""The data owner's ``flower-supernode`` with a short idle poll (``distmoe deploy supernode --code-pin``).

flwr 1.42's SuperNode asks the SuperLink for a message and, when there is none, sleeps a fixed 3 s
(``supernode/start_client_internal.py``: ``time.sleep(3)``; no option or environment variable sets it),
and checks for its ClientApp's reply every 0.5 s. Each message stage of a round therefore waits on
average 1.5 s before the SuperNode even fetches its message; a round of three stages loses about 5 s to
this sleep alone. This launcher runs Flower's own ``flower-supernode`` entry point unchanged, with that
module's sleeps capped at ``IDLE_POLL_S``: the SuperNode then asks for work 5 times a second (one small
authenticated request each; the SuperLink answers it from its state database). Everything else (TLS,
node authentication, the SuperExec, the ClientApp processes) is Flower's. With ``--code-pin FILE`` first it
also starts the SuperNode's warm ClientApp worker (:mod:`clients.warm`) before Flower's code runs, so the
first message finds it ready.

Must not: change anything of Flower's but those sleeps, or import anything of an app bundle.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

IDLE_POLL_S = 0.2  # seconds, the most the SuperNode sleeps between asks (flwr's own: 3 s idle, 0.5 s for a reply)


class CappedClock:
    """``time`` for Flower's SuperNode loop: every function as it is, ``sleep`` capped at ``cap`` seconds."""

    def __init__(self, cap: float):
        self.cap = cap

    def __getattr__(self, name: str):
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        time.sleep(min(float(seconds), self.cap))


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    pin_file = None
    if args[:1] == ["--code-pin"] and len(args) > 1:
        pin_file, args = Path(args[1]).resolve(), args[2:]
    from flwr.supercore.address import resolve_bind_address
    from flwr.supernode import start_client_internal
    from flwr.supernode.cli.flower_supernode import flower_supernode

    from clients import warm

    host, port = warm.arg_value(args, "--host"), warm.arg_value(args, "--port")
    if pin_file is not None and host and port:  # the warm worker imports while the SuperNode connects
        warm.prestart(pin_file, resolve_bind_address(f"{host}:{port}"))
    start_client_internal.time = CappedClock(IDLE_POLL_S)
    sys.argv = ["flower-supernode", *args]
    flower_supernode()


if __name__ == "__main__":
    main()
