"""The party's outbound guard: everything a party answers passes here, and nothing else leaves it.

Owns: ``serve(message_type, content, party, run_id)``, the one path of every instruction at a party
(the ClientApp's and the in-process transport's): it decodes the instruction strictly and derives what
its reply may be (``read_instruction``), logs it in the party's ledger with the coordinator's ledger head
the instruction carries (``anchor`` of the "in" entry; an instruction without one is refused: the
audit checks these heads against the coordinator's ledger, ``distmoe.audit.ledgers``), asks the Flower-free party
service for the answer (``party.answer``: ``distmoe.party.service``), encodes the reply with the codec,
and passes it through ``OutboundGuard``. The guard decodes the reply again with the strict codec,
checks it against what this message type may answer (payload type, exact records and keys, the
masked-vector length the round declared and its uniformity statistic (``mask_check``, recorded in the
"out" entry: ``distmoe.privacy.secagg.selftest``), the update shapes of the instruction, only allow-listed
string fields: ``codec.string_fields``; a carried routing probe exactly when the instruction asked for one, within
the shapes of the party's own model: ``allow_list.check_probe_part``), scans every byte of it for this party's
canary strings, writes the "out" ledger entry, and attaches the new ledger head to the reply. A nonconforming reply is
replaced by an error: it is logged as rejected and nothing of it leaves (fail-closed). Errors leave as
fixed reason codes only (``guarded_error``): the reply carries the code's text from the closed table
``distmoe.wire.errors.REASONS`` and the ledger head, nothing else; the detail (which may name data files,
lines, counts or token lengths of the party's data) goes to the party's own log, ``<work-dir>/party.log``
(``party_log``), and never leaves.

The guard is the last step of ``serve`` rather than a Flower mod, so that the in-process transport
runs the identical code path without Flower messages (``docs/architecture.md``, The wire rule).

Must not: run the party's work (it only calls ``party.answer``), read party data, or let anything out
that did not pass the guard.
"""

from __future__ import annotations

import hashlib
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from flwr.app import RecordDict

from distmoe.ledger import Ledger
from distmoe.privacy.secagg.selftest import mask_check_failure, mask_statistic
from distmoe.rundir import COORDINATOR, WorkDir  # COORDINATOR: the name a party records the coordinator's heads under
from distmoe.wire import codec, inspect, packing
from distmoe.wire.allow_list import ProbeBounds, check_probe_part
from distmoe.wire.codec import WireError
from distmoe.wire.errors import REASONS, Blocked, ErrorCode, Refused, reason_text
from distmoe.wire.schema import (
    BY_MESSAGE_TYPE,
    CARRIES_PROBE,
    ConsistencyRequestMsg,
    DirectoryRequest,
    EvalInstruction,
    EvalReply,
    MaskedReply,
    ModelUpdate,
    RlInstruction,
    RouterStats,
    SecureInstruction,
    SftInstruction,
    UnmaskRequestMsg,
    eval_metric_keys,
)

REPLY_STRINGS = codec.string_fields("reply")  # {record: keys} that may hold text or bytes in a reply


def _all_bytes(content: RecordDict) -> list[bytes]:
    out = []
    for _, rec in content.items():
        for _, v in rec.items():
            vals = v if isinstance(v, list) else [v]
            for x in vals:
                if hasattr(x, "data") and isinstance(x.data, bytes):
                    out.append(x.data)
                elif isinstance(x, bytes):
                    out.append(x)
                elif isinstance(x, str):
                    out.append(x.encode("utf-8"))
    return out


def canary_hits(blobs: list[bytes], canaries: list[bytes]) -> int:
    return sum(1 for c in canaries for b in blobs if c and c in b)


class Party(Protocol):
    """What ``serve`` needs of a party (``distmoe.party.service.PartyService``)."""

    name: str
    ledger: Ledger
    canaries: list[bytes]  # this party's canary strings, as UTF-8 bytes
    secure: bool  # privacy.mode = secagg: phase replies are masked inputs

    def answer(self, mtype: str, instruction: object) -> tuple[object, dict | None]:
        """The reply payload and the DP facts for the ledger (or None); raises ``Refused``."""
        ...

    # optional: ``take_ledger_info() -> dict`` (facts of the last answer for its ``out`` entry's ``info``, e.g. the
    # owner policy and code pin recorded at setup); read once per answer by ``serve``


