"""The node config: one party's own facts (data directory, name, work directory, budget cap, ledger key, its own
hardware settings), from a SuperNode's ``--node-config`` or the node file ``distmoe simulate`` wrote.

Owns: :class:`NodeConfig` and :func:`parse_node_config`; the owner's hardware keys validated like ``train.*``.

Must not: import anything of distmoe outside this package, or read the party's data.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distmoe.config.federation_keys import SimConfig
from distmoe.config.keys import ConfigError, Scalar
from distmoe.config.run_keys import HARDWARE_KEYS, TrainConfig
from distmoe.config.schedule import TASK_RE
from distmoe.rundir import WorkDir, node_file


@dataclass(frozen=True)
class NodeConfig:
    """Node-local facts: this party's own data directory and work directory, nothing else."""

    party: str
    data_path: Path
    work_dir: Path
    model_path: str  # "" = use the run config's model.path
    epsilon_max: float | None = None  # this party's own budget cap: can only tighten privacy.epsilon
    ledger_key: Path | None = None  # Ed25519 ledger-signing key file; None = <work-dir>/keys/<party>-ledger.key
    hardware: tuple[tuple[str, Scalar], ...] = ()  # this owner's own train.<attr> settings (HARDWARE_KEYS)
    base_cache: Path | None = None  # where the loaded base is kept memory-mappable; None = off
    # print this party's own training progress (loss per round) to its stdout: on in a deployment, where
    # stdout is the SuperNode's log on the owner's machine; off in simulation (clients/app.py decides)
    progress_stdout: bool = False
    # the data owner's policy: node-config keys ``policy`` and ``policy-*`` as given (parsed and checked by
    # ``distmoe.party.policy``); () = no policy (today's behaviour: the run config decides)
    policy: tuple[tuple[str, Scalar], ...] = ()

    def train(self, train: TrainConfig) -> TrainConfig:
        """The run's ``train`` section with this node's hardware settings applied (validated like the keys)."""
        if not self.hardware:
            return train
        node_key = {attr: k for k, attr in HARDWARE_KEYS.items()}
        for attr, value in self.hardware:
            try:
                train = dataclasses.replace(train, **{attr: value})
            except ConfigError as exc:
                raise ConfigError(f"node config key '{node_key[attr]}' (party {self.party!r}): {exc}") from None
        return train



def parse_node_config(node_config: Mapping[str, Any], sim: SimConfig) -> NodeConfig:
    """Resolve this node's own facts.

    Deployment: the SuperNode's ``--node-config`` gives ``data-path`` (required), ``party-name``, ``work-dir``,
    ``model-path``, ``epsilon-max``, ``ledger-key`` (the party's Ed25519 ledger-signing key; default ``<work-
    dir>/keys/<party>-ledger.key``), and the owner's own hardware settings ``device``, ``dtype``, ``gradient-
    checkpointing``, ``micro-batch-size``, ``quantize`` (they override ``train.<key>`` at this party only), and
    ``base-cache`` (where a checkpoint's loaded base is kept memory-mappable for the next messages; default
    ``<work-dir>/base-cache``, ``"off"`` to disable). Simulation: Flower only injects ``partition-id``;
    ``distmoe simulate`` wrote one node file per virtual SuperNode (``<sim.nodes-dir>/node-<id>.toml``) with the
    same keys, so each virtual node sees exactly one party directory.
    """
    nc = dict(node_config)
    if "data-path" not in nc:
        if "partition-id" in nc and sim.nodes_dir:
            path = node_file(sim.nodes_dir, int(nc["partition-id"]))
            try:
                with path.open("rb") as fh:
                    nc = {**tomllib.load(fh), **{k: v for k, v in nc.items() if k != "data-path"}}
            except FileNotFoundError:
                raise ConfigError(f"node config: simulation node file {path} not found") from None
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"node config: {path} is not valid TOML: {exc}") from None
        else:
            raise ConfigError("node config: 'data-path' is missing: start the SuperNode with "
                              "--node-config 'data-path=\"/path/to/party-dir\"' (or use distmoe simulate)")
    for key in ("data-path", "party-name", "work-dir", "model-path", "ledger-key", "base-cache"):
        if key in nc and not isinstance(nc[key], str):
            raise ConfigError(f"node config key '{key}': value {nc[key]!r} must be a string")
    eps_max = nc.get("epsilon-max")
    if eps_max is not None:
        if isinstance(eps_max, bool) or not isinstance(eps_max, (int, float)) or not 0 < float(eps_max) < math.inf:
            raise ConfigError(f"node config key 'epsilon-max': value {eps_max!r} must be a number > 0")
        eps_max = float(eps_max)
    data_path = Path(nc["data-path"]).expanduser()
    if not data_path.is_dir():
        raise ConfigError(f"node config key 'data-path': {str(data_path)!r} is not a directory "
                          "(expected one directory of <task>.jsonl files for this party)")
    party = nc.get("party-name") or data_path.name
    if not TASK_RE.match(party):
        raise ConfigError(f"node config key 'party-name': value {party!r} must use letters, digits, '-', '_'")
    work = Path(nc.get("work-dir") or (data_path.parent / f"{party}-work")).expanduser()
    legacy = data_path.parent / f".{party}-work"  # the earlier hidden default: its ledger and budget must not be lost
    if not nc.get("work-dir") and legacy.is_dir():
        raise ConfigError(f"node config: no 'work-dir', and {str(legacy)!r} holds this party's earlier work "
                          f"(ledger, privacy budget): set work-dir to it, or move it to {str(work)!r}")
    ledger_key = Path(nc["ledger-key"]).expanduser() if nc.get("ledger-key") else None
    if ledger_key is not None and not ledger_key.is_file():
        raise ConfigError(f"node config key 'ledger-key': {str(ledger_key)!r} is not a file (expected this "
                          "party's Ed25519 ledger-signing key, e.g. ledger.key made by 'distmoe credentials')")
    hardware = tuple((attr, nc[k]) for k, attr in HARDWARE_KEYS.items() if k in nc)
    cache = nc.get("base-cache", "")
    base_cache = None if cache == "off" else Path(cache).expanduser() if cache else WorkDir(work).base_cache
    policy = tuple(sorted((k, v) for k, v in nc.items() if k == "policy" or k.startswith("policy-")))
    node = NodeConfig(party=party, data_path=data_path, work_dir=work, model_path=nc.get("model-path", ""),
                      epsilon_max=eps_max, ledger_key=ledger_key, hardware=hardware, base_cache=base_cache,
                      policy=policy)
    node.train(TrainConfig())  # the owner's hardware keys are validated here, before anything runs
    return node
