"""Flower's own SecAgg+ (flwr 1.42) as the peer row of ``bench/secagg.py``: one fit round of
``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))`` with the legacy FedAvg (the only way SecAgg+ runs in
1.42: it has no Message-API strategy), the clients a legacy ``ClientApp`` with
``secaggplus_mod``, against the same workflow with the default (plaintext) fit workflow, in one process.

    python bench/flower_secaggplus.py [--parties 3 5 10] [--length 7121683] [--repeats 1]

The Grid is ``DirectGrid``: Flower's ``Grid`` interface served in this process, as Flower's in-process
Simulation Engine would, minus Ray: each message is serialised with Flower's own protobuf serde (its size
is the bytes figure), deserialised, handed to that node's ``ClientApp`` with the node's own persistent
``Context`` (``secaggplus_mod`` keeps its state there between stages), and the reply travels back the
same way. The nodes answer one after another (as distmoe's in-process rows). What each client "trains":
nothing; it returns a fixed float32 vector of ``length`` parameters (a [length] update), so the figures are
the protocol's cost alone (Flower's round minus the plaintext round is the comparable "extra s").

Must not: be imported by the library (bench only); start Ray or any process.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections import defaultdict
from uuid import uuid4

import flwr.compat.common.recorddict_compat as compat
import numpy as np
from flwr.app import Context, Message, RecordDict
from flwr.client import NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.common.logger import FLOWER_LOGGER as flwr_logger
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.server import LegacyContext, ServerConfig
from flwr.server.strategy import FedAvg as LegacyFedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_PARAMS_RECORD
from flwr.server.workflow.default_workflows import default_fit_workflow
from flwr.serverapp.grid import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

MB = 1e6


class _Client(NumPyClient):
    """Returns a fixed [length] float32 update (seeded per node), weight 1."""

    def __init__(self, update: np.ndarray):
        self.update = update

    def get_parameters(self, config):
        return [np.zeros_like(self.update)]

    def fit(self, parameters, config):
        return [self.update], 1, {}


def _client_fn(update: np.ndarray):
    def client_fn(context: Context):
        return _Client(update).to_client()
    return client_fn


class DirectGrid(Grid):
    """Flower's Grid interface in this process: every message through Flower's protobuf serde and the
    destination node's ``ClientApp``; bytes counted per node and direction."""

    def __init__(self, apps: dict[int, ClientApp], contexts: dict[int, Context], run_id: int = 1):
        self.apps, self.contexts = apps, contexts
        self._run = Run.create_empty(run_id)
        self.down: dict[int, int] = defaultdict(int)  # node -> bytes sent to it
        self.up: dict[int, int] = defaultdict(int)  # node -> bytes it sent
        self.messages = 0
        self._replies: dict[str, Message] = {}  # message id -> its reply, until pulled

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self):
        return list(self.apps)

    def push_messages(self, messages):
        """Deliver each message to its node's ClientApp now (through the serde both ways); its reply waits for
        ``pull_messages``. Returns the message ids."""
        ids = []
        for msg in messages:
            md = msg.metadata.__dict__
            md["_message_id"] = uuid4().hex
            md["_src_node_id"] = SUPERLINK_NODE_ID
            md["_run_id"] = self._run.run_id
            node = msg.metadata.dst_node_id
            inbound, nbytes = self._wire(msg)
            self.down[node] += nbytes
            reply = self.apps[node](inbound, self.contexts[node])
            reply.metadata.__dict__["_message_id"] = uuid4().hex
            back, nbytes = self._wire(reply)
            self.up[node] += nbytes
            self.messages += 1
            self._replies[md["_message_id"]] = back
            ids.append(md["_message_id"])
        return ids

    def pull_messages(self, message_ids):
        """The replies to ``message_ids`` that are ready (all of them: delivery is synchronous), each once."""
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def _wire(self, msg: Message) -> tuple[Message, int]:
        blob = message_to_proto(msg).SerializeToString()
        return message_from_proto(_proto_cls().FromString(blob)), len(blob)

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))

def _proto_cls():
    from flwr.proto.message_pb2 import Message as ProtoMessage  # pylint: disable=no-name-in-module

    return ProtoMessage