@dataclass
class Expectation:
    """What the reply to one instruction may be (filled from the decoded instruction)."""

    reply: type
    release: str | None = None
    length: int | None = None  # masked-input length declared by the round start
    round: int | None = None
    shapes: dict[str, tuple[int, ...]] | None = None  # plaintext update shapes
    eval_keys: tuple[str, ...] | None = None
    probe: bool = False  # the instruction carries a routing probe request: the reply must carry the probe
    probe_bounds: ProbeBounds | None = None  # its shapes, from the party's own model (``take_probe_bounds``)


class OutboundGuard:
    """Fail-closed check of one reply against its expectation (see the module docstring)."""

    def __init__(self, canaries: list[bytes]):
        self.canaries = canaries
        self.mask_check: dict | None = None  # the uniformity statistic of the last masked input checked

    def check(self, content: RecordDict, exp: Expectation) -> tuple[object, dict]:
        try:
            inspect.check_strings(codec.strip_ledger(content), REPLY_STRINGS)
            payload = codec.decode(content, exp.reply)
        except (WireError, inspect.InspectError) as exc:
            raise Blocked(f"reply does not conform to the schema: {exc}") from None
        if isinstance(payload, CARRIES_PROBE):  # a carried probe exactly when asked, within the party's own bounds
            if exp.probe and exp.probe_bounds is None:
                raise Blocked("a routing probe was asked for, but the party named no bounds for it")
            if (why := check_probe_part(payload.probe, exp.probe_bounds if exp.probe else None)) is not None:
                raise Blocked(why)
        if isinstance(payload, MaskedReply):
            if payload.release != exp.release:
                raise Blocked(f"masked input labelled {payload.release!r}, this message type releases {exp.release!r}")
            if payload.masked is not None:
                y = payload.masked.y
                if exp.length is None or y.shape != (exp.length,):
                    raise Blocked(f"masked vector has {y.shape[0]} elements, the round declared {exp.length}")
                if payload.masked.round != exp.round:
                    raise Blocked(f"masked input for round {payload.masked.round}, the instruction is "
                                  f"round {exp.round}")
                self.mask_check = mask_statistic(y)  # recorded in the "out" entry; the audit re-checks it
                if (why := mask_check_failure(self.mask_check)) is not None:
                    raise Blocked(why)
            elif exp.length is not None:
                raise Blocked("late share keys only, but this party was given a round start")
        elif isinstance(payload, ModelUpdate) and exp.shapes is not None:
            got = {k: tuple(v.shape) for k, v in payload.delta.items()}
            if got != exp.shapes:
                bad = sorted(set(got) ^ set(exp.shapes)) or [k for k in got if got[k] != exp.shapes[k]]
                raise Blocked(f"update tensors differ from the instruction's weights: {bad[:3]}")
        elif isinstance(payload, RouterStats):
            if payload.sums.ndim != 2 or payload.sums.dtype != np.float64:
                raise Blocked(f"router statistics must be a float64 [L, E] array, got {payload.sums.shape}")
        elif isinstance(payload, EvalReply) and exp.eval_keys is not None:
            if set(payload.metrics) != set(exp.eval_keys):
                raise Blocked("evaluation metric keys differ from the instruction's tasks")
        hits = canary_hits(_all_bytes(content), self.canaries)
        if hits:
            raise Blocked(f"reply contains {hits} canary string occurrence(s) of this party's data")
        return payload, {"strings": len(self.canaries), "hits": 0}


def phase_of(mtype: str) -> str:
    pt = BY_MESSAGE_TYPE.get(mtype)
    return pt.phase if pt is not None else "unknown"


def party_log(ledger: Ledger) -> Path:
    """The party's own error log, ``<work-dir>/party.log`` (next to ``<work-dir>/ledger/``): private to it."""
    return WorkDir.of_ledger(ledger.path).party_log


