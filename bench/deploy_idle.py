"""Benchmark: the CPU an idle deployment takes from the machine, per process, while no run is going.

A deployed run's parties train while the deployment's own processes keep polling: each SuperNode asks the SuperLink
for a message (every 0.2 s with distmoe's launcher), each SuperNode's SuperExec asks its SuperNode for a task (every
50 ms), the SuperLink answers them all over TLS. On a machine whose cores the parties share (this bench's three owners
on two cores) that polling is taken from the training. This starts the bench's deployment
(``bench/deploy_arms.py``: TLS, node authentication, the code pin, three SuperNodes with warm ClientApp workers),
waits ``--settle`` seconds (the warm workers' imports are done by then), then reads every process's CPU time
(``/proc/PID/stat``, user + system) over ``--seconds`` and prints CPU milliseconds per second (1000 = one core busy)
for each process kind and in all.

    python bench/deploy_idle.py                 # the distmoe arm's SuperNodes
    python bench/deploy_idle.py --arm floor-cut  # the floor's (the same cuts of Flower's waits, no warm worker)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import deploy_arms as da  # noqa: E402

from distmoe.simulate.processes import processes_with_token  # noqa: E402

KINDS = (("server.superlink", "SuperLink"), ("flower-superlink", "SuperLink"), ("flower-superexec", "SuperExec"),
         ("clients.superexec", "SuperExec"), ("clients.supernode", "SuperNode"), ("flower-supernode", "SuperNode"),
         ("clients.warm", "warm worker"))
TICK = os.sysconf("SC_CLK_TCK")


def kind_of(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    return next((name for needle, name in KINDS if needle in cmd), cmd.split(" ")[0].rsplit("/", 1)[-1] or "?")


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime (fields 14 and 15 of stat)


def sample(tokens: list[str]) -> dict[int, float]:
    pids = {p for t in tokens for p in processes_with_token(t)}
    return {p: c for p in pids if (c := cpu_seconds(p)) is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", choices=("distmoe", "floor-cut", "floor-stock"), default="distmoe")
    ap.add_argument("--settle", type=float, default=60.0, help="seconds to wait once every SuperNode is online")
    ap.add_argument("--seconds", type=float, default=30.0, help="seconds measured")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="deploy-idle-"))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    fed = da.Federation(root, 24)
    try:
        nodes = fed.nodes(args.arm, "idle")
        try:
            time.sleep(args.settle)
            tokens = [fed.link.token, nodes.token]
            before, t0 = sample(tokens), time.monotonic()
            time.sleep(args.seconds)
            after, wall = sample(tokens), time.monotonic() - t0
            kinds = {pid: kind_of(pid) for pid in after}
        finally:
            fed.stop_nodes(nodes)
    finally:
        fed.stop()
    per_kind: dict[str, list[float]] = {}
    for pid, c in after.items():
        if pid in before:
            per_kind.setdefault(kinds[pid], []).append(c - before[pid])
    load = os.getloadavg()[0]
    print(f"deploy_idle: arm {args.arm}, {wall:.1f} s measured after {args.settle:.0f} s, load {load:.1f}")
    print(f"{'process':<14} {'n':>3} {'CPU ms/s':>9}")
    total = 0.0
    for name, cs in sorted(per_kind.items(), key=lambda kv: -sum(kv[1])):
        total += sum(cs)
        print(f"{name:<14} {len(cs):>3} {1000 * sum(cs) / wall:>9.0f}")
    print(f"{'all':<14} {sum(len(c) for c in per_kind.values()):>3} {1000 * total / wall:>9.0f}  (1000 = one core)")


if __name__ == "__main__":
    main()
