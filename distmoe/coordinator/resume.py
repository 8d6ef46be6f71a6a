"""Crash and resume (``docs/operations.md``, Resume): continue an interrupted run in its own directory.

Resume points (``RunContext.checkpoint_due``: every ``checkpoint.every``-th round, each phase's last, every
DP-charged round) are checkpoints holding the global model *and* the coordinator state
(``distmoe.coordinator.state``). With ``run.resume = <run dir>`` a new coordinator process refuses a
completed run or a config that differs in a key outside ``RESUME_MAY_CHANGE`` (the keys declared ``resume=True``
in :mod:`distmoe.config`; ``check_resumable``,
also called by ``distmoe simulate --resume`` before Flower starts), takes the newest checkpoint that
verifies (a corrupted or truncated one is moved aside with a warning in ``run.json`` and the log, and
the previous one is used: ``restore``), reopens the ledger with the run's own coordinator key (chain and
every signature verified on open, a torn tail truncated with a warning: ``reopen_ledger``), checks that
the rebuilt allow-list equals the one signed at ``run-start`` and appends a ``run-resume`` entry
(``append_resume_entry``), and runs a fresh secure-aggregation setup (epoch = number of resumes)
starting at the next round. The model and state fall back together; privacy does not: the server
accountants (``privacy/ledger.json``) and the ledger are never rolled back (``restore_accountants``),
so a release of a round lost in the crash stays charged. The rounds after the resume point are lost; their
``metrics.jsonl`` lines move to ``metrics.lost.jsonl``.

Must not: import ``flwr``, or change anything before every check that can refuse has passed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from distmoe.checkpoint import resumable
from distmoe.config import DEFAULTS, RENAMED, RESUME_MAY_CHANGE, RETIRED, RunConfig
from distmoe.coordinator import expand
from distmoe.coordinator.context import RunContext
from distmoe.coordinator.errors import RunFailed
from distmoe.coordinator.secagg import SecureRounds
from distmoe.coordinator.start import read_checkpoint, verify_weights
from distmoe.coordinator.state import RoundState, StateError, from_checkpoint
from distmoe.io import sanitize, write_text_atomic
from distmoe.ledger import (
    Ledger,
    LedgerError,
    TornLedgerWarning,
    canonical_json,
    load_signing_key,
    public_key_hex,
    verify_ledger,
)
from distmoe.model.adapters import ServerModel
from distmoe.rundir import MissingRunFile, RunDir, RunFileError, read_json

REFUSED = "config key 'run.resume'"
REASON_MAX = 80  # the audit's bound on a string in run.json's ``resumes`` (distmoe.audit.schemas.SHORT_MAX)


@dataclass(frozen=True)
class Restored:
    """What a resume continues from: the model in the checkpoint's shape, the round state, and where it came from
    (checkpoint path relative to the run directory, round, trainable hash)."""

    model: ServerModel
    state: RoundState
    resumed_from: dict


def config_differences(before: Mapping[str, object], after: Mapping[str, object]) -> dict[str, tuple]:
    """Keys outside ``RESUME_MAY_CHANGE`` whose values differ: ``{key: (before, after)}``. Values are
    compared as ``run.json`` stores them (JSON, non-finite as null); a key unknown before counts as a
    difference only if the new value is not its default. A run recorded before a key was renamed is read
    under the new name; keys removed since (``RETIRED``) are not compared."""
    out = {}
    before = {RENAMED.get(k, k): v for k, v in before.items() if k in RENAMED or k not in RETIRED}
    now = json.loads(json.dumps(sanitize(dict(after))))
    for k in sorted(set(before) | set(now)):
        if k in RESUME_MAY_CHANGE:
            continue
        a = before[k] if k in before else json.loads(json.dumps(sanitize(DEFAULTS.get(k))))
        if a != now.get(k):
            out[k] = (a, now.get(k))
    return out


def check_resumable(run_dir: Path, cfg: RunConfig) -> dict:
    """The interrupted run's record if ``cfg`` may resume the run in ``run_dir``; else ``RunFailed`` naming
    why (no run record, already completed, a config key that matters changed, a ledger that does not verify)."""
    run_dir = Path(run_dir)
    where = Path(cfg.run.resume)
    if where.resolve() != run_dir.resolve():
        raise RunFailed(f"{REFUSED}: value {str(where)!r} is not the run directory {run_dir} this coordinator writes")
    files = RunDir(run_dir)
    path = files.record
    try:
        prev = read_json(path, "the run record")
    except MissingRunFile:
        raise RunFailed(f"{REFUSED}: {path} does not exist: {where} is not a distmoe run directory") from None
    except RunFileError as exc:
        raise RunFailed(f"{REFUSED}: {path} {exc.why}") from None
    if not isinstance(prev, dict) or not prev.get("run_id") or not isinstance(prev.get("config"), dict):
        raise RunFailed(f"{REFUSED}: {path} is not a distmoe run record (no run_id or config)")
    if prev.get("status") == "completed":
        raise RunFailed(f"{REFUSED}: run {prev['run_id']} in {where} already completed; there is nothing to "
                        "resume (start a new run)")
    changed = config_differences(prev["config"], cfg.as_flat())
    if changed:
        raise RunFailed(f"{REFUSED}: the config differs from the interrupted run's in "
                        + "; ".join(f"{k} (was {a!r}, now {b!r})" for k, (a, b) in changed.items())
                        + f"; a resumed run may change only {', '.join(sorted(RESUME_MAY_CHANGE))}")
    lpath = files.ledger
    if ledger_opened(lpath):  # else the interrupted session never opened it: the resume starts the wire afresh
        res = verify_ledger(lpath, coordinator_key(run_dir))
        errors = [e for e in res.errors if "torn trailing line" not in e]
        if errors:
            raise RunFailed(f"{REFUSED}: the coordinator ledger does not verify ({'; '.join(errors[:3])}); a chain "
                            "that cannot be vouched for is never extended")
    return prev


def ledger_opened(lpath: Path) -> bool:
    """Whether the coordinator ledger at ``lpath`` holds a complete entry. A missing file, or one whose first line
    never completed (the interrupted session died in its first append, the run-start entry, which is durable before
    anything is sent), was never opened: the resume starts the wire afresh (``distmoe.coordinator.plane.start``)."""
    try:
        with lpath.open("rb") as fh:
            return fh.readline().endswith(b"\n")
    except FileNotFoundError:
        return False


def coordinator_key(run_dir: Path):
    """The run's own coordinator signing key, checked against the published ``.pub``."""
    files = RunDir(run_dir)
    kpath = files.ledger_key
    try:
        key = load_signing_key(kpath)
    except (OSError, ValueError, TypeError) as exc:
        raise RunFailed(f"{REFUSED}: the coordinator key {kpath} cannot be loaded ({exc}); the ledger chain can "
                        "only be continued with the key that signed it") from None
    pub = files.ledger_pub
    if not pub.exists() or pub.read_text().strip() != public_key_hex(key):
        raise RunFailed(f"{REFUSED}: {kpath} is not the key published in {pub}")
    return key


