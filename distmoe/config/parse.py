"""The parser of the run configuration: a flat Flower run config -> :class:`RunConfig`, the frozen, validated
tree of sections; the tables derived from the declaration (``KEYS``, ``DEFAULTS``, the resume and privacy
fences, the experimental keys) and the refusal of retired keys.

Owns: resolving overrides against the defaults, the checks between sections, and what a key's fence means for a
whole run: ``RESUME_MAY_CHANGE`` (the keys a resumed run may change) and ``PRIVACY_KEYS`` (recorded in the
ledger's ``run-start`` entry), both derived from each key's own declaration.

Must not: import anything of distmoe outside this package, or read a run directory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from distmoe.config.federation_keys import (
    CheckpointConfig,
    EvalConfig,
    FederationConfig,
    PrivacyConfig,
    ReportConfig,
    ScheduleConfig,
    SimConfig,
)
from distmoe.config.keys import SECTIONS, ConfigError, KeySpec, Scalar, Section
from distmoe.config.rl_keys import DPOConfig, RLConfig
from distmoe.config.routing_keys import Balance, RetentionConfig, RoutingConfig
from distmoe.config.run_keys import DataConfig, ModelConfig, RunSection, TrainConfig
from distmoe.config.schedule import expansion_tasks, with_eval_cadence

S = TypeVar("S", bound=Section)

KEYS: tuple[KeySpec, ...] = tuple(spec for cls in SECTIONS.values() for spec in cls.KEYS)
DEFAULTS: dict[str, Scalar] = {spec.name: spec.default for spec in KEYS}

_UPDATE_DP = ("use privacy.update-noise-multiplier (client-level DP on model updates) instead")
RENAMED: dict[str, str] = {  # old key -> its new name (run records written before the rename use the old one)
    "federation.min-parties": "federation.min-available",
    "privacy.canaries": "privacy.noise-canaries",
    "data.canaries": "data.canary-file",
}
RETIRED: dict[str, str] = {  # old key -> why it is refused (what to use instead)
    "privacy.max-weight": "FedAvg weights are uniform under secure aggregation (weight 1 per contributing party, "
                          "docs/privacy.md §3): an example-count weight would let a straggle difference one party's "
                          "count out of two sums",
    "federation.min-parties": "it was renamed 'federation.min-available' (privacy.min-parties is the other one)",
    "privacy.canaries": "it was renamed 'privacy.noise-canaries' (a count of noise canaries)",
    "data.canaries": "it was renamed 'data.canary-file' (a file of canary strings)",
    "privacy.dp-sgd": "example-level DP-SGD was removed: opacus cannot compute per-sample gradients for the fused "
                      "expert and router parameters of the MoE models; " + _UPDATE_DP,
    "privacy.dp-sgd-noise-multiplier": "example-level DP-SGD was removed: opacus cannot compute per-sample "
                                       "gradients for the fused expert and router parameters of the MoE models; "
                                       + _UPDATE_DP,
}

# the fences, each derived from the keys' own declarations (keys.KeySpec)
RESUME_MAY_CHANGE = frozenset(s.name for s in KEYS if s.resume)
PRIVACY_KEYS = frozenset(s.name for s in KEYS if s.privacy)
EXPERIMENTAL_KEYS = frozenset(s.name for s in KEYS if s.experimental)


@dataclass(frozen=True)
class RunConfig:
    run: RunSection
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    routing: RoutingConfig
    retention: RetentionConfig
    rl: RLConfig
    dpo: DPOConfig
    schedule: ScheduleConfig
    federation: FederationConfig
    privacy: PrivacyConfig
    checkpoint: CheckpointConfig
    eval: EvalConfig
    report: ReportConfig
    sim: SimConfig
    raw: tuple[tuple[str, Scalar], ...]  # the resolved flat mapping, for the run record

    def as_flat(self) -> dict[str, Scalar]:
        return dict(self.raw)



def resolve(overrides: Mapping[str, Any] | None = None) -> dict[str, Scalar]:
    """DEFAULTS updated with ``overrides``; an unknown key is an error naming the closest keys, a retired key
    one naming its replacement (or why it was removed)."""
    flat: dict[str, Scalar] = dict(DEFAULTS)
    for key, value in (overrides or {}).items():
        if key in RETIRED:
            raise ConfigError(f"config key '{key}' (value {value!r}) is no longer accepted: {RETIRED[key]}")
        if key not in DEFAULTS:
            section = key.split(".")[0]
            near = [k for k in DEFAULTS if k.startswith(section + ".")]
            hint = f"; keys in '{section}': {', '.join(near)}" if near else \
                f"; sections: {', '.join(SECTIONS)}"
            raise ConfigError(f"unknown config key '{key}' (value {value!r}){hint}")
        flat[key] = value
    return flat


def parse_run_config(run_config: Mapping[str, Any] | None = None) -> RunConfig:
    """Validate a (possibly partial) flat run config and return the frozen tree."""
    flat = resolve(run_config)
    parts: dict[str, Any] = {}
    for name, cls in SECTIONS.items():  # "run" first: model and data carry run.seed (their non-key field)
        derived = {"seed": parts["run"].seed} if name in ("model", "data") else {}
        if name == "model":
            derived["balance_bias"] = Balance(_spec("routing.balance").check(flat["routing.balance"])).bias
        parts[name] = cls(**{s.attr: flat[s.name] for s in cls.KEYS}, **derived)
    _check_across(parts["federation"], parts["privacy"])
    object.__setattr__(parts["schedule"], "phases", with_eval_cadence(parts["schedule"].phases, parts["eval"].every))
    _check_retention(parts["retention"], parts["schedule"])
    if parts["model"].warmup_steps and parts["run"].init_from:
        raise ConfigError("config key 'run.init-from': a run starts from one checkpoint: set it or "
                          "model.warmup-steps, not both")
    if parts["retention"].expand_experts and parts["model"].trainable == "lora":
        raise ConfigError("config key 'retention.expand-experts': expert expansion needs model.trainable = all or "
                          "router+experts (lora adapters of the fused experts are laid out per expert count)")
    if parts["retention"].expand_experts and parts["model"].balance_bias:
        raise ConfigError("config key 'retention.expand-experts': cannot be combined with a routing bias "
                          f"(routing.balance = '{parts['routing'].balance}' keeps one bias slot per expert)")
    if parts["routing"].balance_source == "public" and not parts["model"].balance_bias:
        raise ConfigError("config key 'routing.balance-source': value 'public' moves a routing bias: set "
                          "routing.balance = \"bias\" or \"aux+bias\"")
    if parts["routing"].balance_settle_steps and parts["routing"].balance_source != "public":
        raise ConfigError("config key 'routing.balance-settle-steps': settles the routing bias on the public balance "
                          "batches: set routing.balance-source = \"public\" (and routing.balance = \"aux+bias\" or "
                          "\"bias\")")
    if parts["model"].balance_bias and parts["model"].trainable == "lora":
        raise ConfigError(f"config key 'routing.balance': value '{parts['routing'].balance}' needs the routers "
                          "trained and sent (model.trainable = all or router+experts): in lora mode the routing bias "
                          "would not travel or aggregate")
    flat["model.trainable"] = parts["model"].trainable  # `auto` resolved: the run record names the mode used
    return RunConfig(**parts, raw=tuple(sorted(flat.items())))


def _spec(name: str) -> KeySpec:
    return next(s for s in KEYS if s.name == name)


def parse_section(run_config: Mapping[str, Any], cls: type[S]) -> S:
    """Section ``cls`` alone from a flat run config (its keys only, defaults for the absent ones, validated): for
    a reader that needs it before, or apart from, the whole run config (the ClientApp's ``sim`` section, which
    locates its node config and so its ledger, even when the rest of the run config is refused)."""
    return cls(**{s.attr: run_config.get(s.name, s.default) for s in cls.KEYS})


def _check_across(fed: FederationConfig, p: PrivacyConfig) -> None:
    """The checks between sections."""
    if p.secure and p.min_parties > fed.min_available:
        raise ConfigError(f"config key 'privacy.min-parties': value {p.min_parties} is above "
                          f"federation.min-available = {fed.min_available}: a run could start with fewer parties "
                          "than any release may use")


def _check_retention(r: RetentionConfig, schedule: ScheduleConfig) -> None:
    """Per-task anchors and expert protection read the anchors of ``stats:<task>`` phases, expert expansion needs a
    second ``sft`` task: refuse a schedule without them rather than run with the mechanism silently off."""
    if r.expand_experts and not expansion_tasks(schedule.phases):
        raise ConfigError("config key 'retention.expand-experts' is on, but schedule.phases never starts an `sft` "
                          "phase of a new task after a first one: the model would never grow")
    if any(p.kind == "stats" and p.task for p in schedule.phases):
        return
    for key, on in (("retention.task-anchors", r.task_anchors != "off"), ("retention.protect-mass", r.protect)):
        if on:
            raise ConfigError(f"config key '{key}' is on, but schedule.phases has no `stats:<task>` phase: the "
                              "per-task anchors it reads are built only there")



def replace(cfg: Any, **changes: Any) -> Any:
    """dataclasses.replace, re-exported for tests and callers that derive configs."""
    return dataclasses.replace(cfg, **changes)
