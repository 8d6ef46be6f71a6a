"""``bench/deploy_trace/``: the trace hook in a real Python process (every Flower function it times is where it
expects it: a Flower that moves one fails here, not silently in the benchmark), nothing at all without its
environment variable, and the breakdown's reading of one message's path."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_DIR = Path(__file__).resolve().parents[2] / "bench" / "deploy_trace"
_spec = importlib.util.spec_from_file_location("deploy_trace_breakdown", _DIR / "breakdown.py")
breakdown = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(breakdown)

_IMPORTS = ("import flwr.supernode.start_client_internal as s, flwr.superlink.grid.http_grid as h, "
            "flwr.supernode.runtime.run_clientapp as r, flwr.clientapp.client_app as c, clients.pinned as p, "
            "flwr.supercore.superexec.executor.subprocess_executor as x; "
            "print(s._push_messages.__name__, r.pull_task_input.__qualname__, c.ClientApp.__call__.__qualname__)")


def _run(tmp_path: Path, traced: bool) -> list[dict]:
    log = tmp_path / "trace.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "DISTMOE_DEPLOY_TRACE"}
    env["PYTHONPATH"] = os.pathsep.join([str(_DIR), str(_DIR.parents[1]), env.get("PYTHONPATH", "")])
    if traced:
        env["DISTMOE_DEPLOY_TRACE"] = str(log)
    res = subprocess.run([sys.executable, "-c", _IMPORTS, "--token", "t", "--code-pin", "x"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def test_the_clientapp_processes_cpu_becomes_its_cpu_steps():
    """The CPU rows: per step of the ClientApp process from its events' CPU counts, its launcher's from its exit."""
    ev = [("srv.push.begin", 10.0, {}), ("sn.recv", 10.2, {"mid": "m", "type": "query.unmask", "node": "9"}),
          ("srv.push.end", 10.5, {"mids": ["m"], "dst": [1]}),
          ("ca.pull.end", 10.8, {"mid": "m", "node": "9", "cpu": 0.1}), ("ca.call.begin", 11.0, {"cpu": 0.15}),
          ("ca.call.end", 11.5, {"cpu": 0.4}), ("ca.push.end", 11.6, {"cpu": 0.42}), ("ca.exit", 11.7, {"cpu": 0.45}),
          ("proc.exit", 11.8, {"node": "9", "launcher": True, "cpu": 0.07}), ("srv.pull", 12.0, {"got": [["m", 1]]})]
    events = [{"ev": e, "t": t, "pid": 5 if e.startswith("ca.") else 1, **kw} for e, t, kw in ev]
    (p,) = breakdown.paths(events)
    assert p["cpu"] == {"pulled": 0.1, "call0": 0.15, "call1": 0.4, "pushed": 0.42, "exit": 0.45, "launcher": 0.07}
    rows = {line[:58].strip(): line[58:].split() for line in breakdown.table([p]).splitlines()}
    assert rows["CPU: party's work (ClientApp.__call__)"] == ["250", "250"]
    assert rows["CPU: the ClientApp process, in all"] == ["450", "450"]
    assert rows["CPU: its launcher process, in all"] == ["70", "70"]


@pytest.mark.slow  # a real Python process importing flwr (several seconds on a loaded machine)
def test_the_hook_wraps_every_timed_function_in_a_real_process_and_only_when_asked(tmp_path):
    events = _run(tmp_path, traced=True)
    assert [e["ev"] for e in events] == ["proc.start", "proc.exit"] and events[0]["launcher"] is True
    assert 0 <= events[0]["cpu"] < events[1]["cpu"]  # the imports' CPU (flwr), counted at the launcher's exit
    assert _run(tmp_path / "off", traced=False) == []


def test_one_messages_path_becomes_its_steps():
    ev = [("srv.push.begin", 10.0, {}), ("sn.recv", 10.2, {"mid": "m", "type": "query.unmask", "node": "9"}),
          ("srv.push.end", 10.5, {"mids": ["m"], "dst": [1]}), ("pull_objects", 10.6, {"unavailable": 2}),
          ("sn.stored", 10.7, {}), ("sx.launch", 10.3, {"node": "9"}),
          ("proc.start", 10.4, {"node": "9", "launcher": True}), ("wc.child", 10.45, {"node": "9"}),
          ("ca.pull.end", 10.8, {"mid": "m"}), ("ca.call.begin", 11.0, {}), ("ca.call.end", 11.5, {}),
          ("ca.push.end", 11.6, {}), ("sn.send.begin", 11.65, {"reply_to": "m"}), ("sn.push.end", 11.9, {}),
          ("srv.pull", 12.0, {"got": [["m", 1]]})]
    pids = {"srv": 1, "sn.": 2, "pul": 2, "sx.": 3, "pro": 4, "wc.": 5, "ca.": 5}
    events = sorted(({"ev": e, "t": t, "pid": pids[e[:3]], **kw} for e, t, kw in ev), key=lambda e: e["t"])
    (p,) = breakdown.paths(events)
    assert p["type"] == "query.unmask" and p["sn_unavailable"] == 2 and p["stage"] == 12.0
    steps = {label: p[b] - p[a] for label, a, b in breakdown.STEPS if a in p and b in p}
    assert len(steps) == len(breakdown.STEPS)
    assert abs(steps["party's work (ClientApp.__call__)"] - 0.5) < 1e-9
    assert "query.unmask: 1 messages" in breakdown.table([p])


@pytest.mark.slow  # a real Python process importing flwr
def test_the_shape_record_alone_wraps_only_the_serverapps_grid(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTMOE_DEPLOY_")}
    env["PYTHONPATH"] = os.pathsep.join([str(_DIR), str(_DIR.parents[1]), env.get("PYTHONPATH", "")])
    env["DISTMOE_DEPLOY_SHAPES"] = str(tmp_path / "shapes.jsonl")
    code = ("import flwr.superlink.grid.http_grid as h, flwr.supernode.runtime.run_clientapp as r; "
            "print(h.HttpGrid.push_messages.__module__, h.HttpGrid.pull_messages.__module__, "
            "r.pull_task_input.__module__)")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["sitecustomize", "sitecustomize", "flwr.supernode.runtime.run_clientapp"]
    assert not (tmp_path / "trace.jsonl").exists()
