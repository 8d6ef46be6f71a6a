"""Shared fixtures for the whole runs on real Flower processes in this folder.

Owns: ``deployment``, the processes and logs of one TLS + node-auth deployment test (``test_deployment.Deployment``),
every process it started stopped by PID at the end, whatever happened, and none left running.

Must not: start a process itself, or be imported by test modules (they ask for fixtures by name).
"""

from __future__ import annotations

import pytest
from test_deployment import Deployment


@pytest.fixture
def deployment(tmp_path):
    dep = Deployment(tmp_path)
    try:
        yield dep
    finally:
        leftover = dep.stop()
        assert not leftover, f"processes with the test token still running: {leftover}" + dep.diag(10)