def begin(co: RunContext) -> tuple[str, int]:
    """Take over the interrupted run's record (refusals change nothing); returns its run id and this resume's
    epoch (the number of resumes so far)."""
    prev = check_resumable(co.run_dir, co.cfg)
    run_id = str(prev["run_id"])
    resumes = list(prev.get("resumes") or [])
    epoch = len(resumes) + 1
    co.record.replace(prev)
    co.record.update(status="running", finished=None, error=None,
                     resumes=[*resumes, {"epoch": epoch, "session": co.session_id, "time": time.time(),
                                         "interrupted_status": prev.get("status"),
                                         "interrupted_error": short_reason(prev.get("error"))}])
    why = f"{prev.get('status')}" + (f": {prev['error']}" if prev.get("error") else "")
    name = co.cfg.run.name or co.run_dir.name
    co.say(f"resuming run {name} in {co.run_dir} (Flower run id {run_id}, resume {epoch}, session "
           f"{co.session_id}; the interrupted session ended {why})")
    return run_id, epoch


def short_reason(error: object) -> str | None:
    """The interrupted session's error as ``run.json``'s ``resumes`` may hold it: one line of printable ASCII (any
    other character a space or ``?``) of at most ``REASON_MAX`` characters, keeping its start (``...`` marks a cut).
    The whole error is in the resume's log line and the interrupted session's own log."""
    if error is None:
        return None
    text = " ".join("".join(ch if 32 <= ord(ch) < 127 else " " if ch.isspace() else "?" for ch in str(error)).split())
    return text if len(text) <= REASON_MAX else text[:REASON_MAX - 3].rstrip() + "..."


