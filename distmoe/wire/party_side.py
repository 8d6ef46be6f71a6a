"""Everything a party answers, and the outbound guard that sees exactly what leaves it.

Owns: ``serve(message_type, content, ...)``, the one entry point of the ClientApp (and of the
in-process transport used by tests): it logs the inbound instruction in the party's ledger, runs the
phase (``distmoe.train.party``) or protocol stage (``distmoe.privacy.session``), encodes the reply with
the codec, and passes it through ``OutboundGuard``. The guard decodes the reply again with the strict
codec, checks it against what this message type may answer (payload type, exact records and keys,
the masked-vector length the round declared, the update shapes of the instruction, only allow-listed
string fields), scans every byte of it for this party's canary strings (``<data-path>/canaries.txt``),
writes the "out" ledger entry, and attaches the new ledger head to the reply. A nonconforming reply is
replaced by an error naming the problem: it is logged as rejected and nothing of it leaves
(fail-closed). Error replies are scanned too; a reason that contains a canary is withheld.

Departure from DESIGN.md section 5 ("a client mod"): the guard is the last step of ``serve`` rather
than a Flower mod, because the in-process transport must run the identical code path without Flower
messages, and ``clients/app.py`` wraps exactly the record dict ``serve`` returns into the reply.

Must not: read another party's directory, or let anything out that did not pass the guard.
"""

from __future__ import annotations

import hashlib
import math
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flwr.app import RecordDict

from distmoe.config import NodeConfig, RunConfig
from distmoe.privacy.accountant import PrivacyEvent
from distmoe.privacy.session import PartySession, SessionError, open_ledger
from distmoe.privacy.vectors import StatsLayout
from distmoe.train import party as P
from distmoe.wire import codec, inspect
from distmoe.wire.codec import WireError
from distmoe.wire.schema import (
    TRAIN_METRIC_KEYS,
    DirectoryRequest,
    EvalInstruction,
    EvalReply,
    KeyAdvertReply,
    MaskedReply,
    ModelUpdate,
    RlInstruction,
    RouterStats,
    SecureInstruction,
    SetupRequest,
    SftInstruction,
    ShareKeysReply,
    StatsInstruction,
    UnmaskRequestMsg,
    UnmaskResponseMsg,
    eval_metric_keys,
    rl_metric_keys,
)

PHASES = {codec.MSG_SFT: (SftInstruction, "model-update", "sft"), codec.MSG_RL: (RlInstruction, "rl-update", "rl"),
          codec.MSG_STATS: (StatsInstruction, "router-stats", "stats"),
          codec.MSG_EVAL: (EvalInstruction, "eval", "eval")}
PROTOCOL = {codec.MSG_SETUP: (SetupRequest, KeyAdvertReply, "setup"),
            codec.MSG_DIRECTORY: (DirectoryRequest, ShareKeysReply, "setup"),
            codec.MSG_UNMASK: (UnmaskRequestMsg, UnmaskResponseMsg, "unmask")}
PLAIN_REPLY = {codec.MSG_SFT: ModelUpdate, codec.MSG_RL: ModelUpdate, codec.MSG_STATS: RouterStats,
               codec.MSG_EVAL: EvalReply}
# ConfigRecord fields that may hold text or bytes in a reply (everything else must be a number)
REPLY_STRINGS = {"meta": {"payload", "release", "party", "ledger_public_key", "kind", "c_pk"},
                 "keys": {"s_pk", "b_commit"}, "next": {"s_pk", "b_commit"}}


class Refused(RuntimeError):
    """The party refuses to answer; ``reason`` goes back as the error reply (after the canary scan)."""


class Blocked(Refused):
    """The outbound guard stopped a nonconforming reply; nothing of it left."""