def flower_round(n: int, length: int, secure: bool, seed: int = 0) -> dict:
    """One fit round of n clients over a [length] float32 vector; -> wall s, bytes per party up/down, max error."""
    flwr_logger.setLevel(logging.WARNING)
    rng = np.random.default_rng(seed)
    updates = {100 + i: (rng.standard_normal(length, dtype=np.float32) * 0.01) for i in range(n)}
    apps = {nd: ClientApp(client_fn=_client_fn(u), mods=[secaggplus_mod] if secure else None)
            for nd, u in updates.items()}
    contexts = {nd: Context(run_id=1, node_id=nd, node_config={}, state=RecordDict(), run_config={})
                for nd in updates}
    # as Flower's ServerApp process sets them (``Message`` reads them)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1
    grid = DirectGrid(apps, contexts)
    strategy = LegacyFedAvg(fraction_fit=1.0, min_fit_clients=n, min_available_clients=n, fraction_evaluate=0.0,
                            initial_parameters=ndarrays_to_parameters([np.zeros(length, np.float32)]))
    server_ctx = Context(run_id=1, node_id=SUPERLINK_NODE_ID, node_config={}, state=RecordDict(), run_config={})
    lctx = LegacyContext(context=server_ctx, config=ServerConfig(num_rounds=1), strategy=strategy)
    fit = (SecAggPlusWorkflow(num_shares=n, reconstruction_threshold=max(2, n // 2 + 1), max_weight=1.0,
                              timeout=600.0) if secure else default_fit_workflow)
    timed: dict[str, float] = {}

    def timed_fit(g, ctx):  # the fit round alone (DefaultWorkflow also waits on its client-manager thread)
        t = time.perf_counter()
        fit(g, ctx)
        timed["fit"] = time.perf_counter() - t

    DefaultWorkflow(fit_workflow=timed_fit)(grid, lctx)
    wall = timed["fit"]
    got = _aggregate_of(lctx)
    expect = np.mean(np.stack(list(updates.values())), axis=0)
    what = f"Flower {'SecAgg+' if secure else 'plaintext'} round with {n} clients"
    if got is None or got.shape != expect.shape:
        raise RuntimeError(f"{what}: no aggregate")
    err = float(np.max(np.abs(got - expect)))
    if not err < 1e-4:  # SecAgg+ quantisation: step 2 * clipping_range / quantization_range = 3.8e-6 per client
        raise RuntimeError(f"{what}: aggregate off by {err:.2e}")
    return {"wall_s": wall, "up": sum(grid.up.values()) / n, "down": sum(grid.down.values()) / n,
            "messages": grid.messages, "max_err": err}


def _aggregate_of(lctx: LegacyContext):
    """The round's aggregate: the parameters the default workflow stored in the server context."""
    rec = lctx.state.array_records.get(MAIN_PARAMS_RECORD)
    if rec is None:
        return None
    return parameters_to_ndarrays(compat.arrayrecord_to_parameters(rec, keep_input=True))[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parties", type=int, nargs="+", default=[3, 5, 10])
    ap.add_argument("--length", type=int, default=7_121_683)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    flwr_logger.setLevel(logging.WARNING)
    print("| parties | Flower plain s | Flower SecAgg+ s | ratio | extra s | up plain | up SecAgg+ | down plain "
          "| down SecAgg+ | max abs error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in args.parties:
        p = [flower_round(n, args.length, False, r) for r in range(args.repeats)]
        s = [flower_round(n, args.length, True, r) for r in range(args.repeats)]

        def med(rs, k):
            return statistics.median(r[k] for r in rs)
        print(f"| {n} | {med(p, 'wall_s'):.2f} | {med(s, 'wall_s'):.2f} | {med(s, 'wall_s') / med(p, 'wall_s'):.2f}x "
              f"| {med(s, 'wall_s') - med(p, 'wall_s'):.2f} | {med(p, 'up') / MB:.2f} MB | {med(s, 'up') / MB:.2f} MB "
              f"| {med(p, 'down') / MB:.2f} MB | {med(s, 'down') / MB:.2f} MB | {med(s, 'max_err'):.1e} |", flush=True)


if __name__ == "__main__":
    main()