def restore(co: RunContext) -> Restored | None:
    """Model and coordinator state from the newest checkpoint that verifies (older ones on failure), recorded in
    ``metrics.jsonl`` and ``run.json``. None: the interrupted session died before its first checkpoint and before
    it contacted anyone (no ledger), so the run simply starts at round 0."""
    root = co.files.checkpoints
    path, notes = resumable(root)
    for text in notes:
        co.warn(text)
    if path is None and not ledger_opened(co.files.ledger):
        co.warn(f"no checkpoint in {root} and no ledger: the interrupted session died before round 0 was saved; "
                "the run starts from round 0")
        return None
    if path is None:
        raise RunFailed(f"{REFUSED}: no usable checkpoint in {root} (none verifies against its manifest): the run "
                        "cannot resume")
    manifest, weights, extra, state = read_checkpoint(path, REFUSED)
    try:
        s = from_checkpoint(state, weights, extra, run_id=co.run_id, where=str(path))
        model = expand.replay(co.model, s.expansions)  # the checkpoint's shape (retention.expand-experts)
    except StateError as exc:
        raise RunFailed(str(exc)) from None
    except ValueError as exc:  # its recorded expert expansions do not fit this model
        raise RunFailed(f"{path}: {exc}") from None
    verify_weights(weights, manifest, model.tspec, model.base_fingerprint, str(path))
    resumed_from = {"checkpoint": str(path.relative_to(co.run_dir)), "round": s.round,
                    "trainable_hash": manifest.get("trainable_hash")}
    lost = set_aside_lost_metrics(co.run_dir, s.round)
    co.metrics.append({"event": "run_resume", "run_id": co.run_id, "session": co.session_id, "epoch": co.epoch,
                       "from_round": s.round, "checkpoint": resumed_from["checkpoint"],
                       "lost_metric_lines": lost, "warnings": list(co.resume_warnings)})
    resumes = co.record.get("resumes") or [{}]
    co.record.update(resumes=[*resumes[:-1], {**resumes[-1], **resumed_from}])
    co.say(f"resume: checkpoint {resumed_from['checkpoint']} (round {s.round}/{co.cfg.schedule.total_rounds}, "
           f"anchor v{s.anchor_versions}); continuing with round {s.round + 1}")
    return Restored(model, s, resumed_from)


def set_aside_lost_metrics(run_dir: Path, last_round: int) -> int:
    """Move the ``metrics.jsonl`` lines of rounds after ``last_round`` (the round lost in the crash) to
    ``metrics.lost.jsonl``; returns how many moved."""
    path = RunDir(run_dir).metrics
    if not path.exists():
        return 0
    keep, lost = [], []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if not line.endswith("\n"):
            continue  # a torn tail from the crash
        try:
            rnd = json.loads(line).get("round")
        except (ValueError, AttributeError):
            rnd = None
        (lost if isinstance(rnd, int) and rnd > last_round else keep).append(line)
    if lost:  # first kept aside durably, then removed from the log (a crash in between only duplicates)
        with RunDir(run_dir).metrics_lost.open("a", encoding="utf-8") as fh:
            fh.writelines(lost)
            fh.flush()
            os.fsync(fh.fileno())
    write_text_atomic(path, "".join(keep))
    return len(lost)


