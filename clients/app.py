"""distmoe ClientApp: one handler per phase; each decodes the instruction, runs the party's own
work through ``distmoe.train.party`` and encodes the reply with the wire codec.

A failure becomes an error reply whose reason names what went wrong (bad data file and line,
config key, model mismatch), so the server logs it and the round goes on without this party.
Nothing is kept in process memory between messages.
"""

from __future__ import annotations

import traceback

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from distmoe.config import ConfigError, parse_node_config, parse_run_config
from distmoe.data.formats import DataError
from distmoe.model.build import ModelError
from distmoe.model.trainable import TrainableError
from distmoe.train.party import PartyError, run_eval, run_rl, run_sft, run_stats
from distmoe.wire import codec
from distmoe.wire.schema import EvalInstruction, RlInstruction, SftInstruction, StatsInstruction

app = ClientApp()

_EXPECTED = {"sft": (SftInstruction, run_sft), "rl": (RlInstruction, run_rl),
             "stats": (StatsInstruction, run_stats),
             "eval": (EvalInstruction, run_eval)}
_KNOWN = (ConfigError, DataError, ModelError, TrainableError, PartyError, codec.WireError)


def _handle(kind: str, msg: Message, context: Context) -> Message:
    expected, fn = _EXPECTED[kind]
    try:
        cfg = parse_run_config(context.run_config)
        node = parse_node_config(context.node_config, cfg.sim)
        instr = codec.read_instruction(msg, expected)
        return codec.reply(fn(cfg, node, instr), msg)
    except _KNOWN as exc:
        print(f"distmoe client: {kind} failed: {exc}", flush=True)
        return codec.error_reply(msg, 1, f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # a bug or a resource problem: report it, never hang the round
        print(f"distmoe client: {kind} crashed:\n{traceback.format_exc()}", flush=True)
        return codec.error_reply(msg, 2, f"{type(exc).__name__}: {exc}")


@app.train("sft")
def sft(msg: Message, context: Context) -> Message:
    return _handle("sft", msg, context)


@app.train("rl")
def rl(msg: Message, context: Context) -> Message:
    return _handle("rl", msg, context)


@app.train("stats")
def stats(msg: Message, context: Context) -> Message:
    return _handle("stats", msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _handle("eval", msg, context)
