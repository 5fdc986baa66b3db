"""Fixtures for the dashboard tests: the parsed files and external tools CI must provide."""

from __future__ import annotations

import json
from typing import Any

import pytest
from dashboard_files import DASHBOARD_JSON, Family, Rule, read_contract, read_rules


@pytest.fixture(scope="session")
def contract() -> dict[str, Family]:
    """The metric contract from dashboards/metrics.txt."""
    return read_contract()


@pytest.fixture(scope="session")
def dashboard() -> dict[str, Any]:
    """The Grafana dashboard as parsed JSON."""
    loaded: dict[str, Any] = json.loads(DASHBOARD_JSON.read_text())
    return loaded


@pytest.fixture(scope="session")
def rules() -> list[Rule]:
    """Every recording and alerting rule."""
    return read_rules()