def log_detail(ledger: Ledger, code: int, where: str, detail: str) -> Path:
    """Append one error's full detail to the party's own log (created 0600); the SuperNode's stdout gets
    only the code and where the detail is (in a simulation stdout can end up in the run's ``flower.log``)."""
    path = party_log(ledger)
    path.parent.mkdir(parents=True, exist_ok=True)
    name = REASONS[ErrorCode(code)][0]
    line = f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {where}: [{name}] {detail.rstrip()}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode("utf-8", "backslashreplace"))
    finally:
        os.close(fd)
    print(f"distmoe party: {where}: error [{name}]; the detail is in {path.name} of the party's work directory",
          flush=True)
    return path


def failure_log(party: str, mtype: str, exc: BaseException) -> str:
    """A stdout line about a failure that has no party log to go to: the exception's type and its frames
    (file, line, function), never its message or any value (a message can quote training text, and stdout
    can end up in a log others read, ``flower.log`` in a simulation; ``distmoe.wire.at_rest`` checks it)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = "\n".join(f"  {f.filename}:{f.lineno} in {f.name}" for f in frames[-12:])
    return f"distmoe party {party}: {mtype} failed: {type(exc).__name__} (message withheld)\n{where}"


def guarded_error(ledger: Ledger, canaries: list[bytes], run: str, rnd: int | None, phase: str, code: int,
                  detail: str) -> str:
    """The error as it may leave: the fixed text of ``code`` from the closed table (``reason_text``), logged
    as sent, with this party's new ledger head appended (``codec.with_error_head``). ``detail`` goes to the
    party's own log only (``log_detail``). Also for errors raised before ``serve`` could run (a run config
    the party rejects: ``phase_of`` names the phase)."""
    code = ErrorCode(code)
    log_detail(ledger, code, f"run {run} round {rnd} {phase}", detail)
    text = reason_text(code)
    hits = canary_hits([text.encode("ascii")], canaries)  # a fixed text: 0, unless a canary is a table word
    blob = text.encode("ascii")
    entry = ledger.append(run=run, round=rnd, phase=phase, direction="out", payload_type="error",
                          keys=["error.reason"], shapes={}, bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest(),
                          verdict="accepted", peer=COORDINATOR,
                          info={"canary_scan": {"strings": len(canaries), "hits": hits}, "code": int(code)})
    return codec.with_error_head(text, entry["seq"], entry["hash"])


def _log(ledger: Ledger, content: RecordDict, direction: str, verdict: str, run: str, rnd: int | None, phase: str,
         exclude: tuple[str, ...] = (), **extra) -> dict:
    d = inspect.describe(content, exclude=exclude)
    return ledger.append(run=run, round=rnd, phase=phase, direction=direction, payload_type=codec.payload_tag(content),
                         keys=d["keys"], shapes=d["shapes"], bytes=d["bytes"], sha256=d["sha256"],
                         verdict=verdict[:500], peer=COORDINATOR, **extra)


def serve(mtype: str, content: RecordDict, party: Party, run_id: str) -> RecordDict:
    """Answer one instruction. Returns the guarded reply content; raises ``Refused`` (or ``Blocked``)
    whose text is what to send back as the error reply: the code's fixed text and the ledger head (already
    logged; the detail is in the party's own log). Afterwards, whatever the outcome, a party with an
    ``after_reply`` hook (its signed run receipt) is called; a failure there goes to the party's own log only.
    The message's ``in`` and ``out`` ledger entries are one group commit (``Ledger.batch``): both durable before the
    reply or the error leaves this function, with one fsync instead of two."""
    try:
        with party.ledger.batch():
            return _serve(mtype, content, party, run_id)
    finally:
        hook = getattr(party, "after_reply", None)
        if hook is not None:
            try:
                hook()
            except Exception as exc:  # noqa: BLE001  the reply stands; the owner reads why in party.log
                log_detail(party.ledger, int(ErrorCode.INTERNAL), f"run {run_id} receipt after {mtype}",
                           f"the run receipt was not written: {type(exc).__name__}: {exc}")


def _serve(mtype: str, content: RecordDict, party: Party, run_id: str) -> RecordDict:
    run, phase, ledger = str(run_id), phase_of(mtype), party.ledger
    instr, rnd, head, extra = None, None, None, {}
    try:
        content = packing.unpack(content)  # as Flower carried it: logged and checked as its logical records
        head = codec.ledger_head(content)  # the coordinator's ledger head as of this instruction
        instr, exp, rnd = read_instruction(mtype, content, party.secure)
        verdict = "accepted"
        if head is None:  # fail-closed: an instruction the coordinator did not log is not acted on
            instr, verdict = None, "rejected: no coordinator ledger head (the coordinator did not log it)"
    except (WireError, inspect.InspectError, Refused) as exc:
        instr, verdict = None, f"rejected: {exc}"
    if head is not None:  # recorded in this party's signed ledger: the audit finds it in the coordinator's
        extra["anchor"] = {"node": COORDINATOR, "seq": int(head[0]), "hash": head[1]}
    _log(ledger, content, "in", verdict, run, rnd, phase, exclude=(codec.LEDGER_RECORD,), **extra)

    def refuse(code: int, detail: str, cls=Refused):
        raise cls(guarded_error(ledger, party.canaries, run, rnd, phase, code, f"{mtype}: {detail}"), code)

    if instr is None:
        refuse(ErrorCode.REFUSED, f"party {party.name}: instruction {mtype} does not conform: {verdict[10:500]}")
    try:
        reply, dp = party.answer(mtype, instr)
        bounds = getattr(party, "take_probe_bounds", None)  # a carried probe's shapes (``distmoe.party.probe``)
        exp.probe_bounds = bounds() if callable(bounds) else None
        out = codec.encode(reply)
    except Refused as exc:
        refuse(exc.code, str(exc))
    except WireError as exc:
        refuse(ErrorCode.INTERNAL, f"the reply could not be encoded: {exc}")
    except Exception as exc:  # model errors and bugs: an error reply, never a hang (data errors: ``party.answer``)
        refuse(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        guard = OutboundGuard(party.canaries)
        _, scan = guard.check(out, exp)
    except Blocked as exc:
        _log(ledger, out, "out", f"rejected: {exc}", run, rnd, phase, dp=dp)  # the charge was made: it counts
        refuse(ErrorCode.BLOCKED, f"party {party.name}: blocked by the outbound guard, nothing left: {exc}", Blocked)
    take = getattr(party, "take_ledger_info", None)
    info = {**(take() if callable(take) else {}), "canary_scan": scan, "time": time.time()}
    if guard.mask_check is not None:
        info["mask_check"] = guard.mask_check
    entry = _log(ledger, out, "out", "accepted", run, rnd, phase, dp=dp, info=info)
    return codec.with_ledger_head(out, entry["seq"], entry["hash"])


def read_instruction(mtype: str, content: RecordDict, secure: bool) -> tuple[object, Expectation, int | None]:
    """Decode the instruction strictly and derive what its reply may be: (instruction, expectation, round)."""
    pt = BY_MESSAGE_TYPE.get(mtype)
    if pt is None:
        raise Refused(f"unknown message type {mtype!r}")
    if not pt.release:  # a secure-aggregation protocol stage
        req = codec.decode(content, pt.cls)
        rnd = req.request.round if isinstance(req, (UnmaskRequestMsg, ConsistencyRequestMsg)) else (
            req.first_round if isinstance(req, DirectoryRequest) else int(getattr(req, "round", 0)))  # probe: round
        return req, Expectation(pt.reply), rnd
    instr_t, release = pt.cls, pt.release
    if secure:
        si = codec.decode(content, SecureInstruction)
        if not isinstance(si.instruction, instr_t) or si.release != release:
            raise Refused(f"{mtype} carries {type(si.instruction).__name__}/{si.release}")
        st = si.start
        if st is not None and st.round != si.instruction.round:
            raise Refused(f"round start for round {st.round} inside a round {si.instruction.round} instruction")
        exp = Expectation(MaskedReply, release, st.length if st else None, si.instruction.round,
                          probe=getattr(si.instruction, "probe", None) is not None)
        return si, exp, si.instruction.round
    instr = codec.decode(content, instr_t)
    exp = Expectation(pt.reply, probe=getattr(instr, "probe", None) is not None)
    if isinstance(instr, (SftInstruction, RlInstruction)):
        exp.shapes = {k: tuple(v.shape) for k, v in instr.weights.items()}
    if isinstance(instr, EvalInstruction):
        exp.eval_keys = eval_metric_keys(instr.tasks)
    return instr, exp, instr.round
