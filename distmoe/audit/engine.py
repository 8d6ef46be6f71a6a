"""The post-run privacy audit: re-verify a finished run from its signed ledgers and run records alone.

Owns: loading a run directory (``run.json``, ``ledger/coordinator.jsonl`` + ``.pub``, the party ledgers
``work/<party>/ledger/<party>.jsonl`` + ``.pub`` or the ones given, ``privacy/ledger.json``), the ten checks
of ``docs/privacy.md`` §6 as applied to this project's ledger conventions, and their result (:class:`AuditResult`).
Check names, in order:
``ledger-integrity, cross-check, allow-list, no-blocked, no-plaintext, epsilon, noise-presence, row-sums,
row-noise, canary-positions, min-parties, canaries, server-files, mask-uniformity, run-end, coordinator-heads,
release-coverage, schedule-coverage`` (``server-files``: the schemas of every server-side file,
:mod:`distmoe.audit.schemas`;
``mask-uniformity``: the uniformity statistic of every masked input a party sent, :mod:`distmoe.audit.masks`;
``row-noise``: the noise in the router statistic's own rows, ``canary-positions``: canaries where the round's
public material puts them, :mod:`distmoe.audit.noise`; the last three, that the coordinator ledger is whole,
closed and covers every release the parties' ledgers witness, and the parties' own signed charges folded into
``epsilon``: :mod:`distmoe.audit.ledgers`; ``schedule-coverage``: every planned round released what it
planned, :mod:`distmoe.audit.coverage`). Each is ``pass``, ``fail``, ``warn`` or ``skipped`` with
human-readable details; the verdict fails if any check fails (a ``warn`` is listed, it does not fail it).
Rendering and writing the report is :mod:`distmoe.audit.report`.

Independence: epsilon is recomputed from the coordinator's release entries (``z_eff`` from the survivors'
count and the declared ``z``, checked against what the ledger claims), not read from the server's
accountant, whose figure is only shown next to it; a party's own signed cumulative charge, when larger,
is its epsilon. The unit is one sequence: an update release is charged at
``z_eff / 2`` (sensitivity two clips), a router-statistics release by the Skellam bound at integer orders.
Statistical thresholds: noise presence fails at ``p < 1e-4 / R`` (one-sided, R = router-stats releases),
row-sum dispersion at upper-tail ``p < 1e-6 / R``, row noise (lower tail, pooled and per release) at a
family-wise ``1e-6``.

Must not: import ``flwr``, read models, checkpoints, anchors or party data (the only file read from a
party's data directory is its canary list ``canaries.txt``), print a canary string (only a SHA-256
prefix), or write anything (that is the report's job). Unusable input (no run directory, no
``run.json`` or coordinator ledger, unparsable run records) raises :class:`AuditInputError`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scipy import stats as _st

from distmoe.audit import coverage, ledgers
from distmoe.audit.masks import check_masks
from distmoe.audit.noise import POSITIONS, ROW_NOISE, check_canary_positions, check_row_noise
from distmoe.audit.schemas import check_server_files
from distmoe.ledger import canonical_json, verify_against_anchor, verify_ledger
from distmoe.privacy.accountant import MECHANISMS, PrivacyEvent, epsilon_from_events
from distmoe.privacy.dp import canary_chi2_test, int_sensitivity
from distmoe.privacy.metric_noise import eval_sensitivity
from distmoe.privacy.update_noise import sequence_noise_multiplier

__all__ = ["AuditInputError", "AuditResult", "Check", "CHECKS", "audit_run"]

CHECKS = ("ledger-integrity", "cross-check", "allow-list", "no-blocked", "no-plaintext", "epsilon",
          "noise-presence", "row-sums", ROW_NOISE, POSITIONS, "min-parties", "canaries", "server-files",
          "mask-uniformity", *ledgers.CHECKS, coverage.CHECK)
COORDINATOR = "coordinator"
# Family-wise false-alarm levels (Bonferroni over a run's router-stats releases). The noise is fresh OS
# randomness, so an honest run fails with about this probability: small enough not to cry wolf across
# many audited runs, and still powerful (K = 2048 canaries caught one of 6 noise shares missing in
# 40 of 40 rounds at 1e-4; an inconsistently weighted layer is off by thousands of sigma).
ALPHA = 1e-4  # noise-presence
ROW_SUM_ALPHA = 1e-6  # row-sums (upper tail)
REL_TOL = 1e-6  # agreement between a recomputed number and the one the ledger claims
STRUCTURAL = ("policy", "run-end", "run-resume", "ledger_head")
RELEASE_TYPES = ("release:router-stats", "release:model-update", "release:rl-update", "release:eval")
PLAINTEXT_TYPES = ("model-update", "router-stats", "eval-reply")  # unmasked arrays (plaintext mode only)
HEAD_KEYS = {"node", "seq", "hash"}
SCAN_CHUNK = 1 << 22
_RUN_NAME = re.compile(r"[A-Za-z0-9_.:/*+-]{1,64}\Z")  # run.name as the report accepts it (the run's one id)


class AuditInputError(ValueError):
    """The run directory cannot be audited at all (missing or unparsable run records): exit status 2."""


@dataclass
class Check:
    """One audit check: ``status`` is ``pass``, ``fail`` or ``skipped``; ``details`` say why."""

    name: str
    status: str = "pass"  # pass, fail, warn (a finding that does not fail the verdict) or skipped
    details: list[str] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)  # the details that failed it

    def fail(self, msg: str) -> None:
        self.status = "fail"
        self.details.append(msg)
        self.findings.append(msg)

    def note(self, msg: str) -> None:
        self.details.append(msg)

    def warn(self, msg: str) -> None:
        """A finding that does not fail the verdict (privacy held, the run did not do what it planned)."""
        if self.status == "pass":
            self.status = "warn"
        self.details.append(msg)
        self.findings.append(msg)

    def skip(self, msg: str) -> None:
        if self.status != "fail":
            self.status = "skipped"
        self.details.append(msg)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "details": list(self.details),
                "findings": list(self.findings)}


@dataclass
class AuditResult:
    """Everything the audit found; :meth:`to_dict` is the ``audit.json`` body."""

    run_dir: Path
    run_id: str
    checks: list[Check]
    ledgers: dict[str, str]  # ledger name -> path
    settings: dict[str, Any]  # the privacy settings the checks used
    epsilon: dict[str, dict[str, Any]]  # party -> figures
    releases: list[dict[str, Any]]  # per release: seq, type, included, test figures
    flower_run_id: str | None = None  # Flower's id of the run: a detail (ledgers are keyed by it)

    @property
    def verdict(self) -> str:
        return "fail" if self.failed else "pass"

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if c.status == "fail"]

    @property
    def passed(self) -> bool:
        return not self.failed

    @property
    def warnings(self) -> list[str]:
        """Findings of checks that warn (e.g. a planned round that released nothing): not a failed verdict."""
        return [f"{c.name}: {w}" for c in self.checks if c.status == "warn" for w in c.findings]

    def check(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "flower_run_id": self.flower_run_id, "run_dir": str(self.run_dir),
                "verdict": self.verdict,
                "failed": self.failed, "warnings": self.warnings, "checks": [c.to_dict() for c in self.checks],
                "ledgers": dict(self.ledgers),
                "settings": dict(self.settings), "epsilon": self.epsilon, "releases": self.releases}


# ----------------------------------------------------------------------------------------------- loading
@dataclass
class _Ledger:
    name: str
    path: Path
    pub_path: Path
    pub: str | None
    entries: list[dict[str, Any]]
    by_seq: dict[int, dict[str, Any]]


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise AuditInputError(f"{path}: no {what}") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise AuditInputError(f"{path}: {what} is not valid JSON: {exc}") from exc


def _load_ledger(name: str, path: Path, pub_path: Path) -> _Ledger:
    """Parse what can be parsed (integrity is judged by ``verify_ledger``, not here)."""
    entries: list[dict[str, Any]] = []
    for raw in path.read_bytes().split(b"\n"):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(obj, dict):
            entries.append(obj)
    by_seq: dict[int, dict[str, Any]] = {}
    for e in entries:
        if isinstance(e.get("seq"), int):
            by_seq.setdefault(e["seq"], e)
    try:
        pub = pub_path.read_text(encoding="ascii").strip() or None
    except (OSError, UnicodeDecodeError):
        pub = None
    return _Ledger(name, path, pub_path, pub, entries, by_seq)


def _flat_get(cfg: Mapping[str, Any], key: str) -> Any:
    """``cfg["a.b"]`` for a flat config, else ``cfg["a"]["b"]`` for a nested one; None if absent."""
    if key in cfg:
        return cfg[key]
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _info(e: Mapping[str, Any]) -> dict[str, Any]:
    i = e.get("info")
    return i if isinstance(i, dict) else {}


def _where(lf: _Ledger | str, e: Mapping[str, Any]) -> str:
    name = lf if isinstance(lf, str) else lf.name
    rnd = e.get("round")
    return f"{name}#{e.get('seq')} {e.get('payload_type')}" + (f" (round {rnd})" if rnd is not None else "")


def _sha_prefix(s: str) -> str:
    return "sha256:" + hashlib.sha256(s.encode("utf-8")).hexdigest()[:12]


def _close(a: Any, b: float) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and math.isclose(float(a), b, rel_tol=REL_TOL,
                                                                                     abs_tol=1e-12)


class _Run:
    def __init__(self, run_dir: Path, party_ledgers: Sequence[str | os.PathLike[str]] | None,
                 canaries: str | os.PathLike[str] | None):
        self.dir = run_dir
        if not run_dir.is_dir():
            raise AuditInputError(f"{run_dir}: no such run directory")
        meta = _read_json(run_dir / "run.json", "run.json")
        if not isinstance(meta, dict):
            raise AuditInputError(f"{run_dir / 'run.json'}: expected a JSON object")
        self.meta = meta
        self.config = meta.get("config") if isinstance(meta.get("config"), dict) else {}
        self.run_parties = meta.get("parties") if isinstance(meta.get("parties"), dict) else {}
        cpath = run_dir / "ledger" / f"{COORDINATOR}.jsonl"
        if not cpath.is_file():
            raise AuditInputError(f"{cpath}: no coordinator ledger")
        self.coord = _load_ledger(COORDINATOR, cpath, cpath.with_suffix(".pub"))
        if party_ledgers is None:
            paths = sorted(run_dir.glob("work/*/ledger/*.jsonl"))
        else:
            paths = [Path(p) for p in party_ledgers]
            for p in paths:
                if not p.is_file():
                    raise AuditInputError(f"{p}: no such party ledger")
        self.parties: dict[str, _Ledger] = {}
        for p in paths:
            name = p.stem
            if name in self.parties or name == COORDINATOR:
                raise AuditInputError(f"{p}: a second ledger for node {name!r}")
            self.parties[name] = _load_ledger(name, p, p.with_suffix(".pub"))
        server = run_dir / "privacy" / "ledger.json"
        self.server_privacy = _read_json(server, "privacy ledger") if server.exists() else None
        self.canaries_arg = Path(canaries) if canaries is not None else None
        if self.canaries_arg is not None and not self.canaries_arg.is_file():
            raise AuditInputError(f"{self.canaries_arg}: no such canary list")
        self.start = self.coord.by_seq.get(0, {})
        self.releases = [e for e in self.coord.entries if str(e.get("payload_type", "")).startswith("release:")]
        self.stats_releases = [e for e in self.releases if e.get("payload_type") == "release:router-stats"]
        self.settings: dict[str, Any] = {}

    @property
    def ledgers(self) -> list[_Ledger]:
        return [self.coord, *self.parties.values()]

    def setting(self, key: str, check: Check) -> Any:
        """A ``privacy.<key>`` setting: the signed run-start record first, run.json's config second;
        a disagreement between the two fails ``check``."""
        signed = _info(self.start).get("privacy")
        signed = signed if isinstance(signed, dict) else {}
        a = signed.get(f"privacy.{key}", signed.get(key))
        b = _flat_get(self.config, f"privacy.{key}")
        if a is not None and b is not None and a != b:
            check.fail(f"privacy.{key}: the run-start ledger entry says {a!r}, run.json says {b!r}")
        value = a if a is not None else b
        self.settings[f"privacy.{key}"] = value
        return value

    def all_parties(self) -> list[str]:
        names = set(self.run_parties) | set(self.parties)
        for r in self.releases:
            names.update(_included(r))
        return sorted(names)


def _included(rel: Mapping[str, Any]) -> list[str]:
    inc = _info(rel).get("included")
    return [str(p) for p in inc] if isinstance(inc, list) else []


# ------------------------------------------------------------------------------------------------ checks
def _check_integrity(run: _Run) -> Check:
    c = Check("ledger-integrity")
    rel = _Rel(run.dir)
    if run.coord.pub is None:
        c.fail(f"{rel(run.coord.pub_path)}: coordinator public key missing: its ledger cannot be verified")
    else:
        errors = _verify(lambda: verify_ledger(run.coord.path, run.coord.pub))
        for err in errors:
            c.fail(rel(err))
        if not errors:
            c.note(f"coordinator: {len(run.coord.entries)} entries verify")
    anchored = _latest_anchors(run.coord.entries)
    pins = _pins(run)
    for name, lf in run.parties.items():
        if lf.pub is None:
            c.fail(f"{rel(lf.pub_path)}: public key of {name} missing: its ledger cannot be verified")
            continue
        head = anchored.get(name)
        if head is None:
            errors = _verify(lambda lf=lf: verify_ledger(lf.path, lf.pub))
            c.note(f"{name}: never anchored by the coordinator (truncation cannot be checked)")
        else:
            errors = _verify(lambda lf=lf, head=head: verify_against_anchor(lf.path, lf.pub, head))
        for err in errors:
            c.fail(rel(err))
        if not pins.get(name):
            c.fail(f"{name}: ledger key is not pinned (no key-advert in the coordinator ledger, none in run.json)")
        for where, key in pins.get(name, []):
            if key != lf.pub:
                c.fail(f"{name}: {rel(lf.pub_path)} is not the key pinned in {where} (key substituted)")
        if not errors:
            c.note(f"{name}: {len(lf.entries)} entries verify" + (f", anchored head seq {head[0]} matches"
                                                                   if head else ""))
    for name, plist in pins.items():  # parties whose ledger is not here: the pins must still agree
        if name not in run.parties and len({k for _, k in plist}) > 1:
            c.fail(f"{name}: pinned keys disagree: " + ", ".join(w for w, _ in plist))
    return c


class _Rel:
    """Show paths relative to the run directory (shorter, and the same on every machine)."""

    def __init__(self, root: Path):
        self.prefix = str(root).rstrip("/") + "/"

    def __call__(self, s: Any) -> str:
        return str(s).replace(self.prefix, "")


def _verify(fn: Any) -> list[str]:
    try:
        return list(fn().errors)
    except (ValueError, TypeError) as exc:  # a malformed public key
        return [f"cannot verify: {exc}"]


def _latest_anchors(entries: Iterable[Mapping[str, Any]]) -> dict[str, tuple[int, str]]:
    out: dict[str, tuple[int, str]] = {}
    for e in entries:
        a = e.get("anchor")
        if isinstance(a, dict) and isinstance(a.get("seq"), int) and isinstance(a.get("hash"), str):
            out[str(a.get("node"))] = (a["seq"], a["hash"])
    return out


def _pins(run: _Run) -> dict[str, list[tuple[str, str]]]:
    """Per party: where its ledger key is pinned and the key (coordinator key-adverts, then run.json)."""
    pins: dict[str, list[tuple[str, str]]] = {}
    for e in run.coord.entries:
        if e.get("payload_type") == "key-advert" and e.get("direction") == "in" and isinstance(e.get("peer"), str):
            key = _info(e).get("ledger_public_key")
            pins.setdefault(e["peer"], []).append((f"coordinator#{e.get('seq')} key-advert", str(key)))
    for name, rec in run.run_parties.items():
        if isinstance(rec, dict) and rec.get("ledger_public_key") is not None:
            pins.setdefault(str(name), []).append(("run.json", str(rec["ledger_public_key"])))
    return pins


def _check_cross(run: _Run) -> Check:
    c = Check("cross-check")
    checked, unverifiable = 0, set()
    last: dict[str, int] = {}
    for e in run.coord.entries:
        a = e.get("anchor")
        pt = str(e.get("payload_type"))
        if not isinstance(a, dict):
            peer = e.get("peer")
            if (e.get("direction") == "in" and isinstance(peer, str) and peer != "all" and pt not in STRUCTURAL
                    and pt != "error" and not pt.startswith("release:") and e.get("verdict") == "accepted"):
                c.fail(f"{_where(run.coord, e)}: accepted reply from {peer} carries no ledger head")
            continue
        node, seq, h = str(a.get("node")), a.get("seq"), a.get("hash")
        if pt != "ledger_head" and e.get("peer") not in (None, node):
            c.fail(f"{_where(run.coord, e)}: anchor names {node} but the reply is from {e.get('peer')}")
        if isinstance(seq, int):
            if seq < last.get(node, -1):
                c.fail(f"{_where(run.coord, e)}: anchored head of {node} went back from seq {last[node]} to {seq}")
            last[node] = max(seq, last.get(node, -1))
        lf = run.parties.get(node)
        if lf is None:
            unverifiable.add(node)
            continue
        pe = lf.by_seq.get(seq) if isinstance(seq, int) else None
        if pe is None:
            c.fail(f"{_where(run.coord, e)}: {node} has no entry at anchored seq {seq} (truncated)")
            continue
        if pe.get("hash") != h:
            c.fail(f"{_where(run.coord, e)}: {node}#{seq} does not have the anchored hash (rewritten)")
            continue
        checked += 1
        if pt == "ledger_head":  # an explicit anchor: no reply to compare with
            continue
        if pe.get("direction") != "out":
            c.fail(f"{_where(run.coord, e)}: {node}#{seq} is not an outbound entry")
        if pe.get("payload_type") != pt:
            c.fail(f"{_where(run.coord, e)}: {node}#{seq} logged {pe.get('payload_type')!r} as sent")
        if pe.get("sha256") != e.get("sha256"):
            c.fail(f"{_where(run.coord, e)}: what arrived differs from what {node} logged as sent (sha256)")
    for node in sorted(unverifiable):
        c.note(f"{node}: ledger not available here; its anchors are not cross-checked")
    if not run.parties:
        c.skip("no party ledgers to cross-check")
    else:
        c.note(f"{checked} anchored entries match the party ledgers")
    return c


def _check_allow_list(run: _Run) -> Check:
    c = Check("allow-list")
    policy = _policy(run, c)
    n = 0
    for lf in run.ledgers:
        for e in lf.entries:
            pt = e.get("payload_type")
            keys = e.get("keys") if isinstance(e.get("keys"), list) else []
            shapes = e.get("shapes") if isinstance(e.get("shapes"), dict) else {}
            w = _where(lf, e)
            if pt == "policy":
                if not (lf is run.coord and e.get("seq") == 0):
                    c.fail(f"{w}: a policy entry outside the coordinator's run-start")
                continue
            if pt == "run-end":
                if keys:
                    c.fail(f"{w}: run-end entry declares keys {keys}")
                continue
            if pt == "run-resume":  # a restarted coordinator continuing the chain (docs/operations.md)
                if lf is not run.coord or keys or shapes or e.get("direction") != "out":
                    c.fail(f"{w}: a run-resume entry outside the coordinator's ledger, or declaring keys/shapes")
                continue
            if pt == "ledger_head":
                if set(keys) - HEAD_KEYS or not isinstance(e.get("anchor"), dict):
                    c.fail(f"{w}: malformed ledger-head entry")
                continue
            if isinstance(pt, str) and pt.startswith("release:"):
                if pt not in RELEASE_TYPES:
                    c.fail(f"{w}: unknown release type")
                elif keys or set(shapes) - {"sum"}:
                    c.fail(f"{w}: a release declares keys {keys} / shapes {sorted(shapes)} (only 'sum' allowed)")
                continue
            if policy is None:
                continue
            n += 1
            rule = policy.get(pt)
            if rule is None:
                c.fail(f"{w}: payload type not in the allow-list")
                continue
            prefix = rule["pattern"]
            extra = sorted(k for k in set(keys) - set(rule["keys"]) if not (prefix and k.startswith(prefix)))
            missing = sorted(set(rule["required"]) - set(keys))
            if extra:
                c.fail(f"{w}: keys outside the allow-list {extra}")
            if missing:
                c.fail(f"{w}: required keys missing {missing}")
            for k, shape in rule["shapes"].items():
                if k in keys and shapes.get(k) != shape:
                    c.fail(f"{w}: {k} has shape {shapes.get(k)}, allowed {shape}")
            for k, allowed in rule["shape_choices"].items():  # a run whose shapes change (expert expansion)
                if k in keys and shapes.get(k) not in allowed:
                    c.fail(f"{w}: {k} has shape {shapes.get(k)}, allowed one of {allowed}")
            nbytes = e.get("bytes")
            if not isinstance(nbytes, int) or nbytes > rule["max_bytes"]:
                c.fail(f"{w}: {nbytes} bytes > max_bytes {rule['max_bytes']}")
    if policy is not None:
        c.note(f"{n} message entries in {len(run.ledgers)} ledgers checked against {len(policy)} allowed types")
    return c


def _policy(run: _Run, c: Check) -> dict[str, dict[str, Any]] | None:
    """The allow-list from the coordinator's run-start entry, checked against its recorded digest.

    Per payload type: ``keys`` (allowed), ``required`` (default: all of ``keys``, i.e. set equality),
    optional ``keys_pattern`` (``"prefix*"``: further allowed keys), ``shapes`` (fixed-shape arrays), optional
    ``shape_choices`` (arrays whose shape is one of a list: a run with expert expansion) and
    ``max_bytes``, as ``distmoe.wire.server_guard.build_policy`` writes them.
    """
    e0 = run.start
    pol = _info(e0).get("policy")
    if e0.get("phase") != "run-start" or e0.get("payload_type") != "policy" or not isinstance(pol, dict):
        c.fail("coordinator#0 is not a run-start entry carrying the policy: nothing can be checked")
        return None
    text = canonical_json(pol).encode("ascii")
    if hashlib.sha256(text).hexdigest() != e0.get("sha256") or len(text) != e0.get("bytes"):
        c.fail("coordinator#0: the policy does not match its recorded sha256/bytes")
    out: dict[str, dict[str, Any]] = {}
    for pt, rule in pol.items():
        ok = (isinstance(rule, dict) and isinstance(rule.get("keys"), list)
              and isinstance(rule.get("required", []), list) and isinstance(rule.get("shapes", {}), dict)
              and isinstance(rule.get("max_bytes"), int) and isinstance(rule.get("keys_pattern", ""), str)
              and isinstance(rule.get("shape_choices", {}), dict))
        if not ok:
            c.fail(f"policy entry {pt!r} is malformed (needs keys, shapes, max_bytes)")
            continue
        keys = [str(k) for k in rule["keys"]]
        pattern = rule.get("keys_pattern") or ""  # "metrics.*": any key with that prefix is allowed
        if pattern and not pattern.endswith("*"):
            c.fail(f"policy entry {pt!r}: keys_pattern {pattern!r} is not a 'prefix*' pattern")
            pattern = ""
        shapes = {str(k): [int(d) for d in v] for k, v in rule.get("shapes", {}).items()}
        choices = {str(k): [[int(d) for d in s] for s in v] for k, v in rule.get("shape_choices", {}).items()}
        out[str(pt)] = {"keys": keys, "required": [str(k) for k in rule.get("required", keys)], "shapes": shapes,
                        "shape_choices": choices, "max_bytes": rule["max_bytes"], "pattern": pattern[:-1]}
    return out


def _check_blocked(run: _Run) -> Check:
    c = Check("no-blocked")
    for lf in run.ledgers:
        for e in lf.entries:
            v = e.get("verdict")
            if v != "accepted":
                reason = v[len("rejected:"):].strip() if isinstance(v, str) and v.startswith("rejected:") else repr(v)
                c.fail(f"{_where(lf, e)}: blocked: {reason}")
    if c.status == "pass":
        c.note(f"every entry of {len(run.ledgers)} ledgers was accepted")
    return c


def _check_plaintext(run: _Run) -> Check:
    c = Check("no-plaintext")
    mode = _info(run.start).get("mode")
    if mode == "plaintext":
        c.fail("plaintext-mode run: the run-start entry records mode 'plaintext'")
    elif mode != "secagg":
        c.fail(f"the run-start entry records no secure-aggregation mode (mode {mode!r})")
    cfg_mode = _flat_get(run.config, "privacy.mode")
    if cfg_mode == "plaintext":
        c.fail("plaintext-mode run: run.json config privacy.mode = 'plaintext'")
    for e in run.releases:
        m = _info(e).get("mode")
        if m == "plaintext":
            c.fail(f"plaintext-mode release: {_where(run.coord, e)}")
        elif m != "secagg":
            c.fail(f"{_where(run.coord, e)}: release records no secure-aggregation mode (mode {m!r})")
    for lf in run.ledgers:
        for e in lf.entries:
            if e.get("payload_type") in PLAINTEXT_TYPES:
                c.fail(f"plaintext payload: {_where(lf, e)}")
    if c.status == "pass":
        c.note(f"mode secagg; {len(run.releases)} releases, all masked")
    return c


def _z_eff(rel: Mapping[str, Any], c: Check | None) -> float | None:
    """``z * sqrt(n_active / (n - d_max))`` recomputed from the release; disagreements fail ``c``."""
    dp = rel.get("dp")
    w = _where(COORDINATOR, rel)
    if not isinstance(dp, dict):
        return None
    try:
        z, n, dmax = float(dp["noise_multiplier"]), int(dp["n_parties"]), int(dp.get("max_dropouts", 0))
    except (KeyError, TypeError, ValueError):
        if c is not None:
            c.fail(f"{w}: dp parameters incomplete (need noise_multiplier, n_parties, max_dropouts)")
        return None
    n_active = len(_included(rel))
    if c is not None and dp.get("n_active") != n_active:
        c.fail(f"{w}: dp.n_active = {dp.get('n_active')!r} but {n_active} parties are included")
    if n - dmax <= 0 or not (math.isfinite(z) and z > 0):
        if c is not None:
            c.fail(f"{w}: invalid dp parameters (z={z}, n_parties={n}, max_dropouts={dmax})")
        return None
    ze = z * math.sqrt(n_active / (n - dmax))
    if c is not None and ("z_eff" in dp or rel.get("payload_type") == "release:router-stats"):
        if not _close(dp.get("z_eff"), ze):
            c.fail(f"{w}: dp.z_eff = {dp.get('z_eff')!r}, recomputed {ze:.6g} from {n_active} survivors")
    return ze


Ev = tuple[float, float, int, str, float, float]  # (z, q, steps, mechanism, d2, d1)


@functools.lru_cache(maxsize=256)
def _eps(events: tuple[Ev, ...], delta: float) -> tuple[float, float]:
    """``(eps_prv, eps_rdp)`` of ``(z, q, steps, mechanism, d2, d1)`` events (cached: parties often share a
    history); Skellam by its integer-order RDP bound (``distmoe.privacy.accountant``)."""
    return epsilon_from_events([PrivacyEvent(z, q, k, m, d2=d2, d1=d1) for z, q, k, m, d2, d1 in events], delta)


def _release_event(rel: Mapping[str, Any], ze: float, mech: str, c: Check) -> Ev:
    """The per-sequence ledger event of a DP release, recomputed: a Gaussian (update) release at ``z_eff / 2``
    (one sequence moves a clipped update by 2 clips; a ledger figure that says otherwise fails ``c``), a
    Skellam evaluation release at the sensitivities of one held-out sequence (``metric_noise``), a Skellam
    router-statistics release with the sensitivities of its recorded shape (the worst case if they cannot be
    computed)."""
    dp, w = rel["dp"], _where(COORDINATOR, rel)
    if mech == "gaussian":
        zs = sequence_noise_multiplier(ze)
        if "z_sequence" in dp and not _close(dp.get("z_sequence"), zs):
            c.fail(f"{w}: dp.z_sequence = {dp.get('z_sequence')!r}, recomputed {zs:.6g} (z_eff / 2: one sequence "
                   "moves a clipped update by 2 clips)")
        return zs, 1.0, 1, mech, 0.0, 0.0
    if rel.get("payload_type") == "release:eval":  # one held-out sequence: three coordinates of <= s
        try:
            d2, d1 = eval_sensitivity(float(dp["scale"]))
        except (KeyError, TypeError, ValueError):
            c.fail(f"{w}: evaluation release without its integer scale (dp.scale)")
            d2 = d1 = 0.0
        for k, v in (("delta2_int", d2), ("delta1_int", d1)):
            if d2 and not _close(dp.get(k), v):
                c.fail(f"{w}: dp.{k} = {dp.get(k)!r}, recomputed {v:.6g} (one held-out sequence, scale "
                       f"{dp.get('scale')!r})")
        return ze, 1.0, 1, mech, d2, d1
    info = _info(rel)
    try:
        d2, d1 = int_sensitivity(int(info["layers"]), int(info["experts"]), float(dp["scale"]),
                                 str(dp.get("rounding", "per-sequence")))
    except (KeyError, TypeError, ValueError):
        d2 = d1 = 0.0  # PrivacyEvent's worst case; noise-presence names the missing shape
    return ze, 1.0, 1, mech, d2, d1


def _primary(prv: float, rdp: float) -> float:
    return rdp if math.isnan(prv) else max(prv, rdp)


def _check_update_dp(rel: Mapping[str, Any], c: Check) -> None:
    """A DP model update is covered by its noise only if nothing data-dependent travels beside the noised
    block: uniform weights (so the released weight sum is the included-party count), metrics withheld, and
    the sensitivity the noise was calibrated to equal to the clip."""
    dp, info, w = rel["dp"], _info(rel), _where(COORDINATOR, rel)
    n_inc = len(_included(rel))
    if dp.get("weights") != "uniform" or dp.get("metrics") != "withheld":
        c.fail(f"{w}: DP update with weights {dp.get('weights')!r} and metrics {dp.get('metrics')!r}: the weight "
               "sum and metrics are released exact beside the noise")
    elif not (_close(dp.get("sensitivity"), float(dp.get("clip", math.nan)))):
        c.fail(f"{w}: DP update noise calibrated to sensitivity {dp.get('sensitivity')!r}, clip {dp.get('clip')!r}")
    elif not _close(info.get("weight_sum"), float(n_inc)):
        c.fail(f"{w}: released weight sum {info.get('weight_sum')!r} != {n_inc} included parties (uniform weights)")


def _check_epsilon(run: _Run) -> tuple[Check, dict[str, dict[str, Any]]]:
    c = Check("epsilon")
    budget, delta = run.setting("epsilon", c), run.setting("delta", c)
    nmax = run.setting("num-sequences-max", c)
    if not isinstance(budget, (int, float)) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
        c.fail(f"privacy.epsilon / privacy.delta not recorded or invalid ({budget!r}, {delta!r})")
        return c, {}
    if isinstance(nmax, int) and nmax > 0:
        if delta > 1.0 / nmax:
            c.fail(f"delta {delta:g} > 1/num-sequences-max = {1.0 / nmax:g}")
        else:
            c.note(f"delta {delta:g} <= 1/num-sequences-max = {1.0 / nmax:g}")
    else:
        c.fail(f"privacy.num-sequences-max not recorded or invalid ({nmax!r}): delta <= 1/N cannot be checked")
    events: dict[str, list[Ev]] = {}
    for r in run.releases:
        dp = r.get("dp")
        if dp is None:
            if r.get("payload_type") == "release:eval" and _info(r).get("mode") == "secagg":
                c.fail(f"{_where(COORDINATOR, r)}: evaluation figures released without DP noise (dp is null): a "
                       "straggle would difference one party's counts and losses out of two such sums")
            continue
        ze = _z_eff(r, c)
        mech = dp.get("mechanism") if isinstance(dp, dict) else None
        if mech not in MECHANISMS:
            c.fail(f"{_where(COORDINATOR, r)}: unknown DP mechanism {mech!r}")
            continue
        if ze is None or ze <= 0:
            continue
        if r.get("payload_type") in ("release:model-update", "release:rl-update"):
            _check_update_dp(r, c)
        ev = _release_event(r, ze, mech, c)
        for p in _included(r):
            events.setdefault(p, []).append(ev)
    server = run.server_privacy.get("parties", {}) if isinstance(run.server_privacy, dict) else {}
    table: dict[str, dict[str, Any]] = {}
    for p in run.all_parties():
        evs = tuple(sorted(events.get(p, [])))
        prv, rdp = _eps(evs, float(delta))
        eps = _primary(prv, rdp)
        row: dict[str, Any] = {"releases": len(evs), "eps_prv": prv, "eps_rdp": rdp, "epsilon": eps,
                               "budget": budget, "delta": delta, "server_epsilon": None, "server_events": None}
        st = server.get(p) if isinstance(server, dict) else None
        if isinstance(st, dict) and isinstance(st.get("events"), list):
            try:  # the server's accountant replayed from its own event list (informational)
                evs_s = [PrivacyEvent.from_dict(x) for x in st["events"]]
                sev = tuple(sorted((e.noise_multiplier, e.sample_rate, e.steps, e.mechanism, e.d2, e.d1)
                                   for e in evs_s))
                row["server_epsilon"] = _primary(*_eps(sev, float(st.get("delta", delta))))
                row["server_events"] = len(evs_s)
            except (KeyError, TypeError, ValueError):
                c.note(f"{p}: the server's accountant state is unreadable (informational only)")
        row["status"] = "pass" if eps <= budget else "fail"
        if eps > budget:
            c.fail(f"{p}: epsilon {eps:.4f} (PRV {prv:.4f}, RDP {rdp:.4f}) over {len(evs)} releases exceeds the "
                   f"budget {budget:g} at delta {delta:g}")
        else:
            c.note(f"{p}: epsilon {eps:.4f} <= {budget:g} over {len(evs)} DP releases")
        if row["server_events"] is not None and row["server_events"] != len(evs):
            c.note(f"{p}: the server's accountant holds {row['server_events']} events, the ledger {len(evs)} "
                   "DP releases (informational)")
        table[p] = row
    return c, table


def _sigma(rel: Mapping[str, Any], c: Check) -> tuple[float, int, int] | None:
    """``(sigma_int, L, E)`` of a router-stats release, recomputed; disagreements with the ledger fail ``c``."""
    dp, info, w = rel.get("dp"), _info(rel), _where(COORDINATOR, rel)
    try:
        layers, experts = int(info["layers"]), int(info["experts"])
        d2 = int_sensitivity(layers, experts, float(dp["scale"]), str(dp.get("rounding", "per-sequence")))[0]
    except (KeyError, TypeError, ValueError) as exc:
        c.fail(f"{w}: cannot recompute the sensitivity ({exc})")
        return None
    if not _close(dp.get("delta2_int"), d2):
        c.fail(f"{w}: dp.delta2_int = {dp.get('delta2_int')!r}, recomputed {d2:.6g}")
    ze = _z_eff(rel, None)
    if ze is None or ze <= 0:
        c.fail(f"{w}: no noise multiplier for the survivors ({len(_included(rel))} included)")
        return None
    sigma = ze * d2
    if "sigma_int" in dp and not _close(dp.get("sigma_int"), sigma):
        c.fail(f"{w}: dp.sigma_int = {dp.get('sigma_int')!r}, recomputed {sigma:.6g}")
    return sigma, layers, experts


def _check_noise(run: _Run, figs: dict[int, dict[str, Any]]) -> Check:
    c = Check("noise-presence")
    rels = run.stats_releases
    if not rels:
        c.skip("no router-stats releases")
        return c
    alpha = ALPHA / len(rels)
    tested = 0
    for r in rels:
        w = _where(COORDINATOR, r)
        if not isinstance(r.get("dp"), dict):
            c.fail(f"{w}: router statistics released without DP noise (dp is null)")
            continue
        got = _sigma(r, c)
        canary = _info(r).get("canary")
        if got is None or not isinstance(canary, dict):
            if got is not None:
                c.fail(f"{w}: no canary record")
            continue
        sigma = got[0]
        values = canary.get("values") if isinstance(canary.get("values"), list) else []
        k = canary.get("k")
        if k != len(values):
            c.fail(f"{w}: canary.k = {k!r} but {len(values)} values recorded")
        if r["dp"].get("n_canaries") not in (None, k):
            c.fail(f"{w}: dp.n_canaries = {r['dp'].get('n_canaries')!r} but canary.k = {k!r}")
        if not values:
            c.note(f"{w}: no canaries (k = 0): not tested")
            continue
        try:
            t = canary_chi2_test([float(v) for v in values], sigma, alpha)
        except (TypeError, ValueError) as exc:
            c.fail(f"{w}: canary values unusable ({exc})")
            continue
        tested += 1
        figs.setdefault(r["seq"], {}).update({"sigma_int": sigma, "canaries": len(values),
                                              "sigma_ratio": t.sigma_ratio, "noise_p": t.p_low})
        msg = f"{w}: sigma_hat/sigma = {t.sigma_ratio:.3f}, p = {t.p_low:.3g} (alpha {alpha:.2g}, K = {len(values)})"
        if t.passed:
            c.note(msg)
        else:
            c.fail(msg + ": noise missing")
    if tested == 0 and c.status != "fail":
        c.skip("no release carries canaries")
    return c


def _check_row_sums(run: _Run, figs: dict[int, dict[str, Any]]) -> Check:
    c = Check("row-sums")
    tested = 0
    alpha = ROW_SUM_ALPHA / max(len(run.stats_releases), 1)
    for r in run.stats_releases:
        w = _where(COORDINATOR, r)
        if not isinstance(r.get("dp"), dict):
            c.note(f"{w}: no DP parameters (see noise-presence): not tested")
            continue
        got = _sigma(r, Check("scratch"))
        if got is None:
            c.fail(f"{w}: noise scale cannot be recomputed")
            continue
        sigma, layers, experts = got
        rs = _info(r).get("row_sums")
        if not isinstance(rs, list) or len(rs) != layers:
            c.fail(f"{w}: row_sums missing or not {layers} values")
            continue
        if layers < 2:
            c.note(f"{w}: one layer: nothing to compare")
            continue
        try:
            v = [float(x) for x in rs]
        except (TypeError, ValueError):
            c.fail(f"{w}: row_sums not numeric")
            continue
        mean = sum(v) / layers
        # Each row is N*s plus the sum of E noise coordinates, plus rounding error: none with mass-preserving
        # rounding (every sequence's row sums to s exactly); with per-sequence rounding about E/12 per
        # sequence (N estimated from the rows); with a rounded float sum E/12 in all.
        rounding = str(r["dp"].get("rounding", "per-sequence"))
        scale = float(r["dp"].get("scale", 1.0) or 1.0)
        n_hat = max(mean / scale, 0.0)
        extra = {"mass-preserving": 0.0, "sum": experts / 12.0}.get(rounding, n_hat * experts / 12.0)
        stat = sum((x - mean) ** 2 for x in v) / (experts * sigma**2 + extra)
        # one-sided: rows that disagree more than the noise allows mean inconsistent weighting. Too little
        # dispersion is not tested here (row sums are integers, so equal rows happen; missing noise is what
        # noise-presence tests on the canaries).
        p = float(_st.chi2.sf(stat, layers - 1))
        tested += 1
        figs.setdefault(r["seq"], {}).update({"row_sum_stat": stat, "row_sum_p": p})
        msg = f"{w}: dispersion {stat:.3g} on {layers - 1} dof, p = {p:.3g}"
        if p < alpha:
            c.fail(msg + f" < {alpha:.2g}: rows do not estimate one count")
        else:
            c.note(msg)
    if tested == 0 and c.status != "fail":
        c.skip("no router-stats release to test")
    return c


def _check_row_noise(run: _Run, figs: dict[int, dict[str, Any]]) -> Check:
    c = Check(ROW_NOISE)
    rels = []
    for r in run.stats_releases:
        got = _sigma(r, Check("scratch")) if isinstance(r.get("dp"), dict) else None
        rs = _info(r).get("row_sums")
        if got is None or not isinstance(rs, list) or len(rs) != got[1]:
            continue  # noise-presence / row-sums report a release without usable parameters or row sums
        if str(r["dp"].get("rounding", "per-sequence")) != "mass-preserving":
            c.note(f"{_where(COORDINATOR, r)}: rounding {r['dp'].get('rounding')!r}: rows also carry rounding error "
                   "(the test stays valid, with less power)")
        rels.append((_where(COORDINATOR, r), r["seq"], rs, math.sqrt(got[2]) * got[0]))
    findings, notes, per = check_row_noise(rels)
    for seq, f in per.items():
        figs.setdefault(seq, {}).update(f)
    for m in notes:
        c.note(m)
    for m in findings:
        c.fail(m)
    if not rels and c.status != "fail":
        c.skip("no router-stats release with row sums to test")
    return c


def _check_canary_positions(run: _Run) -> Check:
    c = Check(POSITIONS)
    findings, notes = check_canary_positions(run.stats_releases, {n: lf.entries for n, lf in run.parties.items()})
    for m in notes:
        c.note(m)
    for m in findings:
        c.fail(m)
    if not run.stats_releases:
        c.skip("no router-stats releases")
    return c


def _check_min_parties(run: _Run) -> Check:
    c = Check("min-parties")
    m = run.setting("min-parties", c)
    if not isinstance(m, int) or isinstance(m, bool):
        c.skip(f"privacy.min-parties not recorded ({m!r})")
        return c
    for r in run.releases:
        n = len(_included(r))
        if n < m:
            c.fail(f"{_where(COORDINATOR, r)}: {n} parties included < min-parties {m}")
    if c.status == "pass":
        c.note(f"{len(run.releases)} releases, each with >= {m} parties")
    return c


# ------------------------------------------------------------------------------------------------ canaries
def _read_canaries(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return list(dict.fromkeys(s.strip() for s in text.splitlines() if s.strip()))


def _resolve(p: str, run_dir: Path) -> Path:
    q = Path(p).expanduser()
    return q if q.is_absolute() or q.exists() else run_dir / q


def _node_canaries(run: _Run, c: Check) -> dict[str, list[str]]:
    """Per party: its canary strings from ``<data-path>/canaries.txt`` named by ``nodes/node-*.toml``."""
    node_to_party = {str(rec.get("node")): str(p) for p, rec in run.run_parties.items() if isinstance(rec, dict)}
    out: dict[str, list[str]] = {}
    for toml in sorted((run.dir / "nodes").glob("node-*.toml")):
        try:
            node_cfg = tomllib.loads(toml.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise AuditInputError(f"{toml}: unparsable node config: {exc}") from exc
        dp = node_cfg.get("data-path")
        if not isinstance(dp, str) or not dp:
            continue
        d = _resolve(dp, run.dir)
        f = (d if d.is_dir() else d.parent) / "canaries.txt"
        if not f.is_file():
            continue
        node = toml.stem[len("node-"):]
        party = str(node_cfg.get("party-name") or node_cfg.get("party") or node_to_party.get(node) or toml.stem)
        try:
            out[party] = _read_canaries(f)
        except (OSError, UnicodeDecodeError) as exc:
            c.fail(f"{party}: canary list unreadable ({exc})")
    return out


def _scan_files(root: Path, canaries: Sequence[str]) -> list[tuple[str, str]]:
    """``(relative path, canary)`` for every file under ``root`` except ``work/`` that contains a canary
    (as UTF-8 or as its JSON-escaped form). Streams each file; never follows symlinks."""
    forms: dict[bytes, str] = {}
    for s in canaries:
        forms.setdefault(s.encode("utf-8"), s)
        forms.setdefault(json.dumps(s)[1:-1].encode("ascii"), s)
    pat = re.compile(b"|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True)))
    overlap = max(len(f) for f in forms) - 1
    hits: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here == root:
            dirnames[:] = [d for d in dirnames if d != "work"]
        dirnames.sort()
        for fn in sorted(filenames):
            p = here / fn
            if p.is_symlink() or not p.is_file():
                continue
            found: set[str] = set()
            with open(p, "rb") as fh:
                tail = b""
                while chunk := fh.read(SCAN_CHUNK):
                    buf = tail + chunk
                    found.update(forms[m.group(0)] for m in pat.finditer(buf))
                    tail = buf[-overlap:] if overlap else b""
            rel = p.relative_to(root).as_posix()
            hits += [(rel, s) for s in sorted(found)]
    return hits


def _check_canaries(run: _Run) -> Check:
    c = Check("canaries")
    per_party = _node_canaries(run, c)
    cfg_path = _flat_get(run.config, "data.canary-file")
    if cfg_path is None:
        cfg_path = _flat_get(run.config, "data.canaries")  # a run recorded before the key was renamed
    if run.canaries_arg is not None:
        source, strings = str(run.canaries_arg), _read_canaries(run.canaries_arg)
    elif isinstance(cfg_path, str) and cfg_path:
        f = _resolve(cfg_path, run.dir)
        if not f.is_file():
            c.fail(f"data.canary-file = {cfg_path}: canary list not found here (pass --canaries FILE)")
            return c
        source, strings = str(f), _read_canaries(f)
    elif per_party:
        source = "canaries.txt of " + ", ".join(sorted(per_party))
        strings = list(dict.fromkeys(s for v in per_party.values() for s in v))
    else:
        c.skip("no canary list (no --canaries, data.canary-file or party canaries.txt)")
        return c
    if not strings:
        c.skip(f"{source}: the canary list is empty")
        return c
    c.note(f"{len(strings)} canaries from {source}")
    for rel, s in _scan_files(run.dir, strings):
        c.fail(f"{rel}: contains canary {_sha_prefix(s)}")
    for name, lf in run.parties.items():
        for e in lf.entries:
            if e.get("direction") != "out":
                continue
            scan = _info(e).get("canary_scan")
            w = _where(lf, e)
            if not isinstance(scan, dict):
                if e.get("verdict") == "accepted":
                    c.fail(f"{w}: no canary scan recorded for a message that left")
                else:
                    c.note(f"{w}: no canary scan; the guard blocked it (see no-blocked)")
                continue
            hits, n = scan.get("hits"), scan.get("strings")
            if hits != 0:
                if e.get("verdict") == "accepted":
                    c.fail(f"{w}: canary scan found {hits!r} hits in a message that left")
                else:
                    c.note(f"{w}: canary scan found {hits!r} hits; the guard blocked it (see no-blocked)")
            if name in per_party and n != len(per_party[name]):
                c.fail(f"{w}: scanned for {n!r} canaries, {name} has {len(per_party[name])}")
    return c


def _check_server_files(run: _Run) -> Check:
    c = Check("server-files")
    findings, notes = check_server_files(run.dir, run.meta, _info(run.start).get("mode"))
    for f in findings:
        c.fail(f)
    for n in notes[:20]:
        c.note(n)
    if c.status == "pass":
        c.note("metrics.jsonl, run.json, the report and every other server-side file fit their schemas")
    return c


def _check_masks(run: _Run) -> Check:
    c = Check("mask-uniformity")
    findings, notes = check_masks({name: lf.entries for name, lf in run.parties.items()})
    for f in findings:
        c.fail(f)
    for n in notes:
        c.note(n)
    return c


def _from(c: Check, found: tuple[list[str], list[str]], skip: str | None = None) -> Check:
    """Fill ``c`` from a ``(findings, notes)`` pair of a check module (``skip``: nothing to check)."""
    for f in found[0]:
        c.fail(f)
    for n in found[1]:
        c.note(n)
    if skip is not None:
        c.skip(skip)
    return c


def _warn(c: Check, found: tuple[list[str], list[str]]) -> Check:
    """Fill ``c`` from a ``(warnings, notes)`` pair: its findings warn, they do not fail the verdict."""
    for w in found[0]:
        c.warn(w)
    for n in found[1]:
        c.note(n)
    return c


# ------------------------------------------------------------------------------------------------- entry
def audit_run(run_dir: str | os.PathLike[str], party_ledgers: Sequence[str | os.PathLike[str]] | None = None,
              canaries: str | os.PathLike[str] | None = None) -> AuditResult:
    """Audit the run in ``run_dir`` (see the module docstring); writes nothing.

    ``party_ledgers``: paths of the party ledgers to audit (each with its ``.pub`` next to it); default all
    ``work/*/ledger/*.jsonl``. ``canaries``: a canary list file (one string per line) overriding the run's.
    Raises :class:`AuditInputError` when the run cannot be audited at all.
    """
    run = _Run(Path(run_dir), party_ledgers, canaries)
    figs: dict[int, dict[str, Any]] = {}
    eps_check, table = _check_epsilon(run)
    parties = {name: lf.entries for name, lf in run.parties.items()}
    budget = run.settings.get("privacy.epsilon")
    _from(eps_check, ledgers.fold_party_charges(table, ledgers.party_charges(parties), budget if isinstance(
        budget, (int, float)) else math.inf))  # epsilon: the larger of the coordinator's and the party's own
    checks = [_check_integrity(run), _check_cross(run), _check_allow_list(run), _check_blocked(run),
              _check_plaintext(run), eps_check, _check_noise(run, figs), _check_row_sums(run, figs),
              _check_row_noise(run, figs), _check_canary_positions(run),
              _check_min_parties(run), _check_canaries(run), _check_server_files(run),
              _check_masks(run), _from(Check("run-end"), ledgers.check_run_end(run.coord.entries)),
              _from(Check("coordinator-heads"), ledgers.check_heads(run.coord.entries, parties),
                    None if parties else "no party ledgers: heads cannot be checked (a ledger re-signed with the "
                    "coordinator's key is undetectable without them)"),
              _from(Check("release-coverage"), ledgers.check_coverage(run.coord.entries, parties)),
              _warn(Check(coverage.CHECK), coverage.check_schedule(run.meta, run.coord.entries))]
    assert tuple(c.name for c in checks) == CHECKS
    releases = []
    for r in run.releases:
        releases.append({"seq": r.get("seq"), "round": r.get("round"), "phase": r.get("phase"),
                         "type": r.get("payload_type"), "mode": _info(r).get("mode"),
                         "included": _included(r), "dropped": _info(r).get("dropped", []),
                         "dp": r.get("dp") is not None, "z_eff": _z_eff(r, None), **figs.get(r.get("seq"), {})})
    paths = {lf.name: str(lf.path) for lf in run.ledgers}
    name = run.meta.get("name")
    run_name = name if isinstance(name, str) and _RUN_NAME.match(name) else run.dir.name
    flower_id = run.meta.get("run_id")
    return AuditResult(run.dir, run_name, checks, paths, run.settings, table, releases,
                       flower_run_id=str(flower_id) if flower_id else None)
