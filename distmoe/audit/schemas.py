"""The audit's ``server-files`` check: every file the server side of a run writes holds only what it may.

Owns: the schemas of the run directory's server-side files and the check against them
(``check_server_files(run_dir, meta, mode) -> (findings, notes)``; ``distmoe.audit.engine`` turns them
into the ``server-files`` check). What is checked:

- ``metrics.jsonl`` (and ``metrics.lost.jsonl``): every line a JSON object of a known ``event`` type with
  only that type's keys, each of its kind (a number, a count, a flag, a task or phase label of the run's
  own schedule, a closed-set string); aggregate rows only (``party`` is ``all``; per-party rows exist only
  in a plaintext-mode run, which ``no-plaintext`` fails anyway); a ``party_error`` row's ``reason`` is
  exactly the closed table's text of its ``code`` (``distmoe.wire.errors.ALL_REASONS``);
- ``run.json``: only the coordinator's record keys; ``config`` only known config keys with scalar values;
  ``parties`` only ``{node, ledger_public_key, epsilon_max}`` (the last: the cap a party declared at setup);
  the nested records with label keys and no long text;
- ``report/``: only the report's own files, ``report.md`` exactly what ``distmoe report`` renders, each PNG
  well-formed with no text chunk but Matplotlib's ``Software`` (:mod:`distmoe.audit.report_files`);
- ``tensorboard/``: only event files (``events.out.tfevents.*``) of the TensorBoard writer
  (``distmoe.report.tensorboard``), each well-formed (TFRecord framing and CRCs, ``distmoe.audit.tfevents``)
  and holding nothing but scalars whose tag is ``<event>/<key>`` of a number key of an aggregate row of that
  event type (the same schema as ``metrics.jsonl``) and whose value is that row's value at that round (as a
  32-bit float): no image, text, histogram or per-party tag, and no number that ``metrics.jsonl`` does not hold;
- any other file outside ``work/`` (the parties' side), ``ledger/``, ``audit/`` and ``keys/`` must be one
  the server writes (``config.toml``, ``nodes/*.toml``, ``privacy/``, ``anchors/``, ``checkpoints/LATEST``
  and ``checkpoints/round-<n>/``, ``flower.log`` of a simulation); anything else fails. The contents of
  checkpoints, anchors and the privacy ledger are not schema-checked here (the ``canaries`` check scans them).

Findings name the file, the line (for JSON lines) and the offending key.

Free text that remains (bounded, printable, and shown as notes): the coordinator's own warnings, anomaly
details and the error of a failed run (written from the configuration and aggregate figures only; the
``canaries`` check scans them as every other file).

Must not: import ``flwr`` or ``torch``, read party data, models or checkpoints, or write anything.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from distmoe.audit.report_files import check_report
from distmoe.config import CORRECTIONS
from distmoe.rundir import RunDir
from distmoe.rundir.layout import (
    ANCHORS,
    CHECKPOINTS,
    NODES_DIR,
    SIMULATION_DIRS,
    SIMULATION_FILES,
    UNRECORDED_DIRS,
)
from distmoe.wire.errors import ALL_REASONS
from distmoe.wire.schema import EVAL_ROUTING_KEYS, RL_METRIC_KEYS, RL_SIM_METRIC_KEYS, TRAIN_METRIC_KEYS

CHECK = "server-files"
LABEL = re.compile(r"[A-Za-z0-9_.:/*+-]{1,64}\Z")  # a task, phase, run id or node: no spaces, no sentence
TEXT_MAX = 500  # the coordinator's own sentences (warnings, anomaly details, a failed run's error)
SHORT_MAX = 80  # a string leaf of a nested run.json record
MAX_FINDINGS = 50
_HERE = RunDir(".")  # the server's own files, relative to the run directory
SERVER_FILES = re.compile("(" + "|".join([
    *(re.escape(p.as_posix()) for p in (_HERE.metrics, _HERE.metrics_lost, _HERE.record, _HERE.config,
                                        _HERE.flower_log, _HERE.accounts, _HERE.secagg_state)),
    rf"{NODES_DIR}/[A-Za-z0-9_.-]+\.toml", rf"{ANCHORS}/round-\d+\.(json|npz)", rf"{CHECKPOINTS}/LATEST",
    rf"{CHECKPOINTS}/round-\d+/.+",
    rf"{CHECKPOINTS}/corrupt-round-\d+-\d+/.+",  # a checkpoint that failed verification on resume, moved aside
]) + r")\Z")
SKIPPED_DIRS = UNRECORDED_DIRS
TB_FILE = re.compile(r"events\.out\.tfevents\.[A-Za-z0-9_.-]{1,200}\Z")
TB_EVENTS = ("train", "rl", "stats", "eval", "probe")  # distmoe.report.tensorboard.EVENTS

Kind = Callable[[Any, "_Ctx"], bool]


class _Ctx:
    def __init__(self, schedule: list[str], parties: set[str], mode: str):
        # run.json's schedule names repeated phases "sft:lookup*3"; rows carry the phase's label "sft:lookup"
        self.labels = {re.sub(r"\*\d+\Z", "", lab) for lab in schedule} | {"setup", "eval"}
        self.tasks = {t for lab in schedule for t in re.split(r"[:*]", lab)[1:2] if t}
        self.parties = parties
        self.mode = mode


def _num(v: Any, _c: _Ctx) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def _int(v: Any, _c: _Ctx) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _flag(v: Any, _c: _Ctx) -> bool:
    return isinstance(v, bool)


def _label(v: Any, _c: _Ctx) -> bool:
    return isinstance(v, str) and bool(LABEL.match(v))


def _task(v: Any, c: _Ctx) -> bool:
    return isinstance(v, str) and (v in c.tasks or v == "")


def _phase(v: Any, c: _Ctx) -> bool:
    """A phase label of the schedule (or setup/eval), optionally followed by the stage ``consistency`` or ``unmask``."""
    if not isinstance(v, str):
        return False
    head, _, tail = v.partition(" ")
    head = re.sub(r"\*\d+\Z", "", head)  # the schedule's own entries carry their round count: "sft:lookup*3"
    return head in c.labels | {"sft", "rl", "stats", "probe", "settle"} and tail in ("", "consistency", "unmask")


def _text(v: Any, _c: _Ctx) -> bool:
    return v is None or (isinstance(v, str) and len(v) <= TEXT_MAX and v.isascii() and v.isprintable())


def _one_of(*allowed: str) -> Kind:
    return lambda v, _c: v in allowed


def _list_of(kind: Kind) -> Kind:
    return lambda v, c: isinstance(v, list) and all(kind(x, c) for x in v)


def _agg_party(v: Any, c: _Ctx) -> bool:
    return v == "all" or (c.mode == "plaintext" and v in c.parties)


def _any_party(v: Any, c: _Ctx) -> bool:
    return isinstance(v, str) and (v in c.parties or bool(re.fullmatch(r"node-\d{1,20}", v)))


COMMON = {"event": _label, "time": _num}
ROUND = {"round": _int, "anchor_version": _int}
UPDATE = {**ROUND, "phase": _int, "phase_label": _phase, "task": _task, "party": _agg_party, "num_examples": _num,
          "contributors": _int, "parties": _int, "skipped": _flag,
          **{k: _num for k in (*TRAIN_METRIC_KEYS, *RL_METRIC_KEYS, *RL_SIM_METRIC_KEYS)},
          **{f"{k}_sd": _num for k in (*TRAIN_METRIC_KEYS, *RL_METRIC_KEYS)}}  # a slot's update-noise std
EVENTS: dict[str, dict[str, Kind]] = {
    "run_start": {"run_id": _label, "schedule": _list_of(_phase), "warnings": _list_of(_text)},
    "run_resume": {"run_id": _label, "session": _label, "epoch": _int, "from_round": _int, "checkpoint": _label,
                   "lost_metric_lines": _int, "warnings": _list_of(_text)},
    "train": UPDATE,
    "rl": {**UPDATE, "engine": _label, "correction": _one_of(*CORRECTIONS)},  # the run's rl.engine profile
    "stats": {**ROUND, "party": _agg_party, "task": _task, "num_sequences": _num, "parties": _int},
    "eval": {**ROUND, "phase_label": _phase, "party": _agg_party, "new_task": _task, "new_task_loss": _num,
             **{k: _num for k in EVAL_ROUTING_KEYS}},
    "party_error": {"round": _int, "phase_label": _phase, "node": _label, "party": _any_party,
                    "code": _one_of(*ALL_REASONS), "reason": _one_of(*ALL_REASONS.values())},
    "anomaly": {"round": _int, "kind": _one_of("train", "rl", "stats", "eval"), "party": _one_of("all"),
                "detail": _text},
    "round_skipped": {"round": _int, "phase_label": _phase, "detail": _text},
    # the routing probe on public prompts (distmoe.coordinator.phases.probe) and the routing-health warnings
    "probe": {**ROUND, "phase_label": _phase, "parties": _int, "disagreeing": _int, "routing_kl": _num,
              "load_cv": _num, "top1_consistency": _num, "expert_counts": _list_of(_list_of(_int))},
    "routing_warning": {"round": _int, "kind": _one_of("load_cv", "kl_rise", "probe", "settle"), "detail": _text},
    # the bias settle on public prompts after an update (distmoe.coordinator.phases.settle)
    "settle": {**ROUND, "phase_label": _phase, "parties": _int, "disagreeing": _int, "moved": _num},
    # a dynamic expert expansion (distmoe.coordinator.expand): public facts of the model's shape
    "expand": {**ROUND, "task": _task, "from": _int, "to": _int, "sources": _list_of(_list_of(_int))},
    "run_end": {"status": _one_of("completed", "failed", "stopped", "interrupted"), "rounds": _int,
                "error": _text},
}
PATTERN_KEYS = {  # event -> (key pattern, kind) for keys named after a task or an MoE layer
    "train": [(re.compile(r"route_disagree_l\d{1,4}\Z"), _num)],
    "rl": [(re.compile(r"route_disagree_l\d{1,4}\Z"), _num)],
    "eval": [(re.compile(r"(acc|loss|n|retention)/(?P<task>.+)\Z"), _num)],
}
TEXT_KEYS = {("routing_warning", "detail"),
             ("run_start", "warnings"), ("run_resume", "warnings"), ("anomaly", "detail"), ("round_skipped", "detail"),
             ("run_end", "error")}


def _key_kind(event: str, key: str, ctx: _Ctx) -> Kind | None:
    kind = COMMON.get(key) or EVENTS[event].get(key)
    if kind is not None:
        return kind
    for pat, k in PATTERN_KEYS.get(event, []):
        m = pat.match(key)
        if m and ("task" not in m.groupdict() or m.group("task") in ctx.tasks):
            return k
    return None


def _check_row(row: Any, where: str, ctx: _Ctx, out: list[str], notes: list[str]) -> None:
    if not isinstance(row, dict):
        out.append(f"{where}: not a JSON object")
        return
    event = row.get("event")
    if event not in EVENTS:
        out.append(f"{where}: key 'event': unknown event type {str(event)[:40]!r}")
        return
    for key, v in row.items():
        kind = _key_kind(event, key, ctx)
        if kind is None:
            out.append(f"{where}: key {key[:60]!r}: not a key of a {event!r} row")
        elif not kind(v, ctx):
            what = "a per-party row" if key == "party" and isinstance(v, str) and v in ctx.parties else "its kind"
            out.append(f"{where}: key {key!r}: value does not fit {what} ({type(v).__name__})"
                       if what == "its kind" else f"{where}: key 'party': {what} ({v!r}); only aggregates may be "
                                                  "written")
        elif (event, key) in TEXT_KEYS and v:
            notes.append(f"{where}: coordinator text in {key!r} ({len(str(v))} characters)")
    if event == "party_error" and row.get("code") in ALL_REASONS and row.get("reason") != ALL_REASONS[row["code"]]:
        out.append(f"{where}: key 'reason': not the closed table's text of code {row['code']!r}")


def _check_metrics(path: Path, ctx: _Ctx, out: list[str], notes: list[str]) -> None:
    raw = path.read_bytes().split(b"\n")
    for i, line in enumerate(raw, 1):
        if not line.strip():
            continue
        where = f"{path.name}:{i}"
        try:
            row = json.loads(line)
        except ValueError:
            if i == len(raw) or (i == len(raw) - 1 and raw[-1] == b""):
                notes.append(f"{where}: a torn trailing line (a crash mid-write) is ignored")
                continue
            out.append(f"{where}: not JSON")
            continue
        _check_row(row, where, ctx, out, notes)


RUN_KEYS: dict[str, Kind] = {
    "run_id": _label, "name": lambda v, c: v in ("", None) or _label(v, c), "status": _one_of(
        "running", "completed", "failed", "stopped", "interrupted"), "started": _num, "finished": _num,
    "error": _text, "schedule": _list_of(_phase), "warnings": _list_of(_text),
    "anomalies": lambda v, c: isinstance(v, list) and all(
        isinstance(a, dict) and set(a) <= {"round", "detail"} and _text(a.get("detail"), c) for a in v),
}
NESTED_KEYS = ("config", "privacy", "parties", "model", "resumes")


def _short(v: Any) -> bool:
    if isinstance(v, str):
        return len(v) <= SHORT_MAX and v.isascii() and v.isprintable()
    return v is None or isinstance(v, (bool, int, float))


def _nested(v: Any, where: str, out: list[str], depth: int = 0) -> None:
    """A nested record of run.json: label keys, and leaves that are numbers, flags or short strings."""
    if depth > 6:
        out.append(f"{where}: nested too deep")
    elif isinstance(v, dict):
        for k, x in v.items():
            if not LABEL.match(str(k)):
                out.append(f"{where}: key {str(k)[:60]!r}: not a label")
            else:
                _nested(x, f"{where}.{k}", out, depth + 1)
    elif isinstance(v, list):
        for i, x in enumerate(v[:10_000]):
            _nested(x, f"{where}[{i}]", out, depth + 1)
    elif not _short(v):
        out.append(f"{where}: a string of {len(str(v))} characters (free text) where a value belongs")


def _config_keys() -> set[str]:
    from distmoe.config import parse_run_config

    return set(parse_run_config({}).as_flat())


def _check_run_json(path: Path, meta: Mapping[str, Any], ctx: _Ctx, out: list[str], notes: list[str]) -> None:
    for key, v in meta.items():
        where = f"{path.name}: key {key!r}"
        if key in RUN_KEYS:
            if not RUN_KEYS[key](v, ctx):
                out.append(f"{where}: value does not fit its kind")
            elif key in ("error", "warnings", "anomalies") and v:
                notes.append(f"{path.name}: coordinator text in {key!r}")
        elif key == "config":
            known = _config_keys()
            for k, x in (v if isinstance(v, dict) else {}).items():
                if k not in known:
                    out.append(f"{path.name}: key 'config.{k[:60]}': not a configuration key")
                elif not _short(x) and not (isinstance(x, str) and len(x) <= TEXT_MAX and x.isprintable()):
                    out.append(f"{path.name}: key 'config.{k}': not a configuration value")
            if not isinstance(v, dict):
                out.append(f"{where}: not an object")
        elif key == "parties":
            for p, rec in (v if isinstance(v, dict) else {}).items():
                allowed = {"node", "ledger_public_key", "epsilon_max"}
                if not LABEL.match(str(p)) or not isinstance(rec, dict) or not set(rec) <= allowed:
                    out.append(f"{path.name}: key 'parties.{str(p)[:60]}': only node, ledger_public_key and "
                               "epsilon_max (the party's declared cap) may be recorded per party")
                elif not all((_num if k == "epsilon_max" else _label)(x, ctx) for k, x in rec.items()):
                    out.append(f"{path.name}: key 'parties.{p}': a value that is not a label (or, for "
                               "epsilon_max, a number)")
            if not isinstance(v, dict):
                out.append(f"{where}: not an object")
        elif key in NESTED_KEYS:
            _nested(v, f"{path.name}: key {key!r}", out)
        else:
            out.append(f"{where}: not a key of the run record")


def _f32(v: float) -> float:
    """``v`` as the 32-bit float an event file stores (beyond its range: an infinity)."""
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def _check_tensorboard(run_dir: Path, ctx: _Ctx, out: list[str]) -> None:
    """``tensorboard/``: event files only, each of aggregate scalars only (module docstring)."""
    from distmoe.audit.tfevents import EventFileError, read_scalars
    from distmoe.report.tensorboard import scalars

    tdir = RunDir(run_dir).tensorboard
    if not tdir.is_dir():
        return
    try:
        logged: set[tuple[str, int, float]] = {(t, s, _f32(v)) for t, s, v, _ in scalars(run_dir)}
    except (OSError, ValueError):
        logged = set()  # metrics.jsonl unreadable: every point below fails
    for f in sorted(tdir.rglob("*")):
        rel = f.relative_to(run_dir).as_posix()
        if f.is_dir() and not f.is_symlink():
            continue
        if f.is_symlink() or f.parent != tdir or not TB_FILE.match(f.name):
            out.append(f"{rel}: not a file the TensorBoard writer makes")
            continue
        try:
            points = read_scalars(f)
        except (OSError, EventFileError) as exc:
            out.append(f"{rel}: not an event file of aggregate scalars: {exc}")
            continue
        for tag, step, _value in points:
            event, _, key = tag.partition("/")
            kind = _key_kind(event, key, ctx) if event in TB_EVENTS and key not in (*COMMON, "party") else None
            if kind not in (_num, _int):
                out.append(f"{rel}: tag {tag[:80]!r} at step {step}: not a number key of an aggregate "
                           f"{event[:20]!r} row")
                break
            if (tag, step, _value) not in logged:
                out.append(f"{rel}: tag {tag[:80]!r} at step {step}: a value that metrics.jsonl does not hold for "
                           "that round")
                break


def _other_files(run_dir: Path, out: list[str]) -> None:
    # `distmoe simulate` keeps Flower's and Ray's state inside the run directory (FLWR_HOME with the installed
    # app bundle, HOME, TMPDIR, Ray's session) and its own simulate.json. They are the simulation's, not the
    # coordinator's: skipped here only when the run is a simulation; the canary scan still reads them.
    simulated = RunDir(run_dir).simulate_record.is_file()
    for f in sorted(run_dir.rglob("*")):
        rel = f.relative_to(run_dir)
        if rel.parts[0] in SKIPPED_DIRS or f.is_dir():
            continue
        if simulated and (rel.parts[0] in SIMULATION_DIRS or rel.as_posix() in SIMULATION_FILES):
            continue
        if f.is_symlink() or not SERVER_FILES.match(rel.as_posix()):
            out.append(f"{rel.as_posix()}: not a file the server writes")


def check_server_files(run_dir: Path, meta: Mapping[str, Any], mode: str | None) -> tuple[list[str], list[str]]:
    """``(findings, notes)`` of the server-side files of ``run_dir`` (module docstring); ``meta`` is the
    parsed ``run.json``, ``mode`` the run's privacy mode from its signed run-start entry."""
    out: list[str] = []
    notes: list[str] = []
    schedule = [s for s in meta.get("schedule") or [] if isinstance(s, str)]
    parties = set(meta.get("parties") or {}) if isinstance(meta.get("parties"), dict) else set()
    ctx = _Ctx(schedule, parties, mode or "")
    layout = RunDir(run_dir)
    for path in (layout.metrics, layout.metrics_lost):
        if path.is_file():
            _check_metrics(path, ctx, out, notes)
    _check_run_json(layout.record, meta, ctx, out, notes)
    check_report(run_dir, out)
    _check_tensorboard(run_dir, ctx, out)
    _other_files(run_dir, out)
    if len(out) > MAX_FINDINGS:
        out = [*out[:MAX_FINDINGS], f"... and {len(out) - MAX_FINDINGS} more"]
    return out, notes
