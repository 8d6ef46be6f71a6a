"""The arms of ``bench/deploy_round.py``: one deployment, its SuperNodes started per arm, and the simulated run.

``Federation`` is the part every deployed arm shares, made once per invocation as ``docs/deploy.md`` makes it (the
helpers of ``tests/integration/test_deployment.py``): owner keys, credentials, the code pin, a SuperLink with TLS and
SuperNode authentication, the ``flwr`` CLI's connection and the registration of three data owners. Each deployed arm
then starts the owners' three SuperNodes with the same keys (``Federation.nodes``), runs ``flwr run``, and stops its
SuperNodes by PID and waits until the SuperLink lists none online, so that the next arm's ServerApp sees only its own:

- ``distmoe``: distmoe's app through the owners' launchers (``distmoe deploy supernode --code-pin``: the warm worker,
  Flower's waits cut, ``docs/deploy.md`` §2.6);
- ``floor-cut``: Flower's own floor (``bench/flower_floor/``) with the same cuts: ``clients.supernode``'s SuperNode,
  the SuperExec's 50 ms poll, a warm fork per message with the short content back-off
  (``bench/flower_floor/clientapp_cut.py``), the ServerApp's 0.1 s pull;
- ``floor-stock``: the same floor on Flower as it ships (``flower-supernode``, ``flwr-clientapp`` per message,
  ``Grid.send_and_receive``).

The floor replays the messages distmoe's arm moved (``plan_from_shapes``: the ``DISTMOE_DEPLOY_SHAPES`` record of
``bench/deploy_trace/sitecustomize.py``). ``simulated`` is ``distmoe simulate`` over the same data and run config.

Must not: be imported by distmoe (benchmark only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

import test_deployment as td  # noqa: E402  (the deployment test's process helpers)

from distmoe.config import to_toml  # noqa: E402
from distmoe.data.synth import write_synthetic  # noqa: E402
from distmoe.deploy import commands as dc  # noqa: E402
from distmoe.deploy import pin as cp  # noqa: E402
from distmoe.wire.at_rest import make_private  # noqa: E402

FLOOR_APP = REPO / "bench" / "flower_floor"
ARMS = ("distmoe", "floor-cut", "simulated", "floor-stock")  # the order within one repetition
OFFLINE_DEADLINE = 150.0  # s: a SuperNode stopped without deactivating is offline after Flower's heartbeat patience


class Federation:
    """Credentials, pin, SuperLink, CLI connection and three registered owners (stopped by ``stop``)."""

    def __init__(self, root: Path, examples: int, cold: bool = False):
        self.root, self.link = root, td.Deployment(root)
        self.names = [f"party-{i}" for i in range(td.N_PARTIES)]
        self.parties = write_synthetic(root / "data", td.N_PARTIES, examples, 0, canaries=1)
        for pdir in self.parties:  # the owner's step: chmod -R go-rwx <data-path>
            make_private(pdir)
        self.creds, self.port, self.cli_home, self.ids = td._federation(self.link, root, self.names, self.names)
        if cold:  # Flower's way for distmoe: one fresh ClientApp process per message (same pin checks)
            launcher = root / "pin" / "bin" / cp.LAUNCHER
            launcher.write_text(cp.launcher_script((root / "pin" / cp.PIN_FILE).resolve(), sys.executable, warm=False))
        self.floor_bin = root / "floor-bin"  # the cut floor's flwr-clientapp, first on its SuperNodes' PATH
        self.floor_bin.mkdir(exist_ok=True)
        script = self.floor_bin / cp.LAUNCHER
        script.write_text(f"#!/bin/sh\nexec {sys.executable} -P {FLOOR_APP / 'clientapp_cut.py'} \"$@\"\n")
        script.chmod(0o755)

    def stop(self) -> None:
        left = self.link.stop()
        if left:
            print(f"warning: processes left running: {left}", file=sys.stderr)

    def _supernode(self, arm: str, party: str, pdir: Path, nodes: td.Deployment, tag: str):
        home = self.root / f"flwr-node-{party}"
        name = f"{tag}-supernode-{party}"
        if arm == "distmoe":
            owner = str(self.root / "owners" / party)
            return nodes.start(name, [*td.DISTMOE, "deploy", "supernode", "--credentials", owner,
                                      "--code-pin", str(self.root / "pin"), "--superlink", f"127.0.0.1:{self.port}",
                                      "--data-path", str(pdir), "--port", str(nodes.port()), "--flwr-home", str(home),
                                      "--exec"], home)
        cmd = dc.supernode_command(self.root / "owners" / party, superlink=f"127.0.0.1:{self.port}", data_path=pdir,
                                   port=nodes.port(), flwr_home=home)
        args = list(cmd.argv[1:])  # Flower's flower-supernode arguments (TLS, node key, addresses, node config)
        if arm == "floor-stock":
            return nodes.start(name, [str(td.BIN / "flower-supernode"), *args], home)
        path = os.pathsep.join([str(self.floor_bin), str(td.BIN), os.environ.get("PATH", "")])
        return nodes.start(name, ["env", f"PATH={path}", f"{dc.SUPEREXEC_POLL_ENV}={dc.SUPEREXEC_POLL_S}",
                                  sys.executable, "-P", "-m", "clients.supernode", *args], home)

    def nodes(self, arm: str, tag: str) -> td.Deployment:
        """This arm's three SuperNodes, online (their own process token, so ``stop_nodes`` stops only them)."""
        nodes = td.Deployment(self.root)
        procs = [self._supernode(arm, p, d, nodes, tag) for p, d in zip(self.names, self.parties, strict=True)]
        td._wait_online(self.link, self.cli_home, set(self.ids.values()), [self.link.procs[0], *procs])
        return nodes

    def stop_nodes(self, nodes: td.Deployment) -> None:
        left = nodes.stop()
        if left:
            print(f"warning: processes left running: {left}", file=sys.stderr)
        deadline = time.monotonic() + OFFLINE_DEADLINE
        while td._online_nodes(self.link, self.cli_home) and time.monotonic() < deadline:
            time.sleep(1.0)

    def run(self, nodes: td.Deployment, tag: str, app: Path, cfg: Path, done, deadline: float) -> float:
        """``flwr run APP --stream --run-config CFG``; waits until ``done()`` says the run ended; its wall seconds."""
        t0 = time.monotonic()
        cli = nodes.start(f"{tag}-flwr-run", [str(td.BIN / "flwr"), "run", str(app), td.CONN, "--stream",
                                               "--run-config", str(cfg)], self.cli_home)
        while time.monotonic() - t0 < deadline and not done():
            if cli.poll() is not None and cli.returncode != 0:
                raise SystemExit(f"{tag}: flwr run exited {cli.returncode}" + nodes.diag())
            time.sleep(0.5)
        if not done():
            raise SystemExit(f"{tag}: the run did not end within {deadline:.0f} s" + nodes.diag())
        return time.monotonic() - t0


