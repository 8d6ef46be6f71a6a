"""The data owner's policy: the privacy floors a party holds a run config to, set by the owner, not the coordinator.

In Flower the run config comes from whoever submits the run (the coordinator); the node config is the data
owner's. Without a policy a coordinator could switch privacy off through the run config (``privacy.mode =
"plaintext"`` made unmodified parties send plain updates), or lower ``privacy.min-parties`` and the noise. With
one, the party checks every message's run config against the owner's floors before any work, and the setup
request's SecAgg threshold and noise against them at setup, and refuses a run below a floor with the fixed
reason code of that policy key (``distmoe.wire.errors``, 1009-1016: no data-dependent detail; the detail goes to
the party's own log). ``docs/deploy.md`` §2.3 documents the keys; ``docs/privacy.md`` §1.2 the attacks.

Node config keys (``distmoe deploy supernode`` writes ``policy = "deployed"`` and its ``--policy-*`` flags):

| key | deployed default | the run is refused when |
|---|---|---|
| ``policy`` | ``"deployed"`` | (turns the policy on; any ``policy-*`` key does too) |
| ``policy-allow-plaintext`` | false | ``privacy.mode = "plaintext"`` and this is false |
| ``policy-allow-unpinned`` | false | (no refusal: without a code pin the audit reports a violation unless true) |
| ``policy-min-parties`` | 3 | ``privacy.min-parties`` or the setup's SecAgg threshold is below it |
| ``policy-min-noise-multiplier`` | 0.5 | the router-statistics z (``max(own plan, server's)``) is below it |
| ``policy-min-metric-noise-multiplier`` | 1.0 | ``privacy.metric-noise-multiplier`` is below it (eval phases) |
| ``policy-min-update-noise-multiplier`` | 0.0 | the update z_u (``max(own plan, server's)``) is below it (sft/rl/dpo) |
| ``policy-phases`` | ``"sft,rl,dpo,stats,eval"`` | the schedule has another phase kind |
| ``policy-max-rounds`` | 1000 | the schedule, or a round index, goes beyond it |
| ``policy-max-runs`` | 50 | this work directory already set up that many other runs (probing bound) |
| ``epsilon-max`` | 8.0 | (not a refusal: the party's budget is ``min(privacy.epsilon, epsilon-max)``) |

A floor applies only where the run releases what it protects (no ``stats`` phase: no router-statistics floor).
Without any ``policy`` key (``distmoe simulate``, the in-process transport) there is no policy: today's behaviour.

Also owns what a party with a policy does at setup besides the floors: the policy's canonical JSON and digest
and the owner's code-pin digest (set by the pinned launcher, ``clients/pinned.py``) for the party's signed ledger
(``ledger_facts``), the work directory made private (0700) and the pre-run privacy check of the data and work
directories (``distmoe.wire.at_rest``), and the count of runs set up in the work directory.

Must not: import ``flwr``, read the party's data (only the run config, the node config and its own files).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from distmoe.config import PHASE_KINDS, UPDATE_KINDS, ConfigError, NodeConfig, RunConfig
from distmoe.deploy.pin import active_digest
from distmoe.io import write_json_atomic
from distmoe.ledger import canonical_json
from distmoe.privacy.plan import plan_privacy
from distmoe.rundir import WorkDir
from distmoe.wire.at_rest import PreflightError, make_private, privacy_preflight
from distmoe.wire.errors import ErrorCode, Refused

POLICY_FORMAT = "distmoe-owner-policy/1"


@dataclass(frozen=True)
class OwnerPolicy:
    allow_plaintext: bool = False
    allow_unpinned: bool = False  # the owner's explicit opt-out of the code pin (recorded, judged by the audit)
    min_parties: int = 3
    min_noise_multiplier: float = 0.5
    min_metric_noise_multiplier: float = 1.0
    min_update_noise_multiplier: float = 0.0
    phases: tuple[str, ...] = PHASE_KINDS
    max_rounds: int = 1000
    max_runs: int = 50
    epsilon_max: float = 8.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["phases"] = sorted(self.phases)
        return {"format": POLICY_FORMAT, **d}

    def canonical(self) -> str:
        return canonical_json(self.as_dict())

    def digest(self) -> str:
        return hashlib.sha256(self.canonical().encode("ascii")).hexdigest()

    # ---------------------------------------------------------------- checks
    def check_run(self, cfg: RunConfig) -> None:
        """The run config alone, at every message before any work: ``Refused`` with the policy key's code."""
        p, sched = cfg.privacy, cfg.schedule
        kinds = {ph.kind for ph in sched.phases}
        if not p.secure and not self.allow_plaintext:
            _refuse(ErrorCode.POLICY_PLAINTEXT, f"privacy.mode = {p.mode!r}, the owner requires secure aggregation")
        if p.min_parties < self.min_parties:
            _refuse(ErrorCode.POLICY_MIN_PARTIES, f"privacy.min-parties = {p.min_parties} < {self.min_parties}")
        if p.secure and "eval" in kinds and p.metric_noise_multiplier < self.min_metric_noise_multiplier:
            _refuse(ErrorCode.POLICY_METRIC_NOISE, f"privacy.metric-noise-multiplier = {p.metric_noise_multiplier:g} "
                    f"< {self.min_metric_noise_multiplier:g}")
        if kinds & set(UPDATE_KINDS) and p.update_noise_multiplier < self.min_update_noise_multiplier:
            _refuse(ErrorCode.POLICY_UPDATE_NOISE, f"privacy.update-noise-multiplier = {p.update_noise_multiplier:g} "
                    f"< {self.min_update_noise_multiplier:g}")
        if not p.secure and "stats" in kinds and self.min_noise_multiplier > 0:  # plaintext statistics: no noise
            _refuse(ErrorCode.POLICY_NOISE, f"plaintext router statistics carry no noise (floor "
                    f"{self.min_noise_multiplier:g})")
        if not kinds <= set(self.phases):
            _refuse(ErrorCode.POLICY_PHASES, f"schedule phases {sorted(kinds - set(self.phases))} not in "
                    f"{sorted(self.phases)}")
        if sched.total_rounds > self.max_rounds:
            _refuse(ErrorCode.POLICY_ROUNDS, f"the schedule has {sched.total_rounds} rounds > {self.max_rounds}")

    def check_setup(self, cfg: RunConfig, threshold: int, noise_multiplier: float,
                    update_noise_multiplier: float) -> None:
        """The setup request's public parameters against the floors, before any key leaves: the threshold, and the
        noise the party will use (the larger of its own plan and the server's, as ``PartySession.setup`` does)."""
        own = plan_privacy(cfg.privacy, cfg.schedule)
        if threshold < self.min_parties:
            _refuse(ErrorCode.POLICY_MIN_PARTIES, f"SecAgg threshold {threshold} < {self.min_parties}")
        z = max(own.noise_multiplier, float(noise_multiplier))
        if own.stats_releases and z < self.min_noise_multiplier:
            _refuse(ErrorCode.POLICY_NOISE, f"router-statistics z = {z:g} < {self.min_noise_multiplier:g} "
                    f"(privacy.epsilon = {cfg.privacy.epsilon:g}, privacy.noise-multiplier = "
                    f"{cfg.privacy.noise_multiplier:g})")
        z_u = max(own.update_noise_multiplier, float(update_noise_multiplier))
        updates = any(ph.kind in UPDATE_KINDS for ph in cfg.schedule.phases)
        if updates and z_u < self.min_update_noise_multiplier:
            _refuse(ErrorCode.POLICY_UPDATE_NOISE, f"update z_u = {z_u:g} < {self.min_update_noise_multiplier:g}")

    def check_round(self, round_: int) -> None:
        """A round index beyond the cap (the SecAgg client answers each round once, so indices bound the count)."""
        if int(round_) > self.max_rounds:
            _refuse(ErrorCode.POLICY_ROUNDS, f"round {round_} > {self.max_rounds}")

    def count_run(self, node: NodeConfig, run_id: str) -> None:
        """Record ``run_id`` in ``<work-dir>/policy/runs.json``; refuse a new run once ``max_runs`` others are there.
        Each run config a coordinator tries is a run: this bounds how often it can probe this party."""
        path = WorkDir(node.work_dir).policy_runs
        try:
            runs = list(json.loads(path.read_text())["runs"]) if path.exists() else []
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise Refused(f"party {node.party}: run count {path} is unreadable ({type(exc).__name__}); it is never "
                          "reset silently", ErrorCode.POLICY_RUNS) from None
        if str(run_id) in runs:
            return
        if len(runs) >= self.max_runs:
            _refuse(ErrorCode.POLICY_RUNS, f"{len(runs)} runs already set up in {node.work_dir} (policy-max-runs = "
                    f"{self.max_runs}); run {run_id} refused")
        write_json_atomic(path, {"runs": [*runs, str(run_id)]})


