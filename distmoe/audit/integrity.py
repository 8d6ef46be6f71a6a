"""The audit's checks of the ledgers as records: intact, anchored both ways, within the allow-list, masked.

Owns: ``ledger-integrity`` (chains, signatures, pinned keys, each party ledger against its anchored head),
``cross-check`` (each anchored reply is what the party logged as sent), ``allow-list`` (every entry against the
run's signed policy), ``no-blocked``, ``no-plaintext`` and ``min-parties``; and ``pins`` (where each party's
ledger key is pinned: the coordinator's ``key-advert`` entries and ``run.json``), which the receipt check uses
too. Each ``check_*`` takes the loaded :class:`~distmoe.audit.run.Run` and returns its
:class:`~distmoe.audit.result.Check`.

Must not: import ``flwr``, read models or party data, or write anything.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from distmoe.audit.result import Check
from distmoe.audit.run import COORDINATOR, Run, flat_get, included_of, info_of, loc
from distmoe.ledger import canonical_json, verify_against_anchor, verify_ledger
from distmoe.rundir.layout import RUN_RECORD

STRUCTURAL = ("policy", "run-end", "run-resume", "ledger_head")
RELEASE_TYPES = ("release:router-stats", "release:model-update", "release:rl-update", "release:eval")
PLAINTEXT_TYPES = ("model-update", "router-stats", "eval-reply")  # unmasked arrays (plaintext mode only)
HEAD_KEYS = {"node", "seq", "hash"}


def check_integrity(run: Run) -> Check:
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
    anchored = latest_anchors(run.coord.entries)
    pinned = pins(run)
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
        if not pinned.get(name):
            c.fail(f"{name}: ledger key is not pinned (no key-advert in the coordinator ledger, none in run.json)")
        for where, key in pinned.get(name, []):
            if key != lf.pub:
                c.fail(f"{name}: {rel(lf.pub_path)} is not the key pinned in {where} (key substituted)")
        if not errors:
            c.note(f"{name}: {len(lf.entries)} entries verify" + (f", anchored head seq {head[0]} matches"
                                                                   if head else ""))
    for name, plist in pinned.items():  # parties whose ledger is not here: the pins must still agree
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


def latest_anchors(entries: Iterable[Mapping[str, Any]]) -> dict[str, tuple[int, str]]:
    out: dict[str, tuple[int, str]] = {}
    for e in entries:
        a = e.get("anchor")
        if isinstance(a, dict) and isinstance(a.get("seq"), int) and isinstance(a.get("hash"), str):
            out[str(a.get("node"))] = (a["seq"], a["hash"])
    return out


def pins(run: Run) -> dict[str, list[tuple[str, str]]]:
    """Per party: where its ledger key is pinned and the key (coordinator key-adverts, then run.json)."""
    pins: dict[str, list[tuple[str, str]]] = {}
    for e in run.coord.entries:
        if e.get("payload_type") == "key-advert" and e.get("direction") == "in" and isinstance(e.get("peer"), str):
            key = info_of(e).get("ledger_public_key")
            pins.setdefault(e["peer"], []).append((f"coordinator#{e.get('seq')} key-advert", str(key)))
    for name, rec in run.run_parties.items():
        if isinstance(rec, dict) and rec.get("ledger_public_key") is not None:
            pins.setdefault(str(name), []).append((RUN_RECORD, str(rec["ledger_public_key"])))
    return pins


def check_cross(run: Run) -> Check:
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
                c.fail(f"{loc(run.coord, e)}: accepted reply from {peer} carries no ledger head")
            continue
        node, seq, h = str(a.get("node")), a.get("seq"), a.get("hash")
        if pt != "ledger_head" and e.get("peer") not in (None, node):
            c.fail(f"{loc(run.coord, e)}: anchor names {node} but the reply is from {e.get('peer')}")
        if isinstance(seq, int):
            if seq < last.get(node, -1):
                c.fail(f"{loc(run.coord, e)}: anchored head of {node} went back from seq {last[node]} to {seq}")
            last[node] = max(seq, last.get(node, -1))
        lf = run.parties.get(node)
        if lf is None:
            unverifiable.add(node)
            continue
        pe = lf.by_seq.get(seq) if isinstance(seq, int) else None
        if pe is None:
            c.fail(f"{loc(run.coord, e)}: {node} has no entry at anchored seq {seq} (truncated)")
            continue
        if pe.get("hash") != h:
            c.fail(f"{loc(run.coord, e)}: {node}#{seq} does not have the anchored hash (rewritten)")
            continue
        checked += 1
        if pt == "ledger_head":  # an explicit anchor: no reply to compare with
            continue
        if pe.get("direction") != "out":
            c.fail(f"{loc(run.coord, e)}: {node}#{seq} is not an outbound entry")
        if pe.get("payload_type") != pt:
            c.fail(f"{loc(run.coord, e)}: {node}#{seq} logged {pe.get('payload_type')!r} as sent")
        if pe.get("sha256") != e.get("sha256"):
            c.fail(f"{loc(run.coord, e)}: what arrived differs from what {node} logged as sent (sha256)")
    for node in sorted(unverifiable):
        c.note(f"{node}: ledger not available here; its anchors are not cross-checked")
    if not run.parties:
        c.skip("no party ledgers to cross-check")
    else:
        c.note(f"{checked} anchored entries match the party ledgers")
    return c


def check_allow_list(run: Run) -> Check:
    c = Check("allow-list")
    policy = _policy(run, c)
    n = 0
    for lf in run.ledgers:
        for e in lf.entries:
            pt = e.get("payload_type")
            keys = e.get("keys") if isinstance(e.get("keys"), list) else []
            shapes = e.get("shapes") if isinstance(e.get("shapes"), dict) else {}
            w = loc(lf, e)
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


def _policy(run: Run, c: Check) -> dict[str, dict[str, Any]] | None:
    """The allow-list from the coordinator's run-start entry, checked against its recorded digest.

    Per payload type: ``keys`` (allowed), ``required`` (default: all of ``keys``, i.e. set equality),
    optional ``keys_pattern`` (``"prefix*"``: further allowed keys), ``shapes`` (fixed-shape arrays), optional
    ``shape_choices`` (arrays whose shape is one of a list: a run with expert expansion) and
    ``max_bytes``, as ``distmoe.wire.server_guard.build_policy`` writes them.
    """
    e0 = run.start
    pol = info_of(e0).get("policy")
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


def check_blocked(run: Run) -> Check:
    c = Check("no-blocked")
    for lf in run.ledgers:
        for e in lf.entries:
            v = e.get("verdict")
            if v != "accepted":
                reason = v[len("rejected:"):].strip() if isinstance(v, str) and v.startswith("rejected:") else repr(v)
                c.fail(f"{loc(lf, e)}: blocked: {reason}")
    if c.status == "pass":
        c.note(f"every entry of {len(run.ledgers)} ledgers was accepted")
    return c


def check_plaintext(run: Run) -> Check:
    c = Check("no-plaintext")
    mode = info_of(run.start).get("mode")
    if mode == "plaintext":
        c.fail("plaintext-mode run: the run-start entry records mode 'plaintext'")
    elif mode != "secagg":
        c.fail(f"the run-start entry records no secure-aggregation mode (mode {mode!r})")
    cfg_mode = flat_get(run.config, "privacy.mode")
    if cfg_mode == "plaintext":
        c.fail("plaintext-mode run: run.json config privacy.mode = 'plaintext'")
    for e in run.releases:
        m = info_of(e).get("mode")
        if m == "plaintext":
            c.fail(f"plaintext-mode release: {loc(run.coord, e)}")
        elif m != "secagg":
            c.fail(f"{loc(run.coord, e)}: release records no secure-aggregation mode (mode {m!r})")
    for lf in run.ledgers:
        for e in lf.entries:
            if e.get("payload_type") in PLAINTEXT_TYPES:
                c.fail(f"plaintext payload: {loc(lf, e)}")
    if c.status == "pass":
        c.note(f"mode secagg; {len(run.releases)} releases, all masked")
    return c


def check_min_parties(run: Run) -> Check:
    c = Check("min-parties")
    m = run.setting("min-parties", c)
    if not isinstance(m, int) or isinstance(m, bool):
        c.skip(f"privacy.min-parties not recorded ({m!r})")
        return c
    for r in run.releases:
        n = len(included_of(r))
        if n < m:
            c.fail(f"{loc(COORDINATOR, r)}: {n} parties included < min-parties {m}")
    if c.status == "pass":
        c.note(f"{len(run.releases)} releases, each with >= {m} parties")
    return c
