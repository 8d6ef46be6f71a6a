"""The party's run receipt: its own ledger's final facts about a run, signed with its ledger key.

Owns: :func:`receipt_body` (from the party's own signed ledger only: its last head, the last coordinator head it
recorded, the epsilon its accountant charged and the releases it was charged for, the rounds it revealed unmask
shares for) and :func:`write_receipt`, which writes ``<work-dir>/receipts/<party>-<run>.json`` (mode 0600 as every
``write_atomic`` file) in the format of :mod:`distmoe.deploy.receipt`. The party service refreshes it after every
reply it answers (``PartyService.after_reply``): a Flower party is never told that a run ended, so the receipt
after its last message is its run-end receipt. The owner publishes it; ``distmoe audit RUN --receipt FILE``
needs one (or the party's ledger) from every party of the roster to call a run verified (``docs/privacy.md`` §6).

Per reply the facts are not folded over the whole ledger again (that grew with the run: O(rounds) per reply,
O(rounds²) per run): :func:`refresh_facts` carries them forward in ``<work-dir>/privacy/<party>-<run>.receipt-state``
(tagged with a MAC under a secret derived from the ledger key, so an edited or foreign state file is ignored,
never signed into a receipt;
it names the byte offset it ends at and the SHA-256 of the line just before it, checked against the ledger) and
reads only the entries after it. The state file is a cache, written without fsync: when it is missing, stale or
does not match, the whole ledger is folded again. The facts are the same either way (:class:`Facts`).

The code-pin digest is the owner's pin the ClientApp runs under, as the pinned launcher (``clients/pinned.py``)
recorded it in this process after checking the bundle (``distmoe.deploy.pin.active_digest``); null otherwise. The
owner policy is the one this process holds the run to (``distmoe.party.policy.policy_facts``). Both are this
process's, not copied from the ledger: the audit compares them with what the ledger recorded at this run's setup, so
a receipt naming another policy or pin than the setup ran under is a violation (``distmoe.audit.receipts``).

Must not: read the party's data, send anything (the receipt never travels in a Flower message), or fail a reply
(a receipt that cannot be written is logged in the party's own ``party.log``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from distmoe.config import NodeConfig, RunConfig
from distmoe.deploy.pin import active_digest
from distmoe.deploy.receipt import sign_receipt
from distmoe.io import write_json_atomic
from distmoe.ledger.keys import read_tagged, write_tagged
from distmoe.party.policy import OwnerPolicy, policy_facts
from distmoe.party.session import ledger_key
from distmoe.rundir import COORDINATOR, WorkDir


def receipt_path(node: NodeConfig, run_id: str) -> Path:
    return WorkDir(node.work_dir).receipt(node.party, run_id)


class Facts:
    """One run's receipt facts folded over a party ledger's entries in their order (:meth:`add` one at a time):
    the same facts whether folded over the whole ledger at once or carried from an earlier reply's fold."""

    __slots__ = ("run", "last", "coord_head", "eps", "charged", "unmasked", "budget")

    def __init__(self, run_id: str):
        self.run = str(run_id)
        self.last: dict | None = None  # {seq, hash} of the ledger's last entry (of any run)
        self.coord_head: dict | None = None
        self.eps = 0.0
        self.charged: list = []
        self.unmasked: list[int] = []
        self.budget: float | None = None  # the last budget the accountant recorded (None: none yet)

    def add(self, e: dict[str, Any]) -> None:
        self.last = {"seq": int(e["seq"]), "hash": str(e["hash"])}
        if str(e.get("run")) != self.run:
            return
        a = e.get("anchor")
        if e.get("direction") == "in" and isinstance(a, dict) and a.get("node") == COORDINATOR:
            self.coord_head = {"seq": int(a["seq"]), "hash": str(a["hash"])}
        if e.get("direction") != "out":
            return
        dp = e.get("dp")
        if isinstance(dp, dict) and isinstance(dp.get("epsilon"), (int, float)):
            eps = float(dp["epsilon"])
            self.eps = max(self.eps, eps if math.isfinite(eps) else math.inf)
            pt = str(e.get("payload_type", ""))
            self.charged.append([e.get("round"), pt.split(":", 1)[1] if ":" in pt else pt])
            if isinstance(dp.get("budget"), (int, float)):
                self.budget = float(dp["budget"])
        if e.get("payload_type") == "unmask-response" and e.get("verdict") == "accepted":
            self.unmasked.append(int(e["round"]))

    def copy(self) -> Facts:
        new = Facts(self.run)
        new.last, new.coord_head, new.eps, new.budget = self.last, self.coord_head, self.eps, self.budget
        new.charged, new.unmasked = list(self.charged), list(self.unmasked)
        return new

    def state(self) -> dict[str, Any]:
        return {"run": self.run, "last": self.last, "coord_head": self.coord_head, "eps": self.eps,
                "charged": self.charged, "unmasked": self.unmasked, "budget": self.budget}

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> Facts:
        new = cls(d["run"])
        new.last, new.coord_head, new.eps, new.budget = d["last"], d["coord_head"], float(d["eps"]), d["budget"]
        new.charged, new.unmasked = list(d["charged"]), [int(r) for r in d["unmasked"]]
        return new

    def body(self, party: str, delta: float, budget: float, code_pin: str | None,
             owner_policy: dict | None) -> dict[str, Any]:
        if self.last is None:
            raise ValueError("the party ledger is empty: nothing to put in a receipt")
        return {"run": self.run, "party": party, "ledger_head": dict(self.last), "coordinator_head": self.coord_head,
                "epsilon": self.eps, "delta": float(delta),
                "budget": self.budget if self.budget is not None else budget, "charged": self.charged,
                "unmasked": sorted(set(self.unmasked)), "code_pin": code_pin, "owner_policy": owner_policy}