def _refuse(code: ErrorCode, detail: str) -> None:
    raise Refused(f"owner policy: {detail}: refused before anything was sent", code)


_FLOATS = {"policy-min-noise-multiplier": "min_noise_multiplier",
           "policy-min-metric-noise-multiplier": "min_metric_noise_multiplier",
           "policy-min-update-noise-multiplier": "min_update_noise_multiplier"}
_INTS = {"policy-min-parties": ("min_parties", 2), "policy-max-rounds": ("max_rounds", 1),
         "policy-max-runs": ("max_runs", 1)}
_BOOLS = {"policy-allow-plaintext": "allow_plaintext", "policy-allow-unpinned": "allow_unpinned"}
KEYS = ("policy", *_BOOLS, *_FLOATS, *_INTS, "policy-phases")


def owner_policy(node: NodeConfig) -> OwnerPolicy | None:
    """The node's policy (deployed defaults, then its ``policy-*`` keys), or None when it sets none.
    ``ConfigError`` names the bad key."""
    given = dict(node.policy)
    if not given:
        return None
    vals: dict = {}
    for k, v in given.items():
        where = f"node config key '{k}'"
        if k not in KEYS:
            raise ConfigError(f"{where}: unknown policy key (allowed: {', '.join(KEYS)})")
        if k == "policy":
            if v != "deployed":
                raise ConfigError(f"{where}: value {v!r} must be \"deployed\" (the floors are the policy-* keys)")
        elif k in _BOOLS:
            if not isinstance(v, bool):
                raise ConfigError(f"{where}: value {v!r} must be true or false")
            vals[_BOOLS[k]] = v
        elif k in _FLOATS:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= float(v) < 1e6:
                raise ConfigError(f"{where}: value {v!r} must be a number in [0, 1e6)")
            vals[_FLOATS[k]] = float(v)
        elif k in _INTS:
            attr, lo = _INTS[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{where}: value {v!r} must be an integer >= {lo}")
            vals[attr] = v
        else:  # policy-phases
            kinds = tuple(sorted({s.strip() for s in str(v).split(",") if s.strip()}))
            if not kinds or not set(kinds) <= set(PHASE_KINDS):
                raise ConfigError(f"{where}: value {v!r} must list phase kinds from {', '.join(PHASE_KINDS)}")
            vals["phases"] = kinds
    if node.epsilon_max is not None:
        vals["epsilon_max"] = float(node.epsilon_max)
    return OwnerPolicy(**vals)


def code_pin_digest() -> str | None:
    """The owner's code-pin digest when this process is the pinned launcher's ClientApp (``clients/pinned.py``
    sets it in this process after the bundle and the install matched the pin), else None."""
    return active_digest()


def policy_facts(policy: OwnerPolicy | None) -> dict | None:
    """The policy as the ledger and the receipt record it: ``{"policy": canonical dict, "sha256"}``, or None."""
    return None if policy is None else {"policy": policy.as_dict(), "sha256": policy.digest()}


def ledger_facts(policy: OwnerPolicy | None) -> dict:
    """What the party records in its signed ledger at setup (the key advert's ``out`` entry, ``info``): the policy
    it checked the run against (canonical JSON and sha256; None without one) and the code-pin digest (None:
    not started by the pinned launcher)."""
    return {"owner_policy": policy_facts(policy), "code_pin": code_pin_digest()}


def secure_work_dir(node: NodeConfig) -> None:
    """Make the work directory private (0700/0600) and run the pre-run privacy check on the data and work
    directories (``distmoe.wire.at_rest``: no group/other bits, no detail on stdout); ``Refused`` (``config``)
    names the problem in the party's own log."""
    for sub in WorkDir.SUBDIRS:  # made now, so that they are private too (the later writers keep their modes)
        (node.work_dir / sub).mkdir(parents=True, exist_ok=True)
    make_private(node.work_dir)
    try:
        privacy_preflight({node.party: [Path(node.data_path), node.work_dir]}, when="at this party's setup")
    except PreflightError as exc:
        raise Refused(f"party {node.party}: {exc}", ErrorCode.CONFIG) from None
