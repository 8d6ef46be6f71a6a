"""distmoe ClientApp: one handler per phase and protocol stage, all through one entry point.

Every message goes to ``distmoe.wire.party_side.serve``, which logs it in the party's ledger, runs the
party's own work (``distmoe.train.party``) or secure-aggregation stage (``distmoe.privacy.session``),
and passes the reply through the outbound guard; this module only wraps exactly that record dict
into the reply message. A refusal or failure becomes an error reply whose reason names what went
wrong (bad data file and line, config key, model mismatch, a blocked reply, the privacy budget), so
the server logs it and the round goes on without this party. Nothing is kept in process memory
between messages (per-run state lives in the party's work directory).
"""

from __future__ import annotations

import traceback

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from distmoe.config import ConfigError, parse_node_config, parse_run_config
from distmoe.wire import codec
from distmoe.wire.party_side import Blocked, Refused, serve

app = ClientApp()


def _handle(msg: Message, context: Context) -> Message:
    mtype = codec.message_type(msg)
    try:
        cfg = parse_run_config(context.run_config)
        node = parse_node_config(context.node_config, cfg.sim)
        out = serve(mtype, msg.content, cfg, node, msg.metadata.dst_node_id, str(context.run_id))
        return codec.reply_content(out, msg)
    except Blocked as exc:
        print(f"distmoe client: {mtype}: {exc}", flush=True)
        return codec.error_reply(msg, 3, str(exc))
    except (Refused, ConfigError) as exc:
        print(f"distmoe client: {mtype} refused: {exc}", flush=True)
        return codec.error_reply(msg, 1, f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # a bug or a resource problem: report it, never hang the round
        print(f"distmoe client: {mtype} crashed:\n{traceback.format_exc()}", flush=True)
        return codec.error_reply(msg, 2, f"{type(exc).__name__}: {exc}")


@app.train("sft")
def sft(msg: Message, context: Context) -> Message:
    return _handle(msg, context)


@app.train("rl")
def rl(msg: Message, context: Context) -> Message:
    return _handle(msg, context)


@app.train("stats")
def stats(msg: Message, context: Context) -> Message:
    return _handle(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _handle(msg, context)


@app.query("setup")
def setup(msg: Message, context: Context) -> Message:
    return _handle(msg, context)


@app.query("directory")
def directory(msg: Message, context: Context) -> Message:
    return _handle(msg, context)


@app.query("unmask")
def unmask(msg: Message, context: Context) -> Message:
    return _handle(msg, context)
