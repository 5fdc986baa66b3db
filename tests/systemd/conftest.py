"""Shared fixture for the systemd tests: external tools that CI must provide."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import pytest


def _require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is not None:
        return path
    reason = f"{name} is not installed (Debian package: systemd)"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must provide it")
    pytest.skip(reason)


@pytest.fixture
def require_tool() -> Callable[[str], str]:
    """Return a tool's path; skip without it, but fail when $CI is set (CI must have it)."""
    return _require_tool
