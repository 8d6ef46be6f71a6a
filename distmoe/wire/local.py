"""An in-process transport for tests and benchmarks: every instruction and reply still goes
through the codec (encode -> Flower RecordDict -> decode), but the parties run in this process.

Not a replacement for Flower's engines (the integration tests use those); it exists so that the
coordinator's schedule can be tested in seconds.
"""

from __future__ import annotations

from distmoe.config import NodeConfig, RunConfig
from distmoe.train.party import run_eval, run_rl, run_sft, run_stats
from distmoe.wire import codec
from distmoe.wire.schema import EvalInstruction, RlInstruction, SftInstruction, StatsInstruction

_FN = {SftInstruction: run_sft, RlInstruction: run_rl, StatsInstruction: run_stats, EvalInstruction: run_eval}


class LocalTransport:
    def __init__(self, cfg: RunConfig, nodes: dict[int, NodeConfig]):
        self.cfg = cfg
        self.nodes = nodes
        self.down: set[int] = set()  # nodes that do not answer (tests of dropouts)

    def node_ids(self) -> list[int]:
        return sorted(self.nodes)

    def exchange(self, instructions: dict[int, object], expected: type, timeout: float):
        replies, errors = {}, {}
        for node, payload in instructions.items():
            if node in self.down:
                errors[node] = "no reply (node down)"
                continue
            # Flower Messages need a live run; the records (what actually crosses) are exercised here
            instr = codec.decode(codec.encode(payload), type(payload))
            try:
                out = _FN[type(instr)](self.cfg, self.nodes[node], instr)
                rec = codec.encode(out)
                replies[node] = codec.decode(rec, expected)
            except Exception as exc:  # as the ClientApp does: an error reply, the round goes on
                errors[node] = f"{type(exc).__name__}: {exc}"
        return replies, errors
