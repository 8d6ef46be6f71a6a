"""Unit tests: the key declaration and what is derived from it (DEFAULTS, the generated pyproject.toml block and
docs table), validation errors, retired keys, schedule grammar, overrides, node config."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from distmoe.config import (
    DEFAULTS,
    KEYS,
    RETIRED,
    SECTIONS,
    ConfigError,
    ModelConfig,
    RLConfig,
    SimConfig,
    load_override_file,
    parse_kv_pairs,
    parse_node_config,
    parse_run_config,
    parse_schedule,
    resolve,
    to_toml,
)

ROOT = Path(__file__).resolve().parents[2]


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def _raises(overrides: dict, *needles: str) -> str:
    with pytest.raises(ConfigError) as ei:
        parse_run_config(overrides)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in error message {msg!r}"
    return msg


# ------------------------------------------------------------------------------------------ declaration
def test_every_key_is_declared_completely():
    assert list(DEFAULTS) == [s.name for s in KEYS] and len(set(DEFAULTS)) == len(KEYS)
    for spec in KEYS:
        section, _, name = spec.name.partition(".")
        assert section in SECTIONS and spec.attr.replace("_", "-") == name, spec.name
        assert spec.kind in (int, float, str, bool) and type(spec.default) is spec.kind, spec.name
        assert spec.doc and "\n" not in spec.doc and "|" not in spec.doc, f"{spec.name}: one line of docs"
        assert spec.check(spec.default) == spec.default, spec.name  # the default is in its own range
        if spec.choices is not None:
            assert spec.kind is str and spec.default in spec.choices, spec.name
        if spec.lo is not None or spec.hi is not None:
            assert spec.kind in (int, float), spec.name
    assert not set(RETIRED) & set(DEFAULTS)


def test_defaults_parse_and_round_trip():
    cfg = parse_run_config({})
    assert cfg.as_flat() == {**DEFAULTS, "model.trainable": "all"}  # `auto` resolved (the run record names it)
    assert parse_run_config(dict(DEFAULTS)) == cfg
    assert parse_run_config(_flatten(tomllib.loads(to_toml(DEFAULTS)))) == cfg
    assert cfg.model.seed == cfg.data.seed == DEFAULTS["run.seed"]
    assert cfg.model.top_k == DEFAULTS["model.top-k"]
    for name, cls in SECTIONS.items():  # a section constructed from its declared defaults is the parsed one
        assert cls() == getattr(cfg, name), name


def test_trainable_auto_is_lora_with_a_checkpoint_and_all_otherwise():
    """Resolved once, at parsing: the rest of the code (and the run record) sees a concrete mode; a run
    recorded before `auto` existed (with `all` written out) compares equal on resume."""
    assert DEFAULTS["model.trainable"] == "auto"
    assert parse_run_config({}).model.trainable == "all"
    cfg = parse_run_config({"model.path": "/some/checkpoint"})
    assert cfg.model.trainable == "lora" and cfg.as_flat()["model.trainable"] == "lora"
    assert parse_run_config(cfg.as_flat()) == cfg
    assert parse_run_config({"model.path": "/x", "model.trainable": "all"}).model.trainable == "all"
    assert parse_run_config({"model.trainable": "router+experts"}).model.trainable == "router+experts"
    assert ModelConfig().trainable == "all" and ModelConfig(path="/x").trainable == "lora"


def test_generated_files_match_the_declaration():
    """pyproject.toml [tool.flwr.app.config.*] and the key table of docs/configuration.md are generated."""
    from distmoe.config_sync import GENERATED, SYNC_COMMAND

    for rel, render in GENERATED.items():
        text = (ROOT / rel).read_text(encoding="utf-8")
        assert render(text) == text, f"{rel} is out of date with distmoe/config/: run `{SYNC_COMMAND}`"
    with (ROOT / "pyproject.toml").open("rb") as fh:
        flat = _flatten(tomllib.load(fh)["tool"]["flwr"]["app"]["config"])
    assert flat == DEFAULTS and all(type(flat[k]) is type(v) for k, v in DEFAULTS.items())


def test_sync_rewrites_a_drifted_copy(tmp_path):
    from distmoe.config_sync import sync

    for rel in ("pyproject.toml", "docs/configuration.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((ROOT / rel).read_text(encoding="utf-8").replace("top-k = 2", "top-k = 3")
                                    .replace("| `model.top-k` | `2`", "| `model.top-k` | `3`"), encoding="utf-8")
    assert sync(tmp_path, write=False) == ["pyproject.toml", "docs/configuration.md"]
    assert sync(tmp_path) == ["pyproject.toml", "docs/configuration.md"]
    assert sync(tmp_path, write=False) == []
    assert (tmp_path / "pyproject.toml").read_text() == (ROOT / "pyproject.toml").read_text()
    (tmp_path / "docs/configuration.md").write_text("# no markers\n")
    with pytest.raises(ConfigError, match="marker"):
        sync(tmp_path)


def test_a_section_validates_itself():
    with pytest.raises(ConfigError, match="'rl.group-size': value 1 is out of range"):
        RLConfig(group_size=1)
    assert RLConfig(lr=1).lr == 1.0 and isinstance(RLConfig(lr=1).lr, float)


@pytest.mark.parametrize("old,needle", [
    ("federation.min-parties", "federation.min-available"),
    ("privacy.canaries", "privacy.noise-canaries"),
    ("data.canaries", "data.canary-file"),
    ("privacy.dp-sgd", "privacy.update-noise-multiplier"),
    ("privacy.dp-sgd-noise-multiplier", "privacy.update-noise-multiplier"),
])
def test_retired_keys_are_refused_with_the_new_name_or_the_reason(old, needle):
    msg = _raises({old: 1}, f"'{old}'", needle)
    if "dp-sgd" in old:
        assert "opacus cannot compute per-sample gradients" in msg and "expert and router" in msg


def test_shipped_config_files_validate():
    files = sorted((ROOT / "configs").glob("*.toml"))
    for f in files:
        overrides = load_override_file(f)
        try:
            parse_run_config(overrides)
        except ConfigError as exc:  # pragma: no cover - the message is the point
            pytest.fail(f"{f.name}: {exc}")


def test_override_file_nested_tables_and_errors(tmp_path):
    f = tmp_path / "x.toml"
    f.write_text('[train]\nlocal-steps = 7\n[routing]\n"anchor-kl-coef" = 0.25\n')
    flat = load_override_file(f)
    assert flat == {"train.local-steps": 7, "routing.anchor-kl-coef": 0.25}
    cfg = parse_run_config(flat)
    assert cfg.train.local_steps == 7 and cfg.routing.anchor_kl_coef == 0.25
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_override_file(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_override_file(tmp_path / "missing.toml")


# ------------------------------------------------------------------------------------------ errors
def test_unknown_key_names_the_key():
    msg = _raises({"train.local-stepz": 3}, "train.local-stepz")
    assert "train.local-steps" in msg  # the hint lists the keys of the section
    with pytest.raises(ConfigError, match="bogus.key"):
        resolve({"bogus.key": 1})


def test_wrong_types_name_key_and_value():
    _raises({"train.local-steps": "5"}, "train.local-steps", "'5'")
    _raises({"train.lr": True}, "train.lr", "True")
    _raises({"model.layers": 2.5}, "model.layers", "2.5")
    _raises({"model.lora-router": 1}, "model.lora-router", "1")
    _raises({"model.trainable": 3}, "model.trainable", "3")
    _raises({"train.lr": float("nan")}, "train.lr")
    _raises({"sim.nodes-dir": 3}, "sim.nodes-dir", "3")
    _raises({"data.canary-file": False}, "data.canary-file", "False")


def test_numeric_coercions_that_are_allowed():
    cfg = parse_run_config({"train.lr": 1, "train.local-steps": 4.0})
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.train.local_steps == 4 and isinstance(cfg.train.local_steps, int)


@pytest.mark.parametrize("overrides,key", [
    ({"model.experts": 4, "model.top-k": 5}, "model.top-k"),
    ({"data.eval-fraction": 0}, "data.eval-fraction"),
    ({"data.eval-fraction": 0.95}, "data.eval-fraction"),
    ({"train.grad-clip": 0}, "train.grad-clip"),
    ({"train.local-steps": 0}, "train.local-steps"),
    ({"train.lr": -0.1}, "train.lr"),
    ({"routing.anchor-granularity": "x"}, "routing.anchor-granularity"),
    ({"model.trainable": "x"}, "model.trainable"),
    ({"model.heads": 4, "model.kv-heads": 3}, "model.kv-heads"),
    ({"model.experts": 1, "model.top-k": 1}, "model.experts"),
    ({"federation.wait-timeout": 0.5}, "federation.wait-timeout"),
    ({"checkpoint.keep": 0}, "checkpoint.keep"),
    ({"run.seed": -1}, "run.seed"),
    # inconsistent combinations: one message naming the key, the value and what is allowed
    ({"privacy.min-parties": 3, "federation.min-available": 2}, "privacy.min-parties"),
    ({"privacy.delta": 1e-3, "privacy.num-sequences-max": 10000}, "privacy.delta"),
    ({"privacy.scale": 64.5}, "privacy.scale"),
    ({"federation.on-round-failure": "retry"}, "federation.on-round-failure"),
    ({"federation.max-norm-ratio": 0.5}, "federation.max-norm-ratio"),
    ({"federation.setup-timeout": 0}, "federation.setup-timeout"),
    ({"federation.unmask-timeout": 1e6}, "federation.unmask-timeout"),
    ({"federation.anomaly-z": -1}, "federation.anomaly-z"),
])
def test_out_of_range_names_the_key(overrides, key):
    _raises(overrides, f"'{key}'")


# ------------------------------------------------------------------------------------------ schedule
def test_schedule_grammar():
    cfg = parse_run_config({"schedule.phases": "sft:arith*3, eval, stats:arith, sft:strings, eval",
                            "schedule.sft-rounds": 2})
    ph = cfg.schedule.phases
    assert [p.kind for p in ph] == ["sft", "eval", "stats", "sft", "eval"]
    assert [p.task for p in ph] == ["arith", None, "arith", "strings", None]
    assert [p.rounds for p in ph] == [3, 1, 1, 2, 1]  # sft:strings takes schedule.sft-rounds
    assert cfg.schedule.total_rounds == 8
    assert cfg.schedule.tasks == ("arith", "strings")
    assert ph[0].label() == "sft:arith" and ph[1].label() == "eval"


def test_schedule_arrow_separators_and_stats_without_task():
    cfg = parse_run_config({"schedule.phases": "sft:arith -> stats -> sft:lookup*4->eval"})
    ph = cfg.schedule.phases
    default = DEFAULTS["schedule.sft-rounds"]
    assert [(p.kind, p.task, p.rounds) for p in ph] == [
        ("sft", "arith", default), ("stats", None, 1), ("sft", "lookup", 4), ("eval", None, 1)]


@pytest.mark.parametrize("text,needle", [
    ("sft", "needs a task"),
    ("sft:arith, eval:x", "eval takes no task"),
    ("train:arith", "unknown kind"),
    ("sft:arith, stats*2", "only sft, rl and dpo phases"),
    ("sft:ar.th", "invalid task name"),
    ("sft:arith*0", "at least 1 round"),
    (" , ", "no phases"),
    ("sft:arith; eval", "malformed"),
])
def test_schedule_errors(text, needle):
    _raises({"schedule.phases": text}, "schedule.phases", needle)


# ------------------------------------------------------------------------------------------ overrides
def test_parse_kv_pairs_types():
    out = parse_kv_pairs("train.lr=0.01 run.name='my run' model.layers=3 model.lora-router=false "
                         'run.dir="/tmp/a b" model.trainable=router+experts train.local-steps=-2')
    assert out == {"train.lr": 0.01, "run.name": "my run", "model.layers": 3, "model.lora-router": False,
                   "run.dir": "/tmp/a b", "model.trainable": "router+experts", "train.local-steps": -2}
    assert type(out["model.layers"]) is int and type(out["train.lr"]) is float
    assert out["model.lora-router"] is False
    with pytest.raises(ConfigError, match="cannot parse"):
        parse_kv_pairs("train.lr=0.1 garbage")


def test_to_toml_roundtrips():
    cfg = parse_run_config({"run.name": 'a "quoted" \\ name', "train.lr": 0.0005, "train.lr-router": 1e-5,
                            "model.lora-router": False,
                            "schedule.phases": "sft:arith*2, eval", "model.trainable": "router+experts"})
    flat = cfg.as_flat()
    text = to_toml(flat)
    back = _flatten(tomllib.loads(text))
    assert back == flat
    assert all(type(back[k]) is type(v) for k, v in flat.items())
    assert parse_run_config(back) == cfg


# ------------------------------------------------------------------------------------------ node config
def test_node_config_missing_data_path():
    with pytest.raises(ConfigError) as ei:
        parse_node_config({}, SimConfig(nodes_dir=""))
    assert "data-path" in str(ei.value) and "--node-config" in str(ei.value)
    # partition-id alone (no nodes dir) is the same error
    with pytest.raises(ConfigError, match="data-path"):
        parse_node_config({"partition-id": 0}, SimConfig(nodes_dir=""))


def test_node_config_data_path_not_a_directory(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(ConfigError, match="not a directory") as ei:
        parse_node_config({"data-path": str(f)}, SimConfig(nodes_dir=""))
    assert "data-path" in str(ei.value)
    with pytest.raises(ConfigError, match="not a directory"):
        parse_node_config({"data-path": str(tmp_path / "nope")}, SimConfig(nodes_dir=""))
    with pytest.raises(ConfigError, match="data-path"):
        parse_node_config({"data-path": 3}, SimConfig(nodes_dir=""))


def test_node_config_deployment_defaults(tmp_path):
    d = tmp_path / "hospital-a"
    d.mkdir()
    node = parse_node_config({"data-path": str(d)}, SimConfig(nodes_dir=""))
    assert node.party == "hospital-a"
    assert node.data_path == d
    assert node.model_path == ""
    assert node.work_dir != d and node.work_dir.parent == tmp_path
    named = parse_node_config({"data-path": str(d), "party-name": "alice", "work-dir": str(tmp_path / "w")},
                              SimConfig(nodes_dir=""))
    assert named.party == "alice" and named.work_dir == tmp_path / "w"
    with pytest.raises(ConfigError, match="party-name"):
        parse_node_config({"data-path": str(d), "party-name": "a b"}, SimConfig(nodes_dir=""))


def test_node_config_simulation_node_files(tmp_path):
    nodes = tmp_path / "nodes"
    nodes.mkdir()
    d0, d1 = tmp_path / "party-0", tmp_path / "party-1"
    d0.mkdir()
    d1.mkdir()
    (nodes / "node-0.toml").write_text(f'data-path = "{d0}"\n')
    (nodes / "node-1.toml").write_text(f'data-path = "{d1}"\nparty-name = "bob"\n')
    sim = SimConfig(nodes_dir=str(nodes))
    n0 = parse_node_config({"partition-id": 0, "num-partitions": 2}, sim)
    assert n0.data_path == d0 and n0.party == "party-0"
    n1 = parse_node_config({"partition-id": 1, "num-partitions": 2}, sim)
    assert n1.data_path == d1 and n1.party == "bob"
    with pytest.raises(ConfigError, match="node-5.toml"):
        parse_node_config({"partition-id": 5}, sim)


def test_budget_exceeded_by_the_schedule_names_the_key():
    """A given noise multiplier whose planned releases exceed privacy.epsilon is refused by the plan that
    `distmoe config validate`, `distmoe simulate` and the coordinator compute before anything starts."""
    from distmoe.privacy.plan import plan_privacy

    cfg = parse_run_config({"privacy.noise-multiplier": 0.1, "privacy.epsilon": 1.0,
                            "schedule.phases": "stats:arith, sft:arith, stats:arith"})
    with pytest.raises(ConfigError) as ei:
        plan_privacy(cfg.privacy, cfg.schedule)
    msg = str(ei.value)
    assert "'privacy.noise-multiplier'" in msg and "0.1" in msg and "privacy.epsilon = 1" in msg


def test_continual_schedule_mirrors_the_default_shape():
    """The schedule `distmoe simulate --data` derives: the default's shape (sft, eval, stats of the task just
    tuned, next sft, eval) over any tasks."""
    from distmoe.config import DEFAULTS, continual_schedule

    assert continual_schedule(["lookup", "arith"]) == DEFAULTS["schedule.phases"]
    assert continual_schedule(["t"]) == "sft:t, eval"
    assert continual_schedule(["a", "b", "c"]) == "sft:a, eval, stats:a, sft:b, eval, stats:b, sft:c, eval"
    parse_schedule(continual_schedule(["a", "b", "c"]), 5)  # in the grammar
    for bad in ([], ["a", "a"], ["bad name"]):
        with pytest.raises(ConfigError, match="schedule.phases"):
            continual_schedule(bad)
