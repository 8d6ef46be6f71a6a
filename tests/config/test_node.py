"""The node config's work directory when the SuperNode's node config names none: a visible
``<party>-work`` next to the data directory, and an earlier hidden ``.<party>-work`` is named, not abandoned."""

from __future__ import annotations

import pytest

from distmoe.config import ConfigError, SimConfig, parse_node_config


def test_default_work_dir_is_visible_next_to_the_data(tmp_path):
    data = tmp_path / "hospital-a"
    data.mkdir()
    node = parse_node_config({"data-path": str(data)}, SimConfig())
    assert node.work_dir == tmp_path / "hospital-a-work" and not node.work_dir.name.startswith(".")
    assert parse_node_config({"data-path": str(data), "work-dir": str(tmp_path / "w")}, SimConfig()).work_dir \
        == tmp_path / "w"


def test_an_earlier_hidden_work_dir_is_named_so_its_ledger_and_budget_are_kept(tmp_path):
    data = tmp_path / "hospital-a"
    data.mkdir()
    (tmp_path / ".hospital-a-work").mkdir()
    with pytest.raises(ConfigError, match=r"\.hospital-a-work.*earlier work.*set work-dir to it"):
        parse_node_config({"data-path": str(data)}, SimConfig())
    given = {"data-path": str(data), "work-dir": str(tmp_path / ".hospital-a-work")}
    assert parse_node_config(given, SimConfig()).work_dir == tmp_path / ".hospital-a-work"
