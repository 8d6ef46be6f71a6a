"""The run directory's one owner: its layout, the metrics log and the one reader of a run.

Every file and folder a run writes is named once, in :mod:`distmoe.rundir.layout` (``RunDir(root)`` for a run
directory, ``WorkDir(root)`` for a party's work directory); the metrics log's format is
:mod:`distmoe.rundir.metrics`; the report, the audit, resume, rollback and export read a run through
:func:`~distmoe.rundir.load.load_run`. The layout, with the attribute that names each path::

    RUN/                                  RunDir(RUN)
    ├── run.json                          .record           the run record (coordinator/record.py; simulate ends it)
    ├── metrics.jsonl                     .metrics          one JSON object a line (rundir/metrics.py)
    ├── metrics.lost.jsonl                .metrics_lost     lines of rounds lost in a crash, set aside on resume
    ├── config.toml                       .config           the run's flat config (export rebuilds the model from it)
    ├── ledger/coordinator.jsonl          .ledger           the coordinator's signed ledger
    ├── ledger/coordinator.pub            .ledger_pub       its public key (hex)
    ├── keys/coordinator.key              .ledger_key       its signing key (0600)
    ├── privacy/ledger.json               .accounts         the server's accountants, one per party
    ├── privacy/secagg-server.state       .secagg_state     the server's secure-aggregation state
    ├── checkpoints/                      .checkpoints      round-<n>/ and LATEST (inside: distmoe/checkpoint.py)
    ├── anchors/                          .anchors          round-<n>.npz + .json (inside: distmoe/routing/anchor.py)
    ├── report/report.md, *.png           .report, .report_md    `distmoe report`
    ├── tensorboard/                      .tensorboard      `report.tensorboard`
    ├── audit/audit.json, audit.md        .audit            `distmoe audit`
    ├── export/round-<n>/                 .export           `distmoe export`
    │   written by `distmoe simulate` only:
    ├── simulate.json, simulate.lock      .simulate_record, .lock
    ├── flower.log                        .flower_log
    ├── overrides.toml, overrides.resume.toml   .overrides(resume)
    ├── nodes/node-<i>.toml               .nodes, .node_file(i), .node_files() (node-*.toml)   one per SuperNode
    ├── flwr/ home/ tmp/ ray/             .flwr_home, .home, .tmp, .ray   Flower's and Ray's state
    └── work/                             .work
        ├── data/party-<i>/               .synth_data       the synthetic demo data
        └── <party>/                      .party(name)      a WorkDir
    RUN/../base-cache/                    .base_cache       the warm-up base, shared by the runs beside it

    WORK/                                 WorkDir(WORK): a party's `work-dir` (the owner's, across runs)
    ├── ledger/<party>.jsonl, .pub        .ledger(party)   (+ .jsonl.verified: the writer's tagged note of the
    │                                                        prefix it verified, distmoe.ledger.writer)
    ├── keys/<party>-ledger.key           .ledger_key(party)
    ├── secagg/<party>-<run>.state        .secagg_state(party, run)
    ├── privacy/                          .privacy          its privacy budget:
    ├── privacy/<party>-<run>.json        .facts(party, run)          the public parameters it agreed to
    ├── privacy/<party>-<run>.accountant.json   .accountant(party, logical run)
    ├── privacy/<party>-<run>.receipt-state     .receipt_state(party, run)   the receipt's facts so far, tagged
    ├── receipts/<party>-<run>.json       .receipt(party, run)
    ├── metrics/<party>.jsonl             .metrics(party)   its own training figures (never sent)
    ├── policy/runs.json                  .policy_runs      the runs this owner's party set up
    ├── retention/pretask-<hash>.safetensors   .pretask(hash), .pretask_files() (pretask-*.safetensors)
    ├── base-cache/                       .base_cache
    └── party.log                         .party_log        the detail of each refusal (never sent)

``<run>`` is a run id made safe for a file name (``layout.safe_name``). The architecture test fails when one of
these names is written as a literal anywhere else in the package.

Must not: import torch, ``flwr`` or any distmoe module above ``distmoe.io`` (every layer that writes or reads a
run imports this one), or interpret what a run's records mean.
"""

from distmoe.rundir.layout import COORDINATOR, RunDir, WorkDir, node_file, safe_name
from distmoe.rundir.load import (
    LedgerFile,
    LoadedRun,
    MissingRunFile,
    RunFileError,
    load_run,
    read_json,
    read_ledger,
)
from distmoe.rundir.metrics import MetricsLog, MetricsRecords, read_metrics

__all__ = ["COORDINATOR", "LedgerFile", "LoadedRun", "MetricsLog", "MetricsRecords", "MissingRunFile", "RunDir",
           "RunFileError", "WorkDir", "load_run", "node_file", "read_json", "read_ledger", "read_metrics",
           "safe_name"]
