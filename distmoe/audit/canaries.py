"""The audit's ``canaries`` check: no party's canary string in any server-side file, every message scanned.

Owns: the canary lists (``--canaries``, else ``data.canary-file``, else each party's ``canaries.txt`` found via
``RUN/nodes/node-*.toml``), the streaming scan of every file under the run directory except ``work/`` (raw and
JSON-escaped forms, never following symlinks), and the check that every accepted outbound party entry records a
scan with 0 hits over the party's full list.

Must not: print or record a canary string (only a SHA-256 prefix), read anything of a party's data directory but
``canaries.txt``, or write anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path

from distmoe.audit.result import AuditInputError, Check
from distmoe.audit.run import Run, flat_get, info_of, loc
from distmoe.rundir.layout import WORK_DIR

SCAN_CHUNK = 1 << 22


def _sha_prefix(s: str) -> str:
    return "sha256:" + hashlib.sha256(s.encode("utf-8")).hexdigest()[:12]


def _read_canaries(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return list(dict.fromkeys(s.strip() for s in text.splitlines() if s.strip()))


def _resolve(p: str, run_dir: Path) -> Path:
    q = Path(p).expanduser()
    return q if q.is_absolute() or q.exists() else run_dir / q


def _node_canaries(run: Run, c: Check) -> dict[str, list[str]]:
    """Per party: its canary strings from ``<data-path>/canaries.txt`` named by ``nodes/node-*.toml``."""
    node_to_party = {str(rec.get("node")): str(p) for p, rec in run.run_parties.items() if isinstance(rec, dict)}
    out: dict[str, list[str]] = {}
    for toml in run.layout.node_files():
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
            dirnames[:] = [d for d in dirnames if d != WORK_DIR]
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


def check_canaries(run: Run) -> Check:
    c = Check("canaries")
    per_party = _node_canaries(run, c)
    cfg_path = flat_get(run.config, "data.canary-file")
    if cfg_path is None:
        cfg_path = flat_get(run.config, "data.canaries")  # a run recorded before the key was renamed
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
            scan = info_of(e).get("canary_scan")
            w = loc(lf, e)
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
