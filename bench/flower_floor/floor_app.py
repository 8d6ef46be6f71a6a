"""Flower's own floor for a deployed round: a plain Flower 1.42 app that moves distmoe's messages and does nothing else.

``bench/deploy_round.py`` runs it on the same deployment as distmoe's arm (the TLS SuperLink with SuperNode
authentication, three SuperNodes on the same machine) and replays, stage by stage, the messages distmoe's ServerApp
pushed in its own run of the same schedule: the plan (``plan``, a JSON file written by ``bench/deploy_arms.py`` from
the ``DISTMOE_DEPLOY_SHAPES`` record of ``bench/deploy_trace/sitecustomize.py``) lists each stage's messages, one per
node, and each message's reply. A message here has the records of distmoe's packed message: the same names, the
same arrays with the same byte lengths (random bytes; an array that was the same in several of a stage's messages,
the global weights, is the same here too, so Flower moves it once, as for distmoe) and config records of the same
serialized size. The ClientApp answers at once with the reply the plan gives for its message (same records and
sizes). So a stage here costs exactly Flower's transport of distmoe's messages and Flower's per-message ClientApp
process, without any work of distmoe's: the floor that no change inside distmoe can go below.

``cut = false``: Flower as it ships (``Grid.send_and_receive``: a pull every 3 s; Flower's content back-offs).
``cut = true``: the ServerApp pulls every 0.1 s with distmoe's content back-off (as ``server/app.py``); the
SuperNodes and ClientApps then run with distmoe's cuts too (``bench/deploy_arms.py`` starts them).

The ServerApp appends one JSON line per stage (``{"stage", "type", "start", "end", "replies"}``, wall clock) and a last
``{"event": "end"}`` to ``log``.

Must not: be imported by distmoe (benchmark only).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.superlink.grid import http_grid

server = ServerApp()
client = ClientApp()
SPEC = "floor_reply"  # the config key that carries the reply's shape to the ClientApp
POLL_S = 0.1  # seconds between pulls with the cuts (server/app.py's REPLY_POLL_S)


def _bytes(n: int, digest: str, salt: str) -> bytes:
    """``n`` random bytes, the same for the same (digest, salt): equal arrays stay equal, across runs they differ."""
    seed = int(hashlib.sha256(f"{salt}:{digest}".encode()).hexdigest()[:32], 16)
    return np.random.default_rng(seed).bytes(n)


def _sized_config(size: int, extra: dict) -> ConfigRecord:
    """A ConfigRecord holding ``extra`` and padding, whose serialized size is ``size`` (or just above)."""
    pad = 0
    for _ in range(3):
        rec = ConfigRecord({**extra, "pad": b"\0" * pad})
        got = len(rec.deflate())
        if got >= size:
            return rec
        pad += size - got
    return rec


def build(shape: list, salt: str, extra: dict | None = None) -> RecordDict:
    """The records of ``shape`` (``[[name, "array", [[key, bytes, digest], ...]] | [name, kind, bytes], ...]``);
    ``extra`` goes into the first config record (one is added when the shape has none)."""
    records: dict = {}
    extra = dict(extra or {})
    for name, kind, detail in shape:
        if kind == "array":
            records[name] = ArrayRecord({key: Array(dtype="uint8", shape=(n,), stype="numpy.ndarray",
                                                    data=_bytes(n, digest, salt)) for key, n, digest in detail})
        elif kind == "metric":
            records[name] = MetricRecord({f"m{i}": 0.0 for i in range(max(1, int(detail) // 16))})
        else:
            records[name] = _sized_config(int(detail), extra)
            extra = {}
    if extra:
        records["floor"] = ConfigRecord(extra)
    return RecordDict(records)


@server.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    plan = json.loads(open(str(rc["plan"])).read())
    cut, timeout, salt = bool(rc["cut"]), float(rc["timeout"]), str(context.run_id)
    if cut:  # distmoe's back-off for content not yet at the SuperLink (server/app.py)
        http_grid.pull_objects = functools.partial(http_grid.pull_objects, initial_backoff=0.05, backoff_cap=0.5)
    want = int(rc["nodes"])
    deadline = time.monotonic() + timeout
    while len(nodes := sorted(grid.get_node_ids())) < want and time.monotonic() < deadline:
        time.sleep(0.5)
    with open(str(rc["log"]), "a") as log:
        for i, stage in enumerate(plan["stages"]):
            msgs = []
            for node, shape, reply in zip(nodes, stage["messages"], stage["replies"], strict=False):
                content = build(shape, salt, {SPEC: json.dumps(reply)})
                msgs.append(Message(content=content, dst_node_id=node, message_type="query"))
            t0 = time.time()
            if cut:
                waiting, got = set(grid.push_messages(msgs)), 0
                end = time.monotonic() + timeout
                while waiting and time.monotonic() < end:
                    pulled = list(grid.pull_messages(waiting))
                    got += len(pulled)
                    waiting -= {m.metadata.reply_to_message_id for m in pulled}
                    if waiting:
                        time.sleep(POLL_S)
            else:
                got = len(list(grid.send_and_receive(msgs, timeout=timeout)))
            log.write(json.dumps({"stage": i, "type": stage["type"], "start": t0, "end": time.time(),
                                  "messages": len(msgs), "replies": got}) + "\n")
            log.flush()
        log.write(json.dumps({"event": "end", "time": time.time()}) + "\n")


@client.query()
def reply(msg: Message, context: Context) -> Message:
    spec = None
    for rec in msg.content.config_records.values():
        if SPEC in rec:
            spec = json.loads(str(rec[SPEC]))
    content = build(spec, f"{context.run_id}:{context.node_id}") if spec else RecordDict()
    return Message(content=content, reply_to=msg)
