"""Every name inside a run directory and a party's work directory, declared once: ``RunDir`` and ``WorkDir``.

Owns: the file and folder names (the tree is drawn in :mod:`distmoe.rundir`), the paths built from them, the few
globs that find them again (``party_ledgers``, ``node_files``, ``pretask_files``) and how a run id becomes part of a
file name (:func:`safe_name`). A name here is the one every writer and reader uses: the coordinator, the parties,
``distmoe simulate``, the report, the audit, resume, rollback and export.

Must not: read or write a file (``distmoe.rundir.load`` reads, each owner of a record writes), import anything of
distmoe, or hold the layout inside a checkpoint (``distmoe.checkpoint``) or an anchor version
(``distmoe.routing.anchor``): those folders are named here, their contents there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# the coordinator's node name: its ledger and key are named after it, and parties record its ledger heads under it
COORDINATOR = "coordinator"

# the names of a run directory (RunDir), in the order of the tree in distmoe.rundir
RUN_RECORD = "run.json"
METRICS = "metrics.jsonl"
METRICS_LOST = "metrics.lost.jsonl"
CONFIG = "config.toml"
LEDGER_DIR = "ledger"
KEYS_DIR = "keys"
PRIVACY_DIR = "privacy"
ACCOUNTS = "ledger.json"
SECAGG_STATE = "secagg-server.state"
CHECKPOINTS = "checkpoints"
ANCHORS = "anchors"
REPORT_DIR = "report"
REPORT_MD = "report.md"
REPORT_PLOTS = ("loss.png", "routing.png", "tasks.png", "rl.png")  # the report's plots, beside report.md
REPORT_FILES = (REPORT_MD, *REPORT_PLOTS)  # every file `distmoe report` writes (the audit allows no other)
TENSORBOARD = "tensorboard"
AUDIT_DIR = "audit"
AUDIT_JSON = "audit.json"
AUDIT_MD = "audit.md"
EXPORT_DIR = "export"
SIMULATE_RECORD = "simulate.json"
SIMULATE_LOCK = "simulate.lock"
FLOWER_LOG = "flower.log"
OVERRIDES = "overrides.toml"
OVERRIDES_RESUME = "overrides.resume.toml"
NODES_DIR = "nodes"
FLWR_HOME = "flwr"
HOME = "home"
TMP = "tmp"
RAY = "ray"
WORK_DIR = "work"
SYNTH_DATA = "data"
BASE_CACHE = "base-cache"  # beside the run directory (the coordinator's warm-up base) and in a work directory

# the names of a party's work directory (WorkDir)
SECAGG_DIR = "secagg"
RECEIPTS_DIR = "receipts"
METRICS_DIR = "metrics"
POLICY_DIR = "policy"
POLICY_RUNS = "runs.json"
RETENTION_DIR = "retention"
PARTY_LOG = "party.log"

# what a simulation keeps inside the run directory that is not the coordinator's (the audit skips it)
SIMULATION_DIRS = (FLWR_HOME, HOME, TMP, RAY)
SIMULATION_FILES = (SIMULATE_RECORD, OVERRIDES, OVERRIDES_RESUME, SIMULATE_LOCK)
# the folders of a run directory whose files are not the coordinator's own records (the audit's server-files skip)
UNRECORDED_DIRS = (WORK_DIR, LEDGER_DIR, AUDIT_DIR, KEYS_DIR, REPORT_DIR, TENSORBOARD)


def safe_name(run_id: str) -> str:
    """A run id as part of a file name: letters, digits, ``-`` and ``_`` kept, anything else ``_``, at most 80."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in str(run_id))[:80] or "run"


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory (the coordinator's ``run.dir``; the tree: :mod:`distmoe.rundir`)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(os.fspath(self.root)))

    # ---- the coordinator's records
    @property
    def record(self) -> Path:
        return self.root / RUN_RECORD

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def metrics_lost(self) -> Path:
        return self.root / METRICS_LOST

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def ledger(self) -> Path:
        return self.root / LEDGER_DIR / f"{COORDINATOR}.jsonl"

    @property
    def ledger_pub(self) -> Path:
        return self.ledger.with_suffix(".pub")

    @property
    def ledger_key(self) -> Path:
        return self.root / KEYS_DIR / f"{COORDINATOR}.key"

    @property
    def privacy(self) -> Path:
        return self.root / PRIVACY_DIR

    @property
    def accounts(self) -> Path:
        return self.privacy / ACCOUNTS

    @property
    def secagg_state(self) -> Path:
        return self.privacy / SECAGG_STATE

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def anchors(self) -> Path:
        return self.root / ANCHORS

    @property
    def base_cache(self) -> Path:
        """The coordinator's default warm-up base cache: beside the run directory, shared by the runs there."""
        return self.root.parent / BASE_CACHE

    # ---- what is written from the records afterwards
    @property
    def report(self) -> Path:
        return self.root / REPORT_DIR

    @property
    def report_md(self) -> Path:
        return self.report / REPORT_MD

    def report_plot(self, name: str) -> Path:
        """One of the report's plots (``REPORT_PLOTS``, named without ``.png``: ``loss``)."""
        if f"{name}.png" not in REPORT_PLOTS:
            raise ValueError(f"{name!r} is not a plot of the report ({', '.join(REPORT_PLOTS)})")
        return self.report / f"{name}.png"

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD

    @property
    def audit(self) -> Path:
        return self.root / AUDIT_DIR

    @property
    def export(self) -> Path:
        return self.root / EXPORT_DIR

    # ---- distmoe simulate's own files
    @property
    def simulate_record(self) -> Path:
        return self.root / SIMULATE_RECORD

    @property
    def lock(self) -> Path:
        return self.root / SIMULATE_LOCK

    @property
    def flower_log(self) -> Path:
        return self.root / FLOWER_LOG

    def overrides(self, resume: bool = False) -> Path:
        return self.root / (OVERRIDES_RESUME if resume else OVERRIDES)

    @property
    def nodes(self) -> Path:
        return self.root / NODES_DIR

    def node_file(self, index: int) -> Path:
        return node_file(self.nodes, index)

    def node_files(self) -> list[Path]:
        return sorted(self.nodes.glob("node-*.toml"))

    @property
    def flwr_home(self) -> Path:
        return self.root / FLWR_HOME

    @property
    def home(self) -> Path:
        return self.root / HOME

    @property
    def tmp(self) -> Path:
        return self.root / TMP

    @property
    def ray(self) -> Path:
        return self.root / RAY

    @property
    def work(self) -> Path:
        return self.root / WORK_DIR

    @property
    def synth_data(self) -> Path:
        return self.work / SYNTH_DATA

    def party(self, name: str) -> WorkDir:
        """A simulated party's work directory, ``work/<name>``."""
        return WorkDir(self.work / name)

    def party_ledgers(self) -> list[Path]:
        """Every party ledger under ``work/`` (a simulation's), sorted."""
        return sorted(self.work.glob(f"*/{LEDGER_DIR}/*.jsonl"))


def node_file(nodes_dir: str | os.PathLike[str], index: int) -> Path:
    """The node file of virtual SuperNode ``index`` in a simulation's nodes folder (``sim.nodes-dir``)."""
    return Path(nodes_dir) / f"node-{int(index)}.toml"


@dataclass(frozen=True)
class WorkDir:
    """The paths of one party's work directory (``work-dir`` of its node config; ``RUN/work/<party>`` in a
    simulation). It is the owner's across runs: the per-run files carry the run id (:func:`safe_name`)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(os.fspath(self.root)))

    @classmethod
    def of_ledger(cls, ledger: str | os.PathLike[str]) -> WorkDir:
        """The work directory a party ledger file lies in (``<work-dir>/ledger/<party>.jsonl``)."""
        return cls(Path(ledger).parent.parent)

    SUBDIRS = (LEDGER_DIR, KEYS_DIR, SECAGG_DIR, PRIVACY_DIR, METRICS_DIR, POLICY_DIR)  # made private up front

    def ledger(self, party: str) -> Path:
        return self.root / LEDGER_DIR / f"{party}.jsonl"

    def ledger_key(self, party: str) -> Path:
        return self.root / KEYS_DIR / f"{party}-ledger.key"

    @property
    def privacy(self) -> Path:
        """The party's privacy budget: its accountants and the facts it agreed to, per run."""
        return self.root / PRIVACY_DIR

    def secagg_state(self, party: str, run_id: str) -> Path:
        return self.root / SECAGG_DIR / f"{party}-{safe_name(run_id)}.state"

    def facts(self, party: str, run_id: str) -> Path:
        """The public parameters a party agreed to for one run (its privacy session's facts)."""
        return self.privacy / f"{party}-{safe_name(run_id)}.json"

    def accountant(self, party: str, logical_run: str) -> Path:
        return self.privacy / f"{party}-{safe_name(logical_run)}.accountant.json"

    def receipt(self, party: str, run_id: str) -> Path:
        return self.root / RECEIPTS_DIR / f"{party}-{safe_name(run_id)}.json"

    def receipt_state(self, party: str, run_id: str) -> Path:
        """The receipt's facts so far and where in the ledger they end, tagged with the ledger key: the next reply
        reads only the ledger entries after them (``distmoe.party.receipt``)."""
        return self.privacy / f"{party}-{safe_name(run_id)}.receipt-state"

    def metrics(self, party: str) -> Path:
        return self.root / METRICS_DIR / f"{party}.jsonl"

    @property
    def policy_runs(self) -> Path:
        return self.root / POLICY_DIR / POLICY_RUNS

    @property
    def retention(self) -> Path:
        return self.root / RETENTION_DIR

    def pretask(self, model_hash: str) -> Path:
        """The pre-task model copy of output distillation, named by the hash the coordinator sends."""
        return self.retention / f"pretask-{model_hash}.safetensors"

    def pretask_files(self) -> list[Path]:
        return sorted(self.retention.glob("pretask-*.safetensors"))

    @property
    def party_log(self) -> Path:
        return self.root / PARTY_LOG

    @property
    def base_cache(self) -> Path:
        return self.root / BASE_CACHE
