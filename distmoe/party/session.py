"""A party's privacy session for one run: its secure-aggregation client, its privacy accountant and the
public parameters it agreed to, persisted in the party's own work directory between messages.

Owns: ``<work-dir>/secagg/<party>-<run>.state`` (the SecAgg client state machine: SECRET, mode 0600),
``<work-dir>/privacy/<party>-<run>.json`` (the setup facts and the party's own noise multipliers, per
Flower run id ``<run>``), ``<work-dir>/privacy/<party>-<logical>.accountant.json`` (the party's
accountant, per *logical* run: see "Resume" below), the party's ledger signing key (node config ``ledger-key``, else
``<work-dir>/keys/<party>-ledger.key``), and the checks a party
makes before anything of its data is released: the noise it uses is the larger of its own plan and the
server's (a server can only tighten it), its budget is ``min(privacy.epsilon, node epsilon-max)``, a
release that would exceed the budget is refused before the masked input is computed, and an unmask
request naming fewer than ``privacy.min-parties`` survivors, or whose signed consistency check
(``SecAggClient.consistency``/``unmask``: the same survivor set signed by enough parties) gives fewer than
``privacy.min-parties`` parties that contributed data, is refused before any share is revealed. The
fingerprint of the key directory this party pinned (``directory_sha256`` in the facts file) is what its
owner compares with the other owners out of band: the coordinator relays every key, so a coordinator
that substitutes keys at setup is caught only that way. The PRG passes its known-answer test
at setup and before every masked input, and a masked input whose uniformity statistic fails is refused
(``distmoe.privacy.secagg.selftest``): a zero or broken PRG would send the input in the clear.

Persistence order (a SuperNode runs every message in a new process): the accountant is saved, then
the SecAgg state, and only then is the reply returned to be sent. A crash in between can only
over-count a release or make the party refuse a stage it already started; it can never let a stage be
answered twice.

Resume (``docs/operations.md``): a coordinator that restarts with ``run.resume`` runs a fresh setup (new
SecAgg keys) and may come with a new Flower run id. Its ``SetupRequest`` declares the logical run (the
coordinator's run id, unchanged across resumes) and the setup epoch (0, then 1, 2, ... per resume). The
accountant is keyed by the logical run, so whatever this party released before the restart stays
charged; a setup for an epoch not above the one this session already agreed to is refused, and a new
epoch replaces the SecAgg keys (the old session's secret state file is removed). A restarted party
needs no cleanup: all its state is in these files, written atomically. Trust assumption
(honest-but-curious server): the server names the logical run; a server that lied about it (a fresh
name for a continued run) could restart the party's budget count. A party that must not rely on that
sets a node ``epsilon-max`` over all runs it joins or runs one logical run per federation.

Must not: import ``flwr``, read another party's directory, or send anything itself.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from distmoe.config import NodeConfig, RunConfig
from distmoe.io import write_atomic, write_json_atomic, write_text_atomic
from distmoe.ledger import Ledger, generate_signing_key, load_signing_key, public_key_hex
from distmoe.privacy import secagg as sa
from distmoe.privacy.accountant import Accountant, BudgetExceeded, PrivacyEvent
from distmoe.privacy.plan import plan_privacy
from distmoe.privacy.secagg.selftest import mask_check_failure, mask_statistic, prg_known_answer
from distmoe.rundir import WorkDir
from distmoe.wire.errors import ErrorCode


class SessionError(RuntimeError):
    """The party refuses a protocol step. Its message (why) is detail for the party's own log; only
    ``code`` leaves (``SECAGG``, or ``BUDGET`` for a release over the party's privacy budget)."""

    def __init__(self, detail: str, code: int = ErrorCode.SECAGG):
        super().__init__(detail)
        self.code = ErrorCode(code)


def ledger_key(node: NodeConfig):
    """The party's Ed25519 ledger signing key: node config ``ledger-key`` when given (e.g. from
    ``distmoe credentials``), else ``<work-dir>/keys/<party>-ledger.key`` (created on first use, mode 0600)."""
    if node.ledger_key is not None:
        return load_signing_key(node.ledger_key)
    path = WorkDir(node.work_dir).ledger_key(node.party)
    if path.exists():
        return load_signing_key(path)
    try:
        return generate_signing_key(path)
    except FileExistsError:  # created concurrently
        return load_signing_key(path)


def open_ledger(node: NodeConfig) -> Ledger:
    """This party's ledger ``<work-dir>/ledger/<party>.jsonl`` (+ ``.pub`` with the public key)."""
    key = ledger_key(node)
    path = WorkDir(node.work_dir).ledger(node.party)
    pub = path.with_suffix(".pub")
    if not pub.exists():
        write_text_atomic(pub, public_key_hex(key) + "\n")
    return Ledger(path, key)


@dataclass
class _Facts:
    node_id: int
    secagg_run: str  # hex
    threshold: int
    max_length: int
    noise_multiplier: float
    update_noise_multiplier: float
    budget: float
    roster: list[int]
    names: dict[str, str]  # node id -> party name
    logical_run: str = ""  # "" in files from before resume support: the Flower run id
    epoch: int = 0
    n_invited: int = 0  # parties the server invited: fixes the SecAgg peer graph's degree (privacy.secagg-graph)
    directory_sha256: str = ""  # fingerprint of the pinned key directory (compare out of band)


class PartySession:
    def __init__(self, cfg: RunConfig, node: NodeConfig, run_id: str):
        self.cfg, self.node, self.run_id = cfg, node, str(run_id)
        self.files = WorkDir(node.work_dir)
        self.state_path = self.files.secagg_state(node.party, run_id)
        self.facts_path = self.files.facts(node.party, run_id)
        self.facts: _Facts | None = None
        self.accountant: Accountant | None = None
        self.client: sa.SecAggClient | None = None
        if self.facts_path.exists():
            self._load()

    def accountant_path(self, logical_run: str) -> Path:
        return self.files.accountant(self.node.party, logical_run)

    # ------------------------------------------------------------------ persistence
    @property
    def params(self) -> sa.SecAggParams:
        f = self._need()
        return sa.SecAggParams(bytes.fromhex(f.secagg_run), f.threshold, 64, f.max_length)

    @property
    def peers(self) -> sa.PeerGraph:
        """The SecAgg peer graph from public facts only (the coordinator derives the same one): this party's
        ``privacy.secagg-graph``, the SecAgg run id and the number of invited parties."""
        f = self._need()
        return sa.peer_graph(self.cfg.privacy.secagg_graph, bytes.fromhex(f.secagg_run), f.n_invited)

    def _need(self) -> _Facts:
        if self.facts is None:
            raise SessionError(f"party {self.node.party}: no secure-aggregation session for run {self.run_id} "
                               "(the setup stage never reached this party); it sits this run out")
        return self.facts

    def _load(self) -> None:
        try:
            d = json.loads(self.facts_path.read_text())
            self.facts = _Facts(**d["facts"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SessionError(f"party {self.node.party}: privacy session file {self.facts_path} is unreadable "
                               f"({type(exc).__name__}: {exc})") from None
        self.accountant = self._load_accountant(self.facts.logical_run or self.run_id)
        if self.accountant is None:
            raise SessionError(f"party {self.node.party}: the accountant of run "
                               f"{self.facts.logical_run or self.run_id} "
                               f"({self.accountant_path(self.facts.logical_run or self.run_id)}) is missing")
        if self.state_path.exists():
            self.client = sa.SecAggClient.from_state(self.params, self.state_path.read_bytes(),
                                                     cid=self.facts.node_id, peers=self.peers)

    def _load_accountant(self, logical_run: str) -> Accountant | None:
        path = self.accountant_path(logical_run)
        if not path.exists():
            return None
        try:
            d = json.loads(path.read_text())
            return Accountant.from_state_dict(d["accountant"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SessionError(f"party {self.node.party}: privacy accountant file {path} is unreadable "
                               f"({type(exc).__name__}: {exc}); it is never reset silently") from None

    def save(self) -> None:
        """Accountant first, then the facts, then the SecAgg state: all before the reply leaves. A file that
        already holds the same bytes is not rewritten (most messages change only the SecAgg state: two of the
        three files and their fsyncs are skipped)."""
        f = self._need()
        logical = f.logical_run or self.run_id
        path = self.accountant_path(logical)
        sessions = []
        if path.exists():
            try:
                sessions = list(json.loads(path.read_text()).get("sessions", []))
            except (OSError, ValueError, AttributeError):
                sessions = []
        if self.run_id not in sessions:
            sessions.append(self.run_id)
        write_json_atomic(path, {"logical_run": logical, "sessions": sessions,
                                 "accountant": self.accountant.state_dict()}, changed_only=True)
        write_json_atomic(self.facts_path, {"facts": f.__dict__}, changed_only=True)
        if self.client is not None:
            write_atomic(self.state_path, self.client.to_state(), mode=0o600, changed_only=True)

    # ------------------------------------------------------------------ setup
    def setup(self, req, node_id: int):
        """SetupRequest -> (KeyAdvert, ledger public key hex). A resumed run's setup (a higher epoch of the
        same logical run) replaces the SecAgg keys and keeps the accountant (module docstring)."""
        logical = str(getattr(req, "logical_run", "") or self.run_id)
        epoch = int(getattr(req, "epoch", 0))
        if self.facts is not None:
            same = (self.facts.logical_run or self.run_id) == logical
            if not same or epoch <= self.facts.epoch:
                raise SessionError(f"party {self.node.party}: a second setup request for run {self.run_id} (logical "
                                   f"run {logical}, epoch {epoch}; this session agreed to epoch {self.facts.epoch} "
                                   f"of {self.facts.logical_run or self.run_id}): refused, keys are agreed once per "
                                   "run and epoch")
        if (why := prg_known_answer()) is not None:  # before any key or masked input leaves
            raise SessionError(f"party {self.node.party}: {why}; its masks would not hide its inputs: refused")
        p = self.cfg.privacy
        own = plan_privacy(p, self.cfg.schedule)
        z = max(own.noise_multiplier, float(req.noise_multiplier))
        z_upd = max(own.update_noise_multiplier, float(req.update_noise_multiplier))
        if own.stats_releases and not z > 0:
            raise SessionError(f"party {self.node.party}: the plan has router-statistics releases but no noise")
        budget = min(p.epsilon, self.node.epsilon_max or math.inf)
        if req.threshold < p.min_parties:
            raise SessionError(f"party {self.node.party}: the server's SecAgg threshold {req.threshold} is below "
                               f"privacy.min-parties = {p.min_parties}")
        carried = self._load_accountant(logical)  # spent stays spent: a resumed run continues the same count
        if carried is not None:
            if carried.delta != p.delta:
                raise SessionError(f"party {self.node.party}: run {logical} was accounted at delta {carried.delta:g}, "
                                   f"this config says privacy.delta = {p.delta:g}: refused")
            budget = min(budget, carried.epsilon_budget)
        self.facts = _Facts(node_id=int(node_id), secagg_run=bytes(req.secagg_run).hex(), threshold=int(req.threshold),
                            max_length=int(req.max_length), noise_multiplier=z, update_noise_multiplier=z_upd,
                            budget=budget, roster=[], names={}, logical_run=logical, epoch=epoch,
                            n_invited=int(req.n_invited))
        if carried is not None:
            carried.epsilon_budget = budget
            self.accountant = carried
        else:
            self.accountant = Accountant(p.delta, budget)
        self._drop_old_sessions(logical)
        self.client = sa.SecAggClient(self.params, int(node_id), peers=self.peers)
        advert = self.client.advertise()
        self.save()
        return advert

    def _drop_old_sessions(self, logical: str) -> None:
        """Remove the secret SecAgg state of this logical run's earlier sessions (earlier Flower run ids):
        a new setup epoch replaced those keys, and nothing may answer for them again."""
        path = self.accountant_path(logical)
        if not path.exists():
            return
        try:
            sessions = json.loads(path.read_text()).get("sessions", [])
        except (OSError, ValueError, AttributeError):
            return
        for old in sessions:
            if str(old) != self.run_id:
                stale = self.files.secagg_state(self.node.party, str(old))
                stale.unlink(missing_ok=True)

    def directory(self, req) -> sa.ShareKeys:
        f = self._need()
        try:
            self.client.receive_directory(req.directory)
        except sa.SecAggAbort as exc:
            self.save()
            raise SessionError(f"party {self.node.party}: key directory refused: {exc}") from None
        f.roster = [cid for cid, _ in req.directory.keys]
        f.directory_sha256 = self.client.fingerprint or ""
        f.names = {str(i): n for i, n in req.names}
        keys = self.client.share_keys(req.first_round)
        self.save()
        return keys

    # ------------------------------------------------------------------ public facts of a release
    @property
    def n_parties(self) -> int:
        return len(self._need().roster)
    # ------------------------------------------------------------------ rounds
    def late_keys(self, round_: int) -> sa.ShareKeys:
        keys = self.client.share_keys(round_ + 1)
        self.save()
        return keys

    def charge(self, event: PrivacyEvent) -> float:
        """Compose a release into this party's accountant, or refuse it (nothing is sent)."""
        try:
            eps = self.accountant.spend(event)
        except BudgetExceeded as exc:
            raise SessionError(f"party {self.node.party}: {exc}; release refused before anything was sent",
                               ErrorCode.BUDGET) from None
        return eps

    def start_premask(self, start) -> Callable[[], sa.PreMask | None]:
        """Expand this round's masks (``SecAggClient.premask``: they do not depend on the input) in a second
        thread while the caller trains; returns ``join() -> PreMask | None`` (None: it failed, ``masked``
        then expands them itself and raises whatever is wrong with the start). The thread only reads the
        client's state; the caller must ``join()`` before the client changes (``masked``), also on error."""
        if self.client is None:
            return lambda: None
        box: dict[str, sa.PreMask | None] = {}

        def work() -> None:
            try:
                box["pm"] = self.client.premask(start)
            except Exception:  # noqa: BLE001  any failure: masked() expands the masks itself and names it
                box["pm"] = None

        thread = threading.Thread(target=work, name=f"distmoe-premask-{self.node.party}", daemon=True)
        thread.start()

        def join() -> sa.PreMask | None:
            thread.join()
            return box.get("pm")

        return join

    def masked(self, start, vec, *, contributed: bool, premask: sa.PreMask | None = None) -> sa.MaskedInput:
        """``contributed``: whether ``vec`` holds any of this party's data (its contributor bit, securely
        counted in the consistency check; the release needs ``privacy.min-parties`` contributors). ``vec`` is
        consumed: masked in place where it is an array of the round's words (its plaintext words are gone).
        ``premask``: this round's masks expanded ahead (``start_premask``), added in one pass."""
        if self.client is None:
            raise SessionError(f"party {self.node.party}: no SecAgg state for run {self.run_id}")
        if start.recipient != self._need().node_id:
            raise SessionError(f"party {self.node.party}: a round start addressed to node {start.recipient}")
        if (why := prg_known_answer()) is not None:
            raise SessionError(f"party {self.node.party}: {why}; its masks would not hide its inputs: refused")
        try:
            m = self.client.masked_input(start, vec, contributed=contributed, consume=True, premask=premask)
        except sa.SecAggAbort as exc:
            raise SessionError(f"party {self.node.party}: round {start.round}: {exc}") from None
        finally:
            self.save()
        if (why := mask_check_failure(mask_statistic(m.y))) is not None:  # the round stays MASKED: never re-sent
            raise SessionError(f"party {self.node.party}: round {start.round}: {why}: refused, nothing was sent")
        return m

    def consistency(self, request) -> sa.ConsistencyResponse:
        """Sign the survivor set of this round (once) with this party's share of the contributor count."""
        if self.client is None:
            raise SessionError(f"party {self.node.party}: no SecAgg state for run {self.run_id}")
        try:
            return self.client.consistency(request)
        except sa.SecAggAbort as exc:
            raise SessionError(f"party {self.node.party}: round {request.round}: {exc}") from None
        finally:
            self.save()

    def unmask(self, request) -> sa.UnmaskResponse:
        mp = self.cfg.privacy.min_parties
        if len(request.alive) < mp:
            raise SessionError(f"party {self.node.party}: unmask request for round {request.round} names "
                               f"{len(request.alive)} surviving parties, below privacy.min-parties = {mp}: refused")
        if self.client is None:
            raise SessionError(f"party {self.node.party}: no SecAgg state for run {self.run_id}")
        try:
            return self.client.unmask(request, min_contributors=mp)
        except sa.SecAggAbort as exc:
            raise SessionError(f"party {self.node.party}: round {request.round}: {exc}: nothing revealed") from None
        finally:
            self.save()