def distmoe_arm(fed: Federation, tag: str, overrides: dict, deadline: float) -> tuple[Path, float]:
    run_dir = fed.root / tag
    cfg = fed.root / f"{tag}.toml"
    cfg.write_text(to_toml({**overrides, "run.dir": str(run_dir)}))
    nodes = fed.nodes("distmoe", tag)
    try:
        def done():
            status = td._record(run_dir).get("status")
            if status == "failed":
                raise SystemExit(f"{tag}: run failed: {td._record(run_dir)}" + nodes.diag())
            return status == "completed"

        wall = fed.run(nodes, tag, REPO, cfg, done, deadline)
    finally:
        fed.stop_nodes(nodes)
    return run_dir, wall


def floor_arm(fed: Federation, tag: str, plan: Path, cut: bool, deadline: float) -> tuple[list[dict], float]:
    """Replays ``plan`` on Flower alone; returns the ServerApp's stage records ({stage, type, start, end, ...})."""
    log = fed.root / f"{tag}.jsonl"
    cfg = fed.root / f"{tag}.toml"
    cfg.write_text(f'plan = "{plan}"\nlog = "{log}"\ncut = {"true" if cut else "false"}\ntimeout = 300.0\n'
                   f"nodes = {td.N_PARTIES}\n")
    nodes = fed.nodes("floor-cut" if cut else "floor-stock", tag)

    def records() -> list[dict]:
        return [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []

    try:
        wall = fed.run(nodes, tag, FLOOR_APP, cfg, lambda: any(r.get("event") == "end" for r in records()), deadline)
    finally:
        fed.stop_nodes(nodes)
    recs = records()
    short = [r for r in recs if "stage" in r and r["replies"] < r["messages"]]
    if short:
        print(f"warning: {tag}: {len(short)} stages timed out without every reply", file=sys.stderr)
    return recs, wall


def simulated(root: Path, data: Path, tag: str, overrides: dict, deadline: float) -> tuple[Path, float]:
    cfg = root / f"{tag}.toml"
    cfg.write_text(to_toml(overrides))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLWR_", "RAY_", "DISTMOE_DEPLOY_"))}
    env.update({"FLWR_HOME": str(root / "flwr-sim"), "HOME": str(root / "home"), "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    t0 = time.monotonic()
    res = subprocess.run([*td.DISTMOE, "simulate", "--data", str(data), "--config", str(cfg), "--no-report",
                          "--runs-dir", str(root / "sim-runs"), "--run-id", tag], env=env, cwd=str(root),
                         capture_output=True, text=True, timeout=deadline)
    if res.returncode != 0:
        raise SystemExit(f"simulate exited {res.returncode}:\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
    return root / "sim-runs" / tag, time.monotonic() - t0


def plan_from_shapes(shapes: Path, since: float, until: float) -> dict:
    """The floor's plan from the ServerApp's shape record of one run (the lines written in [since, until]): one stage
    per ``push_messages``, each message's records and the records of its reply (None: none, or an error reply)."""
    recs = [json.loads(x) for x in shapes.read_text().splitlines() if x.strip()]
    recs = [r for r in recs if since <= r["t"] <= until]
    replies = {r["reply_to"]: r["shape"] for r in recs if r["ev"] == "reply"}
    stages = [{"type": r["type"], "messages": r["shapes"], "replies": [replies.get(m) for m in r["mids"]]}
              for r in recs if r["ev"] == "push"]
    if not stages:
        raise SystemExit(f"{shapes}: no message of distmoe's run was recorded (is bench/deploy_trace on PYTHONPATH?)")
    return {"stages": stages}