def load_canaries(node: NodeConfig) -> list[bytes]:
    """This party's canary strings (``<data-path>/canaries.txt``, one per line), as UTF-8 bytes."""
    path = Path(node.data_path) / "canaries.txt"
    if not path.exists():
        return []
    return [line.strip().encode("utf-8") for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


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


@dataclass
class Expectation:
    """What the reply to one instruction may be (filled from the decoded instruction)."""

    reply: type
    release: str | None = None
    length: int | None = None  # masked-input length declared by the round start
    round: int | None = None
    shapes: dict[str, tuple[int, ...]] | None = None  # plaintext update shapes
    eval_keys: tuple[str, ...] | None = None


class OutboundGuard:
    """Fail-closed check of one reply against its expectation (see the module docstring)."""

    def __init__(self, canaries: list[bytes]):
        self.canaries = canaries

    def check(self, content: RecordDict, exp: Expectation) -> tuple[object, dict]:
        try:
            inspect.check_strings(codec.strip_ledger(content), REPLY_STRINGS)
            payload = codec.decode(content, exp.reply)
        except (WireError, inspect.InspectError) as exc:
            raise Blocked(f"reply does not conform to the schema: {exc}") from None
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


def _phase_of(mtype: str) -> str:
    if mtype in PHASES:
        return PHASES[mtype][2]
    return PROTOCOL[mtype][2] if mtype in PROTOCOL else "unknown"


def _guarded_error(ledger, canaries: list[bytes], run: str, rnd: int | None, phase: str, reason: str) -> str:
    """The error text as it may leave (printable ASCII, bounded, canary-free), logged as sent, with this
    party's new ledger head appended (``codec.with_error_head``)."""
    text = codec.error_text(reason)
    if canary_hits([reason.encode("utf-8"), text.encode("ascii")], canaries):
        text = "error (reason withheld: it contained a canary string of this party's data)"
    blob = text.encode("ascii")
    entry = ledger.append(run=run, round=rnd, phase=phase, direction="out", payload_type="error",
                          keys=["error.reason"], shapes={}, bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest(),
                          verdict="accepted", peer="coordinator",
                          info={"canary_scan": {"strings": len(canaries), "hits": 0}})
    return codec.with_error_head(text, entry["seq"], entry["hash"])


def guarded_error(mtype: str, node: NodeConfig, run_id: str, reason: str) -> str:
    """For errors raised before ``serve`` could run (a run config the party rejects): the same guarded,
    logged and anchored error text ``serve`` sends."""
    return _guarded_error(open_ledger(node), load_canaries(node), str(run_id), None, _phase_of(mtype), reason)


def serve(mtype: str, content: RecordDict, cfg: RunConfig, node: NodeConfig, node_id: int, run_id: str
          ) -> RecordDict:
    """Answer one instruction. Returns the guarded reply content; raises ``Refused`` with the reason to
    send back as an error reply (already logged and canary-checked)."""
    ledger = open_ledger(node)
    canaries = load_canaries(node)
    guard = OutboundGuard(canaries)
    run, phase = str(run_id), _phase_of(mtype)
    desc = inspect.describe(content)
    try:
        instr, exp, rnd = _read(mtype, content, cfg)
        verdict = "accepted"
    except (WireError, inspect.InspectError, Refused) as exc:
        instr, verdict, rnd = None, f"rejected: {exc}"[:500], None
    ledger.append(run=run, round=rnd, phase=phase, direction="in", payload_type=codec.payload_tag(content),
                  keys=desc["keys"], shapes=desc["shapes"], bytes=desc["bytes"], sha256=desc["sha256"],
                  verdict=verdict, peer="coordinator")
    def refuse(reason: str, cls=Refused):
        raise cls(_guarded_error(ledger, canaries, run, rnd, phase, reason))

    if instr is None:
        refuse(f"party {node.party}: instruction {mtype} does not conform: {verdict[10:]}")

    try:
        reply, dp = _answer(mtype, instr, cfg, node, node_id, run)
        out = codec.encode(reply)
    except (Refused, SessionError) as exc:
        refuse(str(exc))
    except P.PartyError as exc:
        refuse(f"PartyError: {exc}")
    except WireError as exc:
        refuse(f"the reply could not be encoded: {exc}")
    except Exception as exc:  # data, config, model errors and bugs: an error reply, never a hang
        print(f"distmoe party {node.party}: {mtype} failed:\n{traceback.format_exc()}", flush=True)
        refuse(f"{type(exc).__name__}: {exc}")
    try:
        _, scan = guard.check(out, exp)
    except Blocked as exc:
        odesc = inspect.describe(out)
        ledger.append(run=run, round=rnd, phase=phase, direction="out", payload_type=codec.payload_tag(out),
                      keys=odesc["keys"], shapes=odesc["shapes"], bytes=odesc["bytes"], sha256=odesc["sha256"],
                      verdict=f"rejected: {exc}"[:500], peer="coordinator")
        refuse(f"party {node.party}: blocked by the outbound guard, nothing left: {exc}", Blocked)
    odesc = inspect.describe(out)
    entry = ledger.append(run=run, round=rnd, phase=phase, direction="out", payload_type=codec.payload_tag(out),
                          keys=odesc["keys"], shapes=odesc["shapes"], bytes=odesc["bytes"], sha256=odesc["sha256"],
                          verdict="accepted", peer="coordinator", dp=dp,
                          info={"canary_scan": scan, "time": time.time()})
    return codec.with_ledger_head(out, entry["seq"], entry["hash"])


def _read(mtype: str, content: RecordDict, cfg: RunConfig):
    """Decode the instruction and derive what its reply may be."""
    if mtype in PROTOCOL:
        req_t, rep_t, _ = PROTOCOL[mtype]
        req = codec.decode(content, req_t)
        rnd = req.request.round if isinstance(req, UnmaskRequestMsg) else (
            req.first_round if isinstance(req, DirectoryRequest) else 0)
        return req, Expectation(rep_t), rnd
    if mtype not in PHASES:
        raise Refused(f"unknown message type {mtype!r}")
    instr_t, release, _ = PHASES[mtype]
    if cfg.privacy.secure:
        si = codec.decode(content, SecureInstruction)
        if not isinstance(si.instruction, instr_t) or si.release != release:
            raise Refused(f"{mtype} carries {type(si.instruction).__name__}/{si.release}")
        st = si.start
        if st is not None and st.round != si.instruction.round:
            raise Refused(f"round start for round {st.round} inside a round {si.instruction.round} instruction")
        return si, Expectation(MaskedReply, release, st.length if st else None, si.instruction.round), \
            si.instruction.round
    instr = codec.decode(content, instr_t)
    exp = Expectation(PLAIN_REPLY[mtype])
    if isinstance(instr, (SftInstruction, RlInstruction)):
        exp.shapes = {k: tuple(v.shape) for k, v in instr.weights.items()}
    if isinstance(instr, EvalInstruction):
        exp.eval_keys = eval_metric_keys(instr.tasks)
    return instr, exp, instr.round


_PLAIN_FN = {SftInstruction: P.run_sft, RlInstruction: P.run_rl, StatsInstruction: P.run_stats,
             EvalInstruction: P.run_eval}


def _answer(mtype: str, instr, cfg: RunConfig, node: NodeConfig, node_id: int, run: str):
    """-> (reply payload, dp facts for the ledger or None)."""
    if not cfg.privacy.secure and mtype in PHASES:
        return _PLAIN_FN[type(instr)](cfg, node, instr), None
    if not cfg.privacy.secure:
        raise Refused(f"{mtype}: secure-aggregation messages in a plaintext-mode run")
    sess = PartySession(cfg, node, run)
    if isinstance(instr, SetupRequest):
        _check_data(cfg, node)  # a party with broken data says so at its first contact, before any training
        advert = sess.setup(instr, node_id)
        return KeyAdvertReply(node.party, advert.c_pk, open_ledger(node).public_key_hex), None
    if isinstance(instr, DirectoryRequest):
        return ShareKeysReply(sess.directory(instr)), None
    if isinstance(instr, UnmaskRequestMsg):
        return UnmaskResponseMsg(sess.unmask(instr.request)), None
    return _secure_phase(instr, cfg, node, sess)


def _check_data(cfg: RunConfig, node: NodeConfig) -> None:
    """Validate every task file of this party (``DataError`` names file, line and field); the data
    directory is shown as ``<data-path>`` so the reply does not carry the party's local path."""
    from distmoe.data.formats import DataError

    try:
        P.load_data(cfg, node)
    except DataError as exc:
        text = str(exc).replace(str(node.data_path), "<data-path>")
        raise Refused(f"party {node.party}: invalid data, not joining this run: {text}") from None


def _secure_phase(si: SecureInstruction, cfg: RunConfig, node: NodeConfig, sess: PartySession):
    instr, st = si.instruction, si.start
    if st is None:  # outside this round's U1: share keys for the next round and rejoin there
        return MaskedReply(si.release, None, sess.late_keys(instr.round)), None
    dp = None
    if isinstance(instr, StatsInstruction):
        per_seq = P.router_stats_per_sequence(cfg, node, instr, cfg.privacy.num_sequences_max)  # [N, L, E]
        spec = sess.stats_spec(per_seq.shape[1], per_seq.shape[2])
        layout = StatsLayout(spec)
        t = sess.params.threshold
        z_worst = spec.effective_noise_multiplier(t)  # the fewest survivors a completed round can have
        eps = sess.charge(PrivacyEvent(z_worst, 1.0, 1, "skellam", f"router-stats round {instr.round}"))
        vec = layout.encode(per_seq)
        dp = {**spec.dp_params(n_active=t), "epsilon": eps, "budget": sess.accountant.epsilon_budget}
    elif isinstance(instr, (SftInstruction, RlInstruction)):
        upd = (P.run_sft if isinstance(instr, SftInstruction) else P.run_rl)(cfg, node, instr)
        if isinstance(instr, SftInstruction):
            keys = TRAIN_METRIC_KEYS
        else:
            n_layers = sum(1 for k in upd.metrics if k.startswith("route_disagree_l")) or _moe_layers(cfg, node)
            keys = rl_metric_keys(n_layers, cfg.rl.simulator)
        extra = sorted(set(upd.metrics) - set(keys))
        if extra:
            raise Refused(f"update metrics outside the declared layout: {extra[:3]}")
        metrics = {k: upd.metrics.get(k, math.nan) for k in keys}
        layout = sess.update_layout({k: tuple(v.shape) for k, v in instr.weights.items()}, keys)
        vec, facts = layout.encode(upd.delta, upd.num_examples, metrics)
        dp = None
        if sess.facts.update_noise_multiplier > 0:
            vec, dp = _noise_update(vec, layout, sess, instr.round)
    else:
        rep = P.run_eval(cfg, node, instr)
        vec = sess.eval_layout(eval_metric_keys(instr.tasks)).encode(rep.metrics)
    length = st.length or sess.params.length
    if vec.shape != (length,):
        raise Refused(f"round {instr.round}: the server declared a {length}-element vector, this party's layout "
                      f"for {si.release} has {vec.shape[0]}: refused (mismatched model or config?)")
    return MaskedReply(si.release, sess.masked(st, vec), None), dp


def _moe_layers(cfg: RunConfig, node: NodeConfig) -> int:
    from distmoe.model.build import build_model, describe

    model, _ = build_model(cfg.model, node.model_path)
    return describe(model).num_moe_layers


def _noise_update(vec: np.ndarray, layout, sess: PartySession, rnd: int):
    """Client-level DP on the update: each party adds its share of Gaussian noise to the delta block, so
    the sum over >= t survivors carries std ``z_u * clip``, the add/remove-one-party L2 sensitivity of the
    sum (the private layout has uniform weights and withholds the metrics, so nothing outside the noised
    block depends on data; see ``distmoe.privacy.vectors``). The share is rounded to the fixed-point
    grid (step 2^-frac_bits, some 10^-12 of the noise std): a rounded Gaussian, accounted as the Gaussian
    mechanism. Exact Skellam is not used here because numpy's Poisson sampler stops at rate ~1e19, below these variances
    in fixed-point units."""
    from distmoe.privacy import dp as D
    from distmoe.privacy.vectors import from_ring64, to_ring64

    z_u = sess.facts.update_noise_multiplier
    n, t = sess.n_parties, sess.params.threshold
    if not layout.private:
        raise Refused("update noise requested on a non-private layout (weights and metrics would leave exact)")
    sens = layout.sensitivity * 2.0 ** layout.frac_bits  # L2 sensitivity, fixed-point units
    var = (z_u * sens) ** 2 / t  # over-provisioned: the sum over >= t survivors carries >= (z_u * sens)^2
    eps = sess.charge(PrivacyEvent(z_u, 1.0, 1, "gaussian", f"model-update round {rnd}"))
    signed = from_ring64(vec).copy()
    signed[:layout.numel] += np.rint(D.crypto_rng().normal(0.0, math.sqrt(var), layout.numel)).astype(np.int64)
    dp = {"mechanism": "gaussian", "unit": "party", "neighbours": "add/remove", "noise_multiplier": z_u,
          "n_parties": n, "n_active": t, "max_dropouts": n - t, "z_eff": z_u, "clip": layout.clip,
          "weights": "uniform", "sensitivity": layout.sensitivity, "metrics": "withheld",
          "epsilon": eps, "budget": sess.accountant.epsilon_budget}
    return to_ring64(signed), dp
