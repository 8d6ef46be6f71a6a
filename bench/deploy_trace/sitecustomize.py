"""Timestamps of each deployed message's path in every Flower process of ``bench/deploy_round.py --trace``.

Python imports ``sitecustomize`` at start-up from ``sys.path``; ``bench/deploy_round.py --trace`` puts this directory
on the ``PYTHONPATH`` of every process it starts (SuperLink, ServerApp, SuperNodes, SuperExecs, the ClientApp
launchers and the warm workers inherit it) and names a log file in ``DISTMOE_DEPLOY_TRACE``. Without that variable
this module does nothing. With it, an import hook wraps a few functions of Flower 1.42 and of the owner's launchers
as their modules load, and each wrapper appends one JSON line (wall-clock time, pid, event, message id) to the log.
``bench/deploy_trace/breakdown.py`` turns the log into the per-stage table of ``docs/results.md``.

Each event also carries the process's CPU seconds so far (user + system; a forked child's count from its fork), so
that ``breakdown.py`` can give the CPU a ClientApp process and its launcher spend per message, a figure the
machine's load moves far less than the wall-clock steps.

The path it times: ServerApp ``HttpGrid.push_messages`` -> SuperNode ``receive`` (the message's metadata) and its
``pull_objects`` (the content) -> SuperExec ``launch`` -> launcher process start -> the warm worker's forked child
(``clients.pinned.main``) -> ClientApp ``pull_task_input`` -> ``ClientApp.__call__`` (the party's work) ->
``push_message`` -> SuperNode ``send`` (it noticed the reply) and the reply's objects pushed -> ServerApp
``pull_messages`` returning the reply.

With ``DISTMOE_DEPLOY_SHAPES`` naming a file (``bench/deploy_round.py`` sets it for distmoe's deployed arm), the
ServerApp's ``push_messages`` and ``pull_messages`` also append the records of each message they move: per record its
name and kind, per array its key, byte length and a digest of its bytes, per other record its serialized size
(``{"ev": "push", "type", "mids", "shapes"}``, ``{"ev": "reply", "reply_to", "shape"}``). ``bench/deploy_arms.py``
turns that into the plan of Flower's own floor (``bench/flower_floor/``): the same messages, moved by a plain app.

Must not: change what any wrapped function does or returns, or run at all without ``DISTMOE_DEPLOY_TRACE`` or
``DISTMOE_DEPLOY_SHAPES``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.abc
import json
import os
import sys
import time

LOG = os.environ.get("DISTMOE_DEPLOY_TRACE")
SHAPES = os.environ.get("DISTMOE_DEPLOY_SHAPES")
_NODE: list[str] = []  # this process's SuperNode, as its Runtime API port (set where an argument names it)


def _arg(args, flag):
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if isinstance(a, str) and a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _node_of(args) -> str | None:
    addr = _arg(args, "--runtime-api-address") or _arg(args, "--clientappio-api-address")
    if addr:
        return addr.rsplit(":", 1)[-1]
    port = _arg(args, "--port")
    return port


def _append(path: str, rec: dict) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(rec, default=str) + "\n").encode())
    finally:
        os.close(fd)


def shape_of(msg) -> list:
    """``[[name, "array", [[key, bytes, digest], ...]] | [name, "config" | "metric", serialized bytes], ...]``."""
    from flwr.app import ArrayRecord, MetricRecord

    out = []
    for name, rec in msg.content.items():
        if isinstance(rec, ArrayRecord):
            out.append([name, "array", [[key, len(a.data), hashlib.sha256(a.data).hexdigest()[:16]]
                                        for key, a in rec.items()]])
        else:
            out.append([name, "metric" if isinstance(rec, MetricRecord) else "config", len(rec.deflate())])
    return out


def emit(event: str, **detail) -> None:
    if not LOG:
        return
    cpu = os.times()  # this process's user + system CPU seconds (a forked child's count from its fork)
    rec = {"t": time.time(), "pid": os.getpid(), "ev": event, "proc": os.path.basename(sys.argv[0] if sys.argv else ""),
           "cpu": round(cpu.user + cpu.system, 3), **({"node": _NODE[-1]} if _NODE else {}), **detail}
    _append(LOG, rec)


def _started() -> float | None:
    """This process's start (exec) time from ``/proc``, 10 ms resolution."""
    try:
        ticks = int(open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[19])
        btime = next(int(ln.split()[1]) for ln in open("/proc/stat") if ln.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _around(name: str, fn, *, begin: bool = True, info=None):
    """``fn`` with ``name.begin`` / ``name.end`` events (``info(result)`` adds detail to the end event)."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        if begin:
            emit(name + ".begin")
        try:
            out = fn(*a, **kw)
        except BaseException as exc:
            emit(name + ".end", error=type(exc).__name__)
            raise
        emit(name + ".end", **(info(out) if info else {}))
        return out

    return wrapper


# ------------------------------------------------------------------------------------------- the patches
def _inflatable(m):
    orig = m.pull_objects

    @functools.wraps(orig)
    def pull_objects(object_ids, pull_object_fn, **kw):
        stats = {"calls": 0, "unavailable": 0}

        def fn(oid):
            stats["calls"] += 1
            try:
                return pull_object_fn(oid)
            except m.ObjectUnavailableError:
                stats["unavailable"] += 1
                raise

        t0 = time.time()
        try:
            return orig(object_ids, fn, **kw)
        finally:
            emit("pull_objects", t0=t0, objects=len(object_ids), backoff=kw.get("initial_backoff", 1), **stats)

    m.pull_objects = pull_objects


def _http_grid(m):
    grid = m.HttpGrid
    push, pull = grid.push_messages, grid.pull_messages

    def push_messages(self, messages):
        messages = list(messages)
        shapes = [shape_of(msg) for msg in messages] if SHAPES else None
        emit("srv.push.begin", n=len(messages), type=messages[0].metadata.message_type if messages else "")
        ids = list(push(self, messages))
        emit("srv.push.end", mids=ids, dst=[msg.metadata.dst_node_id for msg in messages])
        if SHAPES:
            _append(SHAPES, {"ev": "push", "t": time.time(), "type": messages[0].metadata.message_type if messages
                             else "", "mids": ids, "shapes": shapes})
        return ids

    def pull_messages(self, message_ids):
        t0 = time.time()
        out = list(pull(self, message_ids))
        if out:
            emit("srv.pull", t0=t0, got=[[r.metadata.reply_to_message_id, r.metadata.src_node_id] for r in out])
        for r in out if SHAPES else ():
            _append(SHAPES, {"ev": "reply", "t": time.time(), "reply_to": r.metadata.reply_to_message_id,
                             "shape": None if r.has_error() else shape_of(r)})
        return out

    grid.push_messages, grid.pull_messages = push_messages, pull_messages


def _supernode_loop(m):
    pull_store, push = m._pull_and_store_message, m._push_messages

    def _pull_and_store_message(**kw):
        recv = kw["receive"]

        def receive():
            got = recv()
            if got is not None:
                md = got[0].metadata
                emit("sn.recv", mid=md.message_id, type=md.message_type, group=md.group_id)
            return got

        kw["receive"] = receive
        out = pull_store(**kw)
        emit("sn.stored", ok=out is not None) if out is not None else None
        return out

    def _push_messages(**kw):
        send = kw["send"]

        def send_traced(message, *a):
            emit("sn.send.begin", reply_to=message.metadata.reply_to_message_id)
            return send(message, *a)

        kw["send"] = send_traced
        out = push(**kw)
        emit("sn.push.end")
        return out

    m._pull_and_store_message, m._push_messages = _pull_and_store_message, _push_messages


def _subprocess_executor(m):
    launch = m.SubprocessExecutor.launch

    def traced(self, spec):
        _NODE[:] = [str(spec.runtime_api_address).rsplit(":", 1)[-1]]
        emit("sx.launch")
        return launch(self, spec)

    m.SubprocessExecutor.launch = traced


def _run_clientapp(m):
    m.pull_task_input = _around("ca.pull", m.pull_task_input,
                                info=lambda out: {"mid": out[0].metadata.message_id,
                                                  "type": out[0].metadata.message_type})
    m.install_from_fab = _around("ca.install", m.install_from_fab)
    m.push_message = _around("ca.push", m.push_message)
    m.push_task_output = _around("ca.output", m.push_task_output)
    exit_ = m.flwr_exit

    def flwr_exit(*a, **kw):
        emit("ca.exit")
        return exit_(*a, **kw)

    m.flwr_exit = flwr_exit


def _client_app(m):
    m.ClientApp.__call__ = _around("ca.call", m.ClientApp.__call__)


def _pinned(m):
    main = m.main

    def traced_main(argv=None):  # the ClientApp process proper: the warm worker's forked child, or a cold process
        _NODE[:] = [_node_of(sys.argv if argv is None else argv) or "?"]
        emit("wc.child")
        return main(argv)

    m.main = traced_main


PATCHES = {
    "flwr.supercore.inflatable.inflatable_utils": _inflatable,
    "flwr.superlink.grid.http_grid": _http_grid,
    "flwr.supernode.start_client_internal": _supernode_loop,
    "flwr.supercore.superexec.executor.subprocess_executor": _subprocess_executor,
    "flwr.supernode.runtime.run_clientapp": _run_clientapp,
    "flwr.clientapp.client_app": _client_app,
    "clients.pinned": _pinned,
}


SHAPES_PATCH = "flwr.superlink.grid.http_grid"  # the only module patched with DISTMOE_DEPLOY_SHAPES alone


class _Hook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of a patched module so the patch runs right after the module's code."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES or (not LOG and name != SHAPES_PATCH):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def patched(module, _exec=exec_module, _name=name):
                    _exec(module)
                    try:
                        PATCHES[_name](module)
                    except Exception as exc:  # a Flower that moved a traced function: say so, run untraced
                        emit("trace.patch-failed", module=_name, error=repr(exc))

                spec.loader.exec_module = patched
                return spec
        return None


if LOG:
    _NODE[:] = [n] if (n := _node_of(sys.argv)) else []
    # the ClientApp launcher (``python -m clients.warm`` or ``clients.pinned``, run as __main__, so not hooked):
    # started by the SuperExec with the message's token
    emit("proc.start", started=_started(), argv=" ".join(sys.argv[:3])[:200],
         launcher="--token" in sys.argv and "--code-pin" in sys.argv)
    if "--token" in sys.argv and "--code-pin" in sys.argv:  # the launcher's own CPU, when it exits (as it does)
        import atexit

        atexit.register(emit, "proc.exit", launcher=True)
if LOG or SHAPES:
    sys.meta_path.insert(0, _Hook())
