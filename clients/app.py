"""distmoe ClientApp: one handler per phase and protocol stage, all through one entry point.

Every message goes to ``distmoe.wire.party_guard.serve`` with the party service
(``distmoe.party.service.PartyService``): the instruction is logged in the party's ledger, the party's
own work or secure-aggregation stage runs, and the reply passes the outbound guard; this module only
wraps exactly that record dict into the reply message. A refusal or failure becomes an error reply
carrying a fixed reason code of the closed table (``distmoe.wire.errors.REASONS``: data, config, model,
budget, blocked, ...) and nothing else; what went wrong in detail (bad data file and line, config key,
a count of the party's examples) goes to the party's own log (``<work-dir>/party.log``), so the server
logs the code and the round goes on without this party. Nothing is kept in process memory between
messages (per-run state lives in the party's work directory).

Must not: do any of the party's work itself, or send text that did not pass the party guard.
"""

from __future__ import annotations

import dataclasses

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from distmoe.config import ConfigError, SimConfig, parse_node_config, parse_run_config, parse_section
from distmoe.party.service import PartyService, load_canaries
from distmoe.party.session import open_ledger
from distmoe.wire import codec
from distmoe.wire.errors import ErrorCode, Refused, reason_text
from distmoe.wire.party_guard import failure_log, guarded_error, phase_of, serve

app = ClientApp()


def _handle(msg: Message, context: Context) -> Message:
    mtype = codec.message_type(msg)
    node = None
    try:
        node = parse_node_config(context.node_config, parse_section(context.run_config, SimConfig))
        if "partition-id" not in context.node_config:  # a real SuperNode: its stdout is the owner's own log
            node = dataclasses.replace(node, progress_stdout=True)
        cfg = parse_run_config(context.run_config)
        party = PartyService(cfg, node, msg.metadata.dst_node_id, str(context.run_id))
        return codec.reply_content(serve(mtype, msg.content, party, str(context.run_id)), msg)
    except Refused as exc:  # the code's fixed text with the ledger head (the detail went to the party log)
        return codec.error_reply(msg, int(exc.code), str(exc))
    except ConfigError as exc:  # before serve: a run config this party rejects, or a bad node config
        if node is None:  # no node config, so no ledger or party log: only the code's text leaves (unanchored)
            print(f"distmoe client: {mtype}: node configuration error: {exc}", flush=True)
            return codec.error_reply(msg, int(ErrorCode.CONFIG), reason_text(ErrorCode.CONFIG))
        try:
            text = guarded_error(open_ledger(node), load_canaries(node), str(context.run_id), None, phase_of(mtype),
                                 ErrorCode.CONFIG, f"ConfigError: {exc}")
        except Exception as exc2:  # no party log: stdout gets no exception message (it may quote data)
            print(failure_log("client", mtype, exc2) + " (configuration error, could not log it)", flush=True)
            text = reason_text(ErrorCode.CONFIG)
        return codec.error_reply(msg, int(ErrorCode.CONFIG), text)
    except Exception as exc:  # outside the guard (a bug): no ledger entry, so only the code's text leaves (unanchored)
        print(failure_log("client", mtype, exc) + " (outside the party guard)", flush=True)
        return codec.error_reply(msg, int(ErrorCode.INTERNAL), reason_text(ErrorCode.INTERNAL))


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


@app.query("consistency")
def consistency(msg: Message, context: Context) -> Message:
    return _handle(msg, context)


@app.query("unmask")
def unmask(msg: Message, context: Context) -> Message:
    return _handle(msg, context)


@app.query("probe")
def probe(msg: Message, context: Context) -> Message:
    return _handle(msg, context)


@app.query("settle")
def settle(msg: Message, context: Context) -> Message:
    return _handle(msg, context)
