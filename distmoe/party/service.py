"""The party service: one Flower-free ``answer(message_type, instruction) -> reply`` for everything a
party is asked, used by the ClientApp (``clients/app.py``) and the in-process transport alike, both
through the outbound guard (``distmoe.wire.party_guard.serve``).

Owns: the probe a phase instruction may carry (``distmoe.party.probe.run_carried``: on the instruction's weights,
before any local work, answered beside the reply), the dispatch of each decoded instruction to the party's own
work (``distmoe.party.work``: SFT, RL, router statistics, evaluation) or secure-aggregation stage
(``distmoe.party.session``: setup, directory, masked input, consistency check, unmask), the assembly of a secure
phase's reply (``_SECURE``: per instruction kind, the party's figures encoded, noised and charged by their release
module, ``distmoe.privacy.releases``; then the masked input), the party's identity on the wire (name, ledger,
canary strings from ``<data-path>/canaries.txt``), and turning the party's own errors (``SessionError``,
``PartyError``, ``DataError``, ``ConfigError``) into ``Refused`` with the fixed reason code of the closed table
(``distmoe.wire.errors.REASONS``); their text is detail for the party's own log.
With an owner policy (``distmoe.party.policy``) every message's run config is checked against the owner's floors
before any work, and the setup request's threshold and noise at setup, before any key leaves; the policy and the
code-pin digest go into the key advert's ledger entry (``take_ledger_info``).

Must not: import ``flwr``, encode or send anything itself (the guard does), draw DP noise (``distmoe.privacy``
does), or read another party's directory.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from distmoe.config import ConfigError, NodeConfig, RunConfig
from distmoe.data.formats import DataError
from distmoe.io import append_durable
from distmoe.party import work as P
from distmoe.party.dpo_work import run_dpo
from distmoe.party.policy import ledger_facts, owner_policy, secure_work_dir
from distmoe.party.probe import run_carried, run_probe
from distmoe.party.receipt import write_receipt
from distmoe.party.session import PartySession, SessionError, open_ledger
from distmoe.party.settle import run_settle
from distmoe.privacy import releases as R
from distmoe.privacy import secagg as sa
from distmoe.privacy import train_metrics as TM
from distmoe.privacy.dp import canary_seed
from distmoe.rundir import WorkDir
from distmoe.wire.errors import ErrorCode, Refused
from distmoe.wire.schema import (
    CARRIED_BY,
    ConsistencyRequestMsg,
    ConsistencyResponseMsg,
    DirectoryRequest,
    EvalInstruction,
    KeyAdvertReply,
    MaskedReply,
    ProbeInstruction,
    RlInstruction,
    SecureInstruction,
    SettleInstruction,
    SetupRequest,
    SftInstruction,
    ShareKeysReply,
    StatsInstruction,
    UnmaskRequestMsg,
    UnmaskResponseMsg,
)


def _run_sft(cfg: RunConfig, node: NodeConfig, instr: SftInstruction, loaded: P.Loaded | None = None):
    """``(update, what only this party's log gets)`` of a training round on an ``sft`` instruction: a ``dpo``
    round (``objective = "dpo"``) keeps its DPO figures for that log."""
    if instr.objective == "dpo":
        return run_dpo(cfg, node, instr, loaded)
    return P.run_sft(cfg, node, instr, loaded), {}


_PLAIN = {SftInstruction: lambda cfg, node, instr, loaded: _run_sft(cfg, node, instr, loaded)[0],
          RlInstruction: P.run_rl, StatsInstruction: P.run_stats, EvalInstruction: P.run_eval}


# instruction -> the PartyService method that computes this party's figures and encodes them with their release
_SECURE = {StatsInstruction: "_stats_release", EvalInstruction: "_eval_release", SftInstruction: "_update_release",
           RlInstruction: "_update_release"}


def load_canaries(node: NodeConfig) -> list[bytes]:
    """This party's canary strings (``<data-path>/canaries.txt``, one per line), as UTF-8 bytes."""
    path = Path(node.data_path) / "canaries.txt"
    if not path.exists():
        return []
    return [line.strip().encode("utf-8") for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class PartyService:
    """One party in one run (Flower run id ``run_id``), as node ``node_id``. Holds no state between
    messages beyond what its files hold (in deployment every message runs in a new process)."""

    def __init__(self, cfg: RunConfig, node: NodeConfig, node_id: int, run_id: str):
        self.policy = owner_policy(node)  # the data owner's floors (None: no policy, the run config decides)
        if self.policy is not None and node.epsilon_max is None:  # the policy's default cap
            node = dataclasses.replace(node, epsilon_max=self.policy.epsilon_max)
        self.cfg, self.node, self.node_id, self.run_id = cfg, node, int(node_id), str(run_id)
        self.name = node.party
        self._ledger_info: dict = {}
        self._probe_bounds = None  # the last carried probe's bounds, for the outbound guard (take_probe_bounds)
        self.secure = cfg.privacy.secure
        self.ledger = open_ledger(node)
        self.canaries = load_canaries(node)

    def after_reply(self) -> None:
        """Refresh this party's signed run receipt (``distmoe.party.receipt``); the guard calls it after every
        reply, so the receipt after the last message is the run-end receipt the owner publishes."""
        write_receipt(self.cfg, self.node, self.run_id, self.policy)

    def answer(self, mtype: str, instr: object) -> tuple[object, dict | None]:
        """-> (reply payload, DP facts for the ledger or None); ``Refused`` with the reason code otherwise
        (its text is the detail for the party's own log, ``party_guard.guarded_error``)."""
        try:
            return self._answer(mtype, instr)
        except SessionError as exc:
            raise Refused(str(exc), exc.code) from None
        except P.PartyError as exc:
            raise Refused(f"PartyError: {exc}", exc.code) from None
        except DataError as exc:  # a data file, a template or an answer that does not fit max-seq-len
            raise Refused(f"DataError: {exc}", ErrorCode.DATA) from None
        except ConfigError as exc:
            raise Refused(f"ConfigError: {exc}", ErrorCode.CONFIG) from None

    def take_ledger_info(self) -> dict:
        """Facts of the last answer for its ``out`` ledger entry (at setup: the owner policy, the code pin), once."""
        info, self._ledger_info = self._ledger_info, {}
        return info

    def _answer(self, mtype: str, instr: object) -> tuple[object, dict | None]:
        cfg, node = self.cfg, self.node
        self._probe_bounds = None  # nothing stale from an earlier message
        if self.policy is not None:  # before any work: the run config against the owner's floors
            self.policy.check_run(cfg)
            rnd = getattr(getattr(instr, "instruction", instr), "round", None)
            if isinstance(rnd, int):
                self.policy.check_round(rnd)
            if not self.secure:  # plaintext allowed by the owner: no setup, so the setup steps run here
                self.policy.count_run(node, self.run_id)
                secure_work_dir(node)
                print(work_dir_note(node, Path(self.ledger.path)), flush=True)
        inner = getattr(instr, "instruction", instr)  # a secure phase instruction's phase instruction
        if isinstance(inner, CARRIED_BY) and inner.probe is not None:  # before any local work (party/probe.py)
            loaded = P.Loaded()  # the probe's loaded weights, for this message's phase work only
            part, self._probe_bounds = run_carried(cfg, node, inner, loaded)
            reply, dp = self._work(mtype, instr, loaded)
            return dataclasses.replace(reply, probe=part), dp
        return self._work(mtype, instr)

    def take_probe_bounds(self):
        """The bounds of the last carried probe (``wire.allow_list.ProbeBounds``: from this party's own model and
        config), once; None when the last answer carried none. The outbound guard checks the reply against them."""
        bounds, self._probe_bounds = self._probe_bounds, None
        return bounds

    def _work(self, mtype: str, instr: object, loaded: P.Loaded | None = None) -> tuple[object, dict | None]:
        """``loaded``: this message's note of the weights its carried probe left loaded (``work.Loaded``)."""
        cfg, node = self.cfg, self.node
        if isinstance(instr, ProbeInstruction):  # public inputs only, in the clear in both modes (docs/privacy.md §3)
            return run_probe(cfg, node, instr), None
        if isinstance(instr, SettleInstruction):  # likewise public inputs only (docs/privacy.md §3, the bias settle)
            return run_settle(cfg, node, instr), None
        if not self.secure and type(instr) in _PLAIN:
            return _PLAIN[type(instr)](cfg, node, instr, loaded), None
        if not self.secure:
            raise Refused(f"{mtype}: secure-aggregation messages in a plaintext-mode run")
        sess = PartySession(cfg, node, self.run_id)
        if isinstance(instr, SetupRequest):
            if self.policy is not None:  # the public parameters against the floors, then this run counts
                self.policy.check_setup(cfg, instr.threshold, instr.noise_multiplier, instr.update_noise_multiplier)
                self.policy.count_run(node, self.run_id)
                secure_work_dir(node)  # work dir 0700, the pre-run privacy check of data and work directories
            self._check_data()  # a party with broken data says so at its first contact, before any training
            print(work_dir_note(node, Path(self.ledger.path)), flush=True)  # the owner's log: where its records are
            advert = sess.setup(instr, self.node_id)
            self._ledger_info = ledger_facts(self.policy)  # in the key advert's signed `out` entry
            return KeyAdvertReply(node.party, advert.c_pk, self.ledger.public_key_hex, advert.sig_pk,
                                  float(node.epsilon_max or 0.0)), None
        if isinstance(instr, DirectoryRequest):
            return ShareKeysReply(sess.directory(instr)), None
        if isinstance(instr, ConsistencyRequestMsg):
            return ConsistencyResponseMsg(sess.consistency(instr.request)), None
        if isinstance(instr, UnmaskRequestMsg):
            return UnmaskResponseMsg(sess.unmask(instr.request)), None
        return self._secure_phase(instr, sess, loaded)

    def _check_data(self) -> None:
        """Validate every task file of this party (``DataError`` names file, line and field: detail for the
        party's own log; only the code ``data`` leaves)."""
        try:
            P.load_data(self.cfg, self.node)
        except DataError as exc:
            raise Refused(f"party {self.name}: invalid data, not joining this run: {exc}", ErrorCode.DATA) from None

    def _secure_phase(self, si: SecureInstruction, sess: PartySession, loaded: P.Loaded | None
                      ) -> tuple[MaskedReply, dict | None]:
        instr, st = si.instruction, si.start
        if st is None:  # outside this round's U1: share keys for the next round and rejoin there
            return MaskedReply(si.release, None, sess.late_keys(instr.round)), None
        bits = st.bits or sess.params.bits  # the release's ring width as the server declared it
        own = (self._update_layout(instr, sess)[0].bits
               if isinstance(instr, (SftInstruction, RlInstruction)) else 64)  # statistics, eval: always 64
        if bits != own:  # checked before any work or any privacy is spent
            raise Refused(f"round {instr.round}: the server declared Z_2^{bits} for {si.release}, this party's layout "
                          f"uses Z_2^{own}: refused (mismatched privacy.ring-bits or config?)", ErrorCode.MODEL)
        vec, dp, contributed, premask = getattr(self, _SECURE[type(instr)])(instr, sess, st, loaded)
        length = st.length or sess.params.length
        if vec.dtype != sa.primitives.word_dtype(bits):  # the layout encodes in its own width (checked above)
            raise Refused(f"round {instr.round}: {si.release} encoded {vec.dtype} words for Z_2^{bits}",
                          ErrorCode.MODEL)
        if vec.shape != (length,):
            raise Refused(f"round {instr.round}: the server declared a {length}-element vector, this party's layout "
                          f"for {si.release} has {vec.shape[0]}: refused (mismatched model or config?)",
                          ErrorCode.MODEL)
        return MaskedReply(si.release, sess.masked(st, vec, contributed=contributed, premask=premask), None), dp

    # one per instruction kind: this party's figures, encoded and noised by their release (distmoe.privacy.releases),
    # whose spec is built by the release module the coordinator opens the sum with, from this party's own config and
    # the setup's public facts (noise multiplier, roster size n, threshold t)
    def _stats_release(self, instr: StatsInstruction, sess: PartySession, st, loaded: P.Loaded | None):
        per_seq = P.router_stats_per_sequence(self.cfg, self.node, instr, self.cfg.privacy.num_sequences_max, loaded)
        spec = R.stats.spec(self.cfg.privacy, sess.facts.noise_multiplier, per_seq.shape[1], per_seq.shape[2],
                            sess.n_parties, sess.params.threshold)  # per_seq: [N, L, E]
        # canaries at positions drawn from this round's U1 mask keys (no single party or the server picks them)
        seed = canary_seed(sess.params.run_id, st.round, st.participants)
        vec, dp, contributed = R.stats.encode(spec, per_seq, seed, sess.charge, sess.params.threshold, instr.round,
                                              sess.accountant.epsilon_budget)
        return vec, dp, contributed, None

    def _eval_release(self, instr: EvalInstruction, sess: PartySession, st, loaded: P.Loaded | None):
        # this party's own privacy.metric-noise-multiplier and data.max-eval-examples (the length, 3 per task, is not
        # theirs)
        spec = R.evaluate.spec(self.cfg.privacy, self.cfg.data.max_eval_examples, instr.tasks, sess.n_parties,
                               sess.params.threshold)
        vec, dp, contributed = R.evaluate.encode(spec, P.eval_scores(self.cfg, self.node, instr, loaded), sess.charge,
                                                 sess.params.threshold, instr.round, sess.accountant.epsilon_budget)
        return vec, dp, contributed, None

    def _update_release(self, instr: SftInstruction | RlInstruction, sess: PartySession, st, loaded: P.Loaded | None):
        # the masks do not depend on the update: expanded on a spare core while this party trains
        join = (sess.start_premask(st) if self.cfg.privacy.secagg_premask and sa.primitives.MASK_THREADS > 1
                else (lambda: None))
        try:
            vec, dp, contributed = self._update_vector(instr, sess, loaded)
        finally:
            premask = join()  # never left running past this message, also when training failed
        return vec, dp, contributed, premask

    def _update_vector(self, instr: SftInstruction | RlInstruction, sess: PartySession, loaded: P.Loaded | None):
        """Train locally; the update as this round's ``[D]`` vector (noised under client-level DP), with the
        objective's training metrics clipped to their public bounds in the last words (``train_metrics``); every
        other figure stays in this party's own log (``UpdateLayout``: uniform weights)."""
        cfg, node = self.cfg, self.node
        P.take_notes(node.party)  # nothing stale from an earlier call
        # `local`: what only this party's log gets besides the update (a dpo round's DPO figures)
        sft = isinstance(instr, SftInstruction)
        upd, local = _run_sft(cfg, node, instr, loaded) if sft else (P.run_rl(cfg, node, instr, loaded), {})
        notes = P.take_notes(node.party)  # names of parameters with non-finite gradients: this party's log only
        z_u = sess.facts.update_noise_multiplier
        layout, slots = self._update_layout(instr, sess)
        vec, facts, sent, contributed = R.update.encode(layout, slots, upd.delta, upd.num_examples, upd.metrics)
        self._log_metrics(instr, {**upd.metrics, **local}, {**facts, **notes,
                                                            **{f"released_{k}": v for k, v in sent.items()}})
        if z_u <= 0:
            return vec, None, contributed
        if not layout.private:
            raise Refused("update noise requested on a non-private layout (weights would leave exact)")
        vec, dp = R.update.add_noise(layout, vec, z_u, sess.n_parties, sess.params.threshold, sess.charge,
                                     instr.round, sess.accountant.epsilon_budget)
        return vec, dp, contributed

    def _update_layout(self, instr: SftInstruction | RlInstruction, sess: PartySession):
        """The update release's layout with this objective's training-metric slots (``R.update.layout``: the
        coordinator opens the sum with the same)."""
        objective = TM.objective_of("rl" if isinstance(instr, RlInstruction) else "sft",
                                    getattr(instr, "objective", None))
        return R.update.layout(self.cfg.privacy, {k: tuple(v.shape) for k, v in instr.weights.items()},
                               sess.n_parties, sess.params.threshold, sess.facts.update_noise_multiplier, objective)

    def _log_metrics(self, instr, metrics: dict, facts: dict) -> None:
        """The round's training metrics, for this party's operator only: ``<work-dir>/metrics/<party>.jsonl``
        (0600; never sent as such: the update sum carries only the clipped ``released_*`` figures, summed)."""
        line = {"round": instr.round, "kind": type(instr).__name__, "task": instr.task,
                **({"objective": instr.objective} if getattr(instr, "objective", None) else {}),
                **{k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}, **facts}
        append_durable(WorkDir(self.node.work_dir).metrics(self.name),
                       (json.dumps(line, allow_nan=True) + "\n").encode())


def work_dir_note(node: NodeConfig, ledger: Path) -> str:
    """The setup line of the party's own log (the SuperNode's stdout) naming where its records are kept."""
    return (f"distmoe party {node.party}: work directory {node.work_dir} (ledger {ledger}, privacy budget "
            f"{WorkDir(node.work_dir).privacy}, error detail {WorkDir(node.work_dir).party_log})")
