"""distmoe ServerApp: drives the configured schedule (``distmoe.coordinator.Coordinator``) over
Flower's ``Grid`` with its own round loop (``send_and_receive`` with a timeout) rather than a
stock strategy, since a round carries several records and phases of different kinds.

Must not: load party data or build records by hand (only ``distmoe.wire.codec`` does).
"""

from __future__ import annotations

import logging
from pathlib import Path

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from distmoe.config import parse_run_config
from distmoe.coordinator import Coordinator
from distmoe.wire import codec

app = ServerApp()


class GridTransport:
    """The coordinator's transport over the Flower Grid: one message per node, one reply each."""

    def __init__(self, grid: Grid):
        self.grid = grid

    def node_ids(self) -> list[int]:
        return sorted(self.grid.get_node_ids())

    def exchange(self, instructions: dict[int, object], expected: type, timeout: float
                 ) -> tuple[dict[int, object], dict[int, str]]:
        msgs = [codec.instruction(payload, node) for node, payload in instructions.items()]
        replies: dict[int, object] = {}
        errors: dict[int, str] = {}
        for msg in self.grid.send_and_receive(msgs, timeout=timeout):
            node = msg.metadata.src_node_id
            try:
                _, payload = codec.read_reply(msg, expected)
                replies[node] = payload
            except codec.WireError as exc:
                errors[node] = str(exc)
        for node in instructions:
            if node not in replies and node not in errors:
                errors[node] = f"no reply within {timeout:.0f} s (federation.round-timeout)"
        return replies, errors


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = parse_run_config(context.run_config)
    run_id = str(context.run_id)
    run_dir = Path(cfg.run.dir) if cfg.run.dir else Path("runs") / run_id
    coord = Coordinator(cfg, run_dir, GridTransport(grid), run_id, log=lambda s: log(logging.INFO, s))
    coord.run()
