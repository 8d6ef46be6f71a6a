"""The one declaration and parser of the run configuration: Flower run config + node config -> frozen,
validated dataclasses.

Owns: the declaration of every run-config key, once: the frozen section dataclasses of the ``*_keys`` modules ARE
the declaration. Each field is made by :func:`~distmoe.config.keys.key` (default, one-line doc, range or choices,
and its fence: whether a resumed run may change it, whether it is privacy-relevant, whether it is an experimental
research knob); the key's name is ``<section>.<field name with _ -> ->`` and its type comes from the annotation.
Everything else is derived from it: ``DEFAULTS``, ``KEYS``, ``RESUME_MAY_CHANGE``, ``PRIVACY_KEYS``, the type and
range checks (a section validates itself when it is constructed, so ``RLConfig(group_size=1)`` fails like the run
config would), the ``pyproject.toml`` ``[tool.flwr.app.config]`` block and the key table of
``docs/configuration.md`` (both written by ``distmoe config sync``, see :mod:`distmoe.config_sync`; a unit test
fails when they drift).

The parts: :mod:`~distmoe.config.keys` (how a key is declared), :mod:`~distmoe.config.run_keys`,
:mod:`~distmoe.config.routing_keys`, :mod:`~distmoe.config.rl_keys`, :mod:`~distmoe.config.federation_keys` (the
sections), :mod:`~distmoe.config.schedule` (the phase kinds and the schedule grammar),
:mod:`~distmoe.config.parse` (the run-config parser, checks across sections, retired keys),
:mod:`~distmoe.config.files` (TOML files and override strings), :mod:`~distmoe.config.node` (the node config).
Callers import from ``distmoe.config``; the names below are its public surface.

Must not: import ``flwr`` or anything of distmoe outside this package, touch models or data, or be bypassed.
Library code receives the narrowest section (``cfg.train``, ``cfg.routing``), never the raw mapping.
"""

from distmoe.config.federation_keys import (
    PRIVACY_MODES,
    ROUND_FAILURE_POLICIES,
    SECAGG_GRAPHS,
    CheckpointConfig,
    EvalConfig,
    FederationConfig,
    PrivacyConfig,
    ReportConfig,
    ScheduleConfig,
    SimConfig,
)
from distmoe.config.files import flatten, load_override_file, parse_kv_pairs, to_toml
from distmoe.config.keys import SECTIONS, ConfigError, KeySpec, Scalar, Section, key, section
from distmoe.config.node import NodeConfig, parse_node_config
from distmoe.config.parse import (
    DEFAULTS,
    EXPERIMENTAL_KEYS,
    KEYS,
    PRIVACY_KEYS,
    RENAMED,
    RESUME_MAY_CHANGE,
    RETIRED,
    RunConfig,
    parse_run_config,
    parse_section,
    replace,
    resolve,
)
from distmoe.config.rl_keys import (
    CORRECTIONS,
    DPO_REFERENCES,
    ENGINE_PARTS,
    POLICY_LOSSES,
    REWARDS,
    DPOConfig,
    RLConfig,
)
from distmoe.config.routing_keys import (
    AUX_SCOPES,
    BALANCE_COUNTS,
    BALANCE_MODES,
    BALANCE_SOURCES,
    GRANULARITIES,
    SETTLE_SCHEDULES,
    TASK_ANCHOR_MODES,
    Balance,
    RetentionConfig,
    RoutingConfig,
)
from distmoe.config.run_keys import (
    DTYPES,
    EXPERT_SCHEDULES,
    HARDWARE_KEYS,
    QUANTIZE_MODES,
    TRAINABLE_MODES,
    DataConfig,
    ModelConfig,
    RunSection,
    TrainConfig,
)
from distmoe.config.schedule import (
    PHASE_KINDS,
    UPDATE_KINDS,
    Phase,
    continual_schedule,
    expansion_tasks,
    parse_schedule,
    schedule_text,
    with_eval_cadence,
)

__all__ = [
    "AUX_SCOPES", "BALANCE_COUNTS", "BALANCE_MODES", "BALANCE_SOURCES", "CORRECTIONS", "DEFAULTS", "DPO_REFERENCES",
    "DTYPES", "ENGINE_PARTS", "EXPERIMENTAL_KEYS", "EXPERT_SCHEDULES", "GRANULARITIES", "HARDWARE_KEYS", "KEYS",
    "PHASE_KINDS", "POLICY_LOSSES", "PRIVACY_KEYS", "PRIVACY_MODES", "QUANTIZE_MODES", "RENAMED", "RESUME_MAY_CHANGE",
    "RETIRED", "REWARDS", "ROUND_FAILURE_POLICIES", "SECAGG_GRAPHS", "SECTIONS", "SETTLE_SCHEDULES",
    "TASK_ANCHOR_MODES", "TRAINABLE_MODES", "UPDATE_KINDS", "Balance", "CheckpointConfig", "ConfigError",
    "DPOConfig", "DataConfig", "EvalConfig", "FederationConfig", "KeySpec", "ModelConfig", "NodeConfig", "Phase",
    "PrivacyConfig", "RLConfig", "ReportConfig", "RetentionConfig", "RoutingConfig", "RunConfig", "RunSection",
    "Scalar", "ScheduleConfig", "Section", "SimConfig", "TrainConfig", "continual_schedule", "expansion_tasks",
    "flatten", "key", "load_override_file", "parse_kv_pairs", "parse_node_config", "parse_run_config",
    "parse_schedule", "parse_section", "replace", "resolve", "schedule_text", "section", "to_toml",
    "with_eval_cadence",
]