def _parse(raw: bytes) -> dict[str, Any] | None:
    """One ledger line as an entry; None for a blank, unparsable (a torn last line: the ledger's own reader
    repairs it on the next append) or non-object line, which no receipt counts."""
    if not raw.strip():
        return None
    try:
        e = json.loads(raw)
    except ValueError:
        return None
    return e if isinstance(e, dict) else None


def receipt_body(entries: list[dict[str, Any]], run_id: str, party: str, delta: float, budget: float,
                 code_pin: str | None, owner_policy: dict | None = None) -> dict[str, Any]:
    """The unsigned body (``distmoe.deploy.receipt`` lists the fields) from this party's ledger ``entries``."""
    facts = Facts(run_id)
    for e in entries:
        facts.add(e)
    return facts.body(party, delta, budget, code_pin, owner_policy)


CARRY_EVERY = 32  # lines folded since the carried state before it is carried again: a short ledger writes none
STATE_DOMAIN = b"distmoe-receipt-state-v1"  # the state file's tag (``private_tag``): only this key's holder makes one


def _load_state(path: Path, ledger: Path, run_id: str, key: Ed25519PrivateKey) -> tuple[Facts, int] | None:
    """The facts an earlier reply folded and the ledger offset they end at, if the state file verifies under this
    party's ledger key and the ledger still holds, just before that offset, the very line folded last; else None
    (the caller folds the whole ledger again)."""
    payload = read_tagged(path, key, STATE_DOMAIN)
    if payload is None:
        return None
    try:
        st = json.loads(payload)
        offset, tail_len, tail_sha = int(st["offset"]), int(st["tail_len"]), str(st["tail_sha256"])
        facts = Facts.from_state(st["facts"])
        if facts.run != str(run_id) or st["ledger"] != ledger.name or not 0 < tail_len <= offset:
            return None
        with ledger.open("rb") as f:
            f.seek(offset - tail_len)
            tail = f.read(tail_len)
        if len(tail) != tail_len or not tail.endswith(b"\n") or hashlib.sha256(tail).hexdigest() != tail_sha:
            return None
        return facts, offset
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _save_state(path: Path, ledger: Path, facts: Facts, offset: int, tail: bytes, key: Ed25519PrivateKey) -> None:
    payload = json.dumps({"ledger": ledger.name, "offset": offset, "tail_len": len(tail),
                          "tail_sha256": hashlib.sha256(tail).hexdigest(), "facts": facts.state()},
                         allow_nan=True, separators=(",", ":")).encode("ascii")
    write_tagged(path, key, STATE_DOMAIN, payload)


def refresh_facts(ledger: Path, state: Path, run_id: str, key: Ed25519PrivateKey) -> tuple[Facts, int]:
    """``(facts, lines read)``: run ``run_id``'s receipt facts over the whole ledger file ``ledger``, reading only
    the lines after those an earlier call folded (its tagged ``state`` file; the whole file when there is none or it
    does not match the ledger), and carrying the new fold forward in ``state`` once it folded ``CARRY_EVERY`` lines
    past it (a reply reads fewer than that many lines more than are new; a short ledger never writes a state). A
    trailing line without its newline (an append under way or torn) is counted as :func:`receipt_body` counts it,
    but not carried forward."""
    loaded = _load_state(state, ledger, run_id, key)
    facts, offset = loaded if loaded is not None else (Facts(run_id), 0)
    with ledger.open("rb") as f:
        f.seek(offset)
        data = f.read()
    lines = data.split(b"\n")
    done, rest = lines[:-1], lines[-1]  # every line before the last ended with its newline
    for raw in done:
        e = _parse(raw)
        if e is not None:
            facts.add(e)
    if len(done) >= CARRY_EVERY:
        end = offset + len(data) - len(rest)
        tail = data[: len(data) - len(rest)].rsplit(b"\n", 2)[-2] + b"\n"
        with contextlib.suppress(OSError):  # a hint: without it the next reply reads the whole ledger again
            _save_state(state, ledger, facts, end, tail, key)
    e = _parse(rest)
    if e is not None:
        facts = facts.copy()
        facts.add(e)
    return facts, len(done) + bool(rest)


def write_receipt(cfg: RunConfig, node: NodeConfig, run_id: str, policy: OwnerPolicy | None = None) -> Path:
    """Write (replace) this party's signed receipt of run ``run_id`` under the owner ``policy``; returns its path."""
    wd, key = WorkDir(node.work_dir), ledger_key(node)
    budget = min(cfg.privacy.epsilon, node.epsilon_max or math.inf)
    facts, _ = refresh_facts(wd.ledger(node.party), wd.receipt_state(node.party, run_id), run_id, key)
    body = facts.body(node.party, cfg.privacy.delta, budget, active_digest(), policy_facts(policy))
    path = receipt_path(node, run_id)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.parent.chmod(0o700)  # private like the rest of the work directory, whatever the umask
    write_json_atomic(path, sign_receipt(body, key))
    return path
