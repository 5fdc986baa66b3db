"""Fixtures for the dashboard tests: the parsed files and external tools CI must provide."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import pytest
from dashboard_files import DASHBOARD_JSON, Family, Rule, read_contract, read_rules


def _require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is not None:
        return path
    reason = f"{name} is not installed (Debian package: prometheus)"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must provide it")
    pytest.skip(reason)


@pytest.fixture
def require_tool() -> Callable[[str], str]:
    """Return a tool's path; skip without it, but fail when $CI is set (CI must have it)."""
    return _require_tool


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
