"""The party's run receipt: its own ledger's final facts about a run, signed with its ledger key.

Owns: :func:`receipt_body` (from the party's own signed ledger only: its last head, the last coordinator head it
recorded, the epsilon its accountant charged and the releases it was charged for, the rounds it revealed unmask
shares for) and :func:`write_receipt`, which writes ``<work-dir>/receipts/<party>-<run>.json`` (mode 0600 as every
``write_atomic`` file) in the format of :mod:`distmoe.deploy.receipt`. The party service refreshes it after every
reply it answers (``PartyService.after_reply``): a Flower party is never told that a run ended, so the receipt
after its last message is its run-end receipt. The owner publishes it; ``distmoe audit RUN --receipt FILE``
needs one (or the party's ledger) from every party of the roster to call a run verified (``docs/privacy.md`` §6).

The code-pin digest is the owner's pin the ClientApp runs under, as the pinned launcher (``clients/pinned.py``)
recorded it in this process after checking the bundle (``distmoe.deploy.pin.active_digest``); null otherwise. The
owner policy is the one this process holds the run to (``distmoe.party.policy.policy_facts``). Both are this
process's, not copied from the ledger: the audit compares them with what the ledger recorded at this run's setup, so
a receipt naming another policy or pin than the setup ran under is a violation (``distmoe.audit.receipts``).

Must not: read the party's data, send anything (the receipt never travels in a Flower message), or fail a reply
(a receipt that cannot be written is logged in the party's own ``party.log``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from distmoe.config import NodeConfig, RunConfig
from distmoe.deploy.pin import active_digest
from distmoe.deploy.receipt import sign_receipt
from distmoe.io import write_json_atomic
from distmoe.party.policy import OwnerPolicy, policy_facts
from distmoe.party.session import ledger_key
from distmoe.rundir import COORDINATOR, WorkDir


def receipt_path(node: NodeConfig, run_id: str) -> Path:
    return WorkDir(node.work_dir).receipt(node.party, run_id)


def _entries(path: Path) -> list[dict[str, Any]]:
    out = []
    for raw in path.read_bytes().split(b"\n"):
        if raw.strip():
            try:
                e = json.loads(raw)
            except ValueError:
                continue  # a torn last line: the ledger's own reader repairs it on the next append
            if isinstance(e, dict):
                out.append(e)
    return out


def receipt_body(entries: list[dict[str, Any]], run_id: str, party: str, delta: float, budget: float,
                 code_pin: str | None, owner_policy: dict | None = None) -> dict[str, Any]:
    """The unsigned body (``distmoe.deploy.receipt`` lists the fields) from this party's ledger ``entries``."""
    if not entries:
        raise ValueError("the party ledger is empty: nothing to put in a receipt")
    last = entries[-1]
    coord_head, eps, charged, unmasked = None, 0.0, [], []
    for e in entries:
        if str(e.get("run")) != str(run_id):
            continue
        a = e.get("anchor")
        if e.get("direction") == "in" and isinstance(a, dict) and a.get("node") == COORDINATOR:
            coord_head = {"seq": int(a["seq"]), "hash": str(a["hash"])}
        if e.get("direction") != "out":
            continue
        dp = e.get("dp")
        if isinstance(dp, dict) and isinstance(dp.get("epsilon"), (int, float)):
            eps = max(eps, float(dp["epsilon"]) if math.isfinite(float(dp["epsilon"])) else math.inf)
            pt = str(e.get("payload_type", ""))
            charged.append([e.get("round"), pt.split(":", 1)[1] if ":" in pt else pt])
            if isinstance(dp.get("budget"), (int, float)):
                budget = float(dp["budget"])
        if e.get("payload_type") == "unmask-response" and e.get("verdict") == "accepted":
            unmasked.append(int(e["round"]))
    return {"run": str(run_id), "party": party, "ledger_head": {"seq": int(last["seq"]), "hash": str(last["hash"])},
            "coordinator_head": coord_head, "epsilon": eps, "delta": float(delta), "budget": budget,
            "charged": charged, "unmasked": sorted(set(unmasked)), "code_pin": code_pin,
            "owner_policy": owner_policy}


def write_receipt(cfg: RunConfig, node: NodeConfig, run_id: str, policy: OwnerPolicy | None = None) -> Path:
    """Write (replace) this party's signed receipt of run ``run_id`` under the owner ``policy``; returns its path."""
    ledger = WorkDir(node.work_dir).ledger(node.party)
    budget = min(cfg.privacy.epsilon, node.epsilon_max or math.inf)
    body = receipt_body(_entries(ledger), run_id, node.party, cfg.privacy.delta, budget,
                        active_digest(), policy_facts(policy))
    path = receipt_path(node, run_id)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.parent.chmod(0o700)  # private like the rest of the work directory, whatever the umask
    write_json_atomic(path, sign_receipt(body, ledger_key(node)))
    return path
