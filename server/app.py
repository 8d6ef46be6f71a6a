"""distmoe ServerApp: drives the configured schedule (``distmoe.coordinator.Coordinator``) over
Flower's ``Grid`` with its own round loop (``send_and_receive`` with a timeout) rather than a
stock strategy, since a round carries several records and phases of different kinds.

``run.resume = "<run dir>"`` continues an interrupted run in that directory (new Flower run id, same
logical run: ``distmoe.coordinator``), e.g. ``flwr run . <federation> --run-config "run.resume='runs/42'"``.

Must not: load party data or build records by hand (only ``distmoe.wire.codec`` does).
"""

from __future__ import annotations

import logging
from pathlib import Path

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.exit import add_exit_handler

from distmoe.config import parse_run_config
from distmoe.coordinator import Coordinator
from distmoe.wire import codec
from distmoe.wire.server_guard import GuardedTransport

app = ServerApp()


class GridTransport(GuardedTransport):
    """The coordinator's transport over the Flower Grid: one message per node, one reply each; every
    instruction and reply passes the server guard (``GuardedTransport.exchange``)."""

    def __init__(self, grid: Grid):
        self.grid = grid

    def node_ids(self) -> list[int]:
        return sorted(self.grid.get_node_ids())

    def _send(self, out, timeout: float):
        msgs = [codec.instruction_content(content, node, mtype) for node, (mtype, content) in out.items()]
        got = {}
        for msg in self.grid.send_and_receive(msgs, timeout=timeout):
            node = msg.metadata.src_node_id
            if node not in out or node in got:
                continue  # a reply from a node that was not asked, or a second reply: ignored
            got[node] = (codec.ErrorReply(str(msg.error.reason), int(msg.error.code)) if msg.has_error()
                         else msg.content)
        return got


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = parse_run_config(context.run_config)
    run_id = str(context.run_id)
    if cfg.run.resume:  # continue an interrupted run there (docs/operations.md, Resume)
        run_dir = Path(cfg.run.resume)
    else:
        run_dir = Path(cfg.run.dir) if cfg.run.dir else Path("runs") / run_id
    coord = Coordinator(cfg, run_dir, GridTransport(grid), run_id, log=lambda s: log(logging.INFO, s))
    # SIGTERM/SIGINT/SIGQUIT reach Flower's handler in the process's main thread (the Simulation Engine runs this
    # function in a worker thread, where no signal arrives): close the ledger as interrupted before Flower exits.
    add_exit_handler(lambda: coord.interrupt("stopped by a signal (Flower's graceful exit)"),
                     run_before_force_exit=True)
    coord.run()
