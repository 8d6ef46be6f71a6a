"""Where each second of a deployed message stage goes, from the trace of ``sitecustomize.py`` in this directory.

One row per step of a message's path (ServerApp push -> SuperLink -> SuperNode -> SuperExec -> ClientApp process ->
party -> reply -> SuperNode -> SuperLink -> ServerApp), the median and the maximum over every message of one kind,
in milliseconds. A step is measured between two events in different processes on one machine (wall clock). The
``CPU:`` rows give the CPU milliseconds (user + system) the ClientApp process spent on a step, and its launcher in
all: what a message costs the machine's cores, which its load moves far less than the wall-clock steps.

    python bench/deploy_trace/breakdown.py TRACE.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

# (label, from event, to event): the names are the keys of ``path_of``
STEPS = (
    ("ServerApp pushes message + content to the SuperLink", "push0", "push1"),
    ("SuperNode has the message (its poll; from push start)", "push0", "recv"),
    ("SuperNode pulls the content from the SuperLink", "recv", "stored"),
    ("SuperExec starts the ClientApp launcher (its poll)", "recv", "launch"),
    ("launcher process up (exec, Python start-up)", "launch", "launcher"),
    ("launcher -> warm worker -> forked child runs", "launcher", "child"),
    ("child has the message's content (Runtime API pull)", "child", "pulled"),
    ("bundle check + install + app load", "pulled", "call0"),
    ("party's work (ClientApp.__call__)", "call0", "call1"),
    ("child pushes the reply to the SuperNode", "call1", "pushed"),
    ("SuperNode notices the reply (its poll)", "pushed", "send"),
    ("SuperNode pushes the reply to the SuperLink", "send", "sent"),
    ("ServerApp has the reply (its poll + pull)", "sent", "got"),
    ("one message, push start to reply at the ServerApp", "push0", "got"),
    ("the stage: push start to its last reply", "push0", "stage"),
)


# (label, from, to) of CPU seconds in one process: the ClientApp process (a forked child counts from its fork,
# a cold one from its start) and its launcher (``proc.exit``: from its start)
CPU_STEPS = (
    ("CPU: ClientApp process up to its message's content", None, "pulled"),
    ("CPU: bundle check + install + app load", "pulled", "call0"),
    ("CPU: party's work (ClientApp.__call__)", "call0", "call1"),
    ("CPU: reply pushed and the process's exit", "call1", "exit"),
    ("CPU: the ClientApp process, in all", None, "exit"),
    ("CPU: its launcher process, in all", None, "launcher"),
)


def _cpu(p: dict, key: str, event: dict) -> None:
    if "cpu" in event:
        p.setdefault("cpu", {})[key] = event["cpu"]


def load(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a killed process
    return sorted(out, key=lambda e: e["t"])


def _first(events, after: float, **match) -> dict | None:
    for e in events:
        if e["t"] >= after and all(e.get(k) == v for k, v in match.items()):
            return e
    return None


def paths(events: list[dict]) -> list[dict]:
    """One dict per instruction message: its type and the time of each event of its path (missing ones left out)."""
    out = []
    begins = [e for e in events if e["ev"] == "srv.push.begin"]
    for end in (e for e in events if e["ev"] == "srv.push.end"):
        begin = max((b for b in begins if b["pid"] == end["pid"] and b["t"] <= end["t"]), key=lambda b: b["t"])
        stage_got = []
        for mid in end.get("mids", []):
            p = {"mid": mid, "push0": begin["t"], "push1": end["t"]}
            recv = _first(events, begin["t"], ev="sn.recv", mid=mid)
            if recv is not None:
                p["type"], p["recv"], node, sn = recv["type"], recv["t"], recv.get("node"), recv["pid"]
                if (e := _first(events, recv["t"], ev="sn.stored", pid=sn)) is not None:
                    p["stored"] = e["t"]
                if (e := _first(events, recv["t"], ev="pull_objects", pid=sn)) is not None:
                    p["sn_unavailable"] = e.get("unavailable", 0)
                if (e := _first(events, recv["t"], ev="sx.launch", node=node)) is not None:
                    p["launch"] = e["t"]
                if (e := _first(events, p.get("launch", recv["t"]), ev="proc.start", node=node, launcher=True)):
                    p["launcher"] = e["t"]
                if (e := _first(events, p.get("launcher", recv["t"]), ev="wc.child", node=node)) is not None:
                    p["child"] = e["t"]
            pulled = _first(events, begin["t"], ev="ca.pull.end", mid=mid)
            if pulled is not None:
                p["pulled"], ca = pulled["t"], pulled["pid"]
                for key, ev in (("call0", "ca.call.begin"), ("call1", "ca.call.end"), ("pushed", "ca.push.end")):
                    if (e := _first(events, pulled["t"], ev=ev, pid=ca)) is not None:
                        p[key] = e["t"]
                        _cpu(p, key, e)
                _cpu(p, "pulled", pulled)
                if (e := _first(events, pulled["t"], ev="ca.exit", pid=ca)) is not None:
                    _cpu(p, "exit", e)
                if (e := _first(events, pulled["t"], ev="proc.exit", launcher=True, node=pulled.get("node"))):
                    _cpu(p, "launcher", e)
            if (send := _first(events, begin["t"], ev="sn.send.begin", reply_to=mid)) is not None:
                p["send"] = send["t"]
                if (e := _first(events, send["t"], ev="sn.push.end", pid=send["pid"])) is not None:
                    p["sent"] = e["t"]
            got = next((e for e in events if e["ev"] == "srv.pull" and e["t"] >= begin["t"]
                        and any(g[0] == mid for g in e.get("got", []))), None)
            if got is not None:
                p["got"] = got["t"]
                stage_got.append(got["t"])
            out.append(p)
        for p in out[len(out) - len(end.get("mids", [])):]:
            if stage_got and len(stage_got) == len(end.get("mids", [])):
                p["stage"] = max(stage_got)
    return out


def table(ps: list[dict]) -> str:
    kinds = sorted({p.get("type", "?") for p in ps})
    lines = []
    for kind in ["all", *kinds]:
        sel = [p for p in ps if kind == "all" or p.get("type") == kind]
        lines.append(f"\n{kind}: {len(sel)} messages; median / max ms")
        for label, a, b in STEPS:
            d = [1000 * (p[b] - p[a]) for p in sel if a in p and b in p]
            if d:
                lines.append(f"  {label:<56} {statistics.median(d):>8.0f} {max(d):>8.0f}")
        for label, a, b in CPU_STEPS:
            d = [1000 * (p["cpu"][b] - (p["cpu"][a] if a else 0.0)) for p in sel
                 if b in p.get("cpu", {}) and (a is None or a in p["cpu"])]
            if d:
                lines.append(f"  {label:<56} {statistics.median(d):>8.0f} {max(d):>8.0f}")
        un = [p["sn_unavailable"] for p in sel if "sn_unavailable" in p]
        if un:
            lines.append(f"  {'SuperNode content pulls refused (not yet at the SuperLink)':<56} "
                         f"{statistics.median(un):>8.0f} {max(un):>8.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python bench/deploy_trace/breakdown.py TRACE.jsonl")
    print(table(paths(load(Path(args[0])))))


if __name__ == "__main__":
    main()
