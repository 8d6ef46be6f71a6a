"""An in-process transport for tests and benchmarks: every instruction and reply goes through the
same path as on Flower (server guard -> codec records, packed as Flower carries them (``wire.packing``) ->
``party_guard.serve`` with the party service, its outbound guard and ledger -> packed -> server guard), but the
parties run in this process.

Not a replacement for Flower's engines (the integration tests use those); it exists so that the
coordinator's schedule, the secure aggregation and the fault cases can be tested in seconds. Faults
are injected with ``down`` (nodes that never answer), ``drop(message_type, node) -> bool`` (a node
that does not answer one stage: a dropout at that stage, before it did the work), ``late(message_type,
node) -> bool`` (a straggler: the party does the work and its state moves on, but its reply arrives after
the stage's timeout, so the server never sees it) and ``tamper(node, message_type, content)`` (what a
client that bypasses its own guard could send instead). Error replies carry the same codes as the
ClientApp's (``distmoe.wire.errors.ErrorCode``).

Must not: be used for a real federation (the parties share this process and its memory).
"""

from __future__ import annotations

from collections.abc import Callable

from distmoe.config import NodeConfig, RunConfig
from distmoe.party.service import PartyService
from distmoe.wire import codec
from distmoe.wire.errors import ErrorCode, Refused, reason_text
from distmoe.wire.packing import pack
from distmoe.wire.party_guard import serve
from distmoe.wire.server_guard import ExchangeMemo, GuardedTransport


class LocalTransport(GuardedTransport):
    def __init__(self, cfg: RunConfig, nodes: dict[int, NodeConfig], run_id: str = "local"):
        self.cfg = cfg
        self.nodes = nodes
        self.run_id = str(run_id)
        self.down: set[int] = set()
        self.drop: Callable[[str, int], bool] | None = None
        self.late: Callable[[str, int], bool] | None = None
        # (node, message type, reply record dict) -> what a guard-bypassing client sends instead
        self.tamper: Callable[[int, str, object], object] | None = None
        self.sent: dict[str, int] = {}  # message type -> messages delivered (for tests)
        self.timeouts: dict[str, float] = {}  # message type -> the timeout its last exchange was given

    def node_ids(self) -> list[int]:
        return sorted(self.nodes)

    def _send(self, out: dict[int, tuple[str, object]], timeout: float, memo: ExchangeMemo | None = None
              ) -> dict[int, object]:
        got: dict[int, object] = {}  # node -> the reply's Flower record dict, an ErrorReply, or a reason
        # packed as ``codec.instruction_content`` does on Flower, with the exchange's memo (a shared record once)
        for node, (mtype, content) in out.items():
            self.timeouts[mtype] = timeout
            if node in self.down:
                got[node] = "no reply (node down)"
                continue
            if self.drop is not None and self.drop(mtype, node):
                got[node] = f"no reply (dropped out at {mtype})"
                continue
            self.sent[mtype] = self.sent.get(mtype, 0) + 1
            try:
                reply = serve(mtype, pack(content, memo), PartyService(self.cfg, self.nodes[node], node, self.run_id),
                              self.run_id)
            except Refused as exc:
                got[node] = codec.ErrorReply(str(exc), int(exc.code))
                continue
            except Exception:  # as the ClientApp does: an error reply without text, the round goes on
                got[node] = codec.ErrorReply(reason_text(ErrorCode.INTERNAL), int(ErrorCode.INTERNAL))
                continue
            if self.late is not None and self.late(mtype, node):
                got[node] = f"no reply within {timeout:.0f} s (straggler at {mtype}: its reply came too late)"
                continue
            reply = self.tamper(node, mtype, reply) if self.tamper is not None else reply
            got[node] = reply if isinstance(reply, (str, codec.ErrorReply)) else pack(reply)  # as on Flower: packed
        return got