def reopen_ledger(co: RunContext, lpath: Path) -> tuple[Ledger, dict, list[dict]]:
    """The interrupted run's ledger, opened with its own key (chain and signatures verified); with its
    run-start entry and all entries."""
    key = coordinator_key(co.run_dir)
    if not lpath.exists():
        raise RunFailed(f"{REFUSED}: the coordinator ledger {lpath} is missing")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TornLedgerWarning)
        try:
            led = Ledger(lpath, key)
        except LedgerError as exc:
            raise RunFailed(f"{REFUSED}: the coordinator ledger does not verify ({exc}); a chain that cannot be "
                            "vouched for is never extended") from None
    for w in caught:
        if issubclass(w.category, TornLedgerWarning):
            co.warn(str(w.message))
    entries = [json.loads(x) for x in lpath.read_text(encoding="ascii").splitlines() if x]
    start = entries[0] if entries else {}
    if start.get("phase") != "run-start" or start.get("payload_type") != "policy":
        raise RunFailed(f"{REFUSED}: {lpath} does not begin with the run-start policy entry")
    return led, start, entries


def append_resume_entry(co: RunContext, ledger: Ledger, digest: str, policy: dict, start: dict,
                        entries: list[dict], n_nodes: int) -> None:
    """Check the rebuilt allow-list (``digest``) against the signed one, then append ``run-resume``."""
    if digest != start.get("sha256"):
        old = (start.get("info") or {}).get("policy") or {}
        diff = sorted(k for k in set(old) | set(policy) if old.get(k) != policy.get(k))
        raise RunFailed(f"{REFUSED}: the allow-list for the {n_nodes} parties connected now differs from the one "
                        f"signed at run-start (in {', '.join(diff[:6])}): a resumed run needs the same number of "
                        f"parties ({(co.record.get('privacy') or {}).get('n_parties', '?')} in the run) and the "
                        "same model")
    seq, head = ledger.head()
    info = {"session": co.session_id, "epoch": co.epoch, **(co.resumed_from or {}),
            "previous_head": {"seq": seq, "hash": head}, "policy_sha256": digest,
            "dp_releases": dp_release_counts(entries), "warnings": list(co.resume_warnings)}
    blob = canonical_json(info).encode("ascii")
    ledger.append(run=co.run_id, round=co.s.round, phase="run-resume", direction="out",
                     payload_type="run-resume", keys=[], shapes={}, bytes=len(blob),
                     sha256=hashlib.sha256(blob).hexdigest(), verdict="accepted", peer="all", info=info)


def dp_release_counts(entries: list[dict]) -> dict[str, int]:
    """DP releases per party in the ledger (what the audit will charge)."""
    out: dict[str, int] = {}
    for e in entries:
        if str(e.get("payload_type", "")).startswith("release:") and isinstance(e.get("dp"), dict):
            for party in (e.get("info") or {}).get("included") or []:
                out[str(party)] = out.get(str(party), 0) + 1
    return out


def restore_accountants(secure: SecureRounds, say, entries: list[dict]) -> None:
    """The server accountants of the interrupted run (into ``secure``); each must hold every DP release in the
    ledger."""
    counts = dp_release_counts(entries)
    if not counts and not secure.files.accounts.exists():
        say("resume: no accountant state yet (the interrupted session died before any release)")
        return
    accs = secure.restore_accountants()
    for party, n in sorted(counts.items()):
        have = len(accs[party].events) if party in accs else 0
        if have < n:
            raise RunFailed(f"{REFUSED}: {secure.files.accounts} holds {have} releases of party {party}, the "
                            f"ledger {n}: the accountant lags the ledger and the run cannot resume without "
                            "under-counting privacy")
    spent = ", ".join(f"{k} {a.primary_epsilon():.3f}" for k, a in sorted(accs.items()))
    say(f"resume: privacy accountants carried over (epsilon spent so far: {spent or 'none'})")
