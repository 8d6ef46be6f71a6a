"""What the coordinator needs from a transport: the connected nodes and one guarded exchange.

Owns: the ``Transport`` protocol. Implementations: the Flower Grid transport (``server/app.py``) and the
in-process one (``distmoe.inprocess``), both on ``distmoe.wire.server_guard.GuardedTransport``, so every
instruction and reply passes the server guard and is written to the coordinator's ledger.

Must not: import ``flwr``.
"""

from __future__ import annotations

from typing import Protocol


class Transport(Protocol):
    def node_ids(self) -> list[int]:
        """The nodes connected now."""
        ...

    def exchange(self, instructions: dict[int, object], expected: type, timeout: float, *, rnd: int | None = None,
                 phase: str = "", lengths: dict[int, int] | None = None
                 ) -> tuple[dict[int, object], dict[int, str]]:
        """Send one instruction per node; return (checked payloads by node, error reasons by node)."""
        ...

    def attach(self, guard) -> None:
        """Give the transport the server guard (``distmoe.wire.server_guard.ServerGuard``)."""
        ...
