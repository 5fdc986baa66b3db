"""Shared fixtures: a real daemon process, scraping, and an agent without transport."""

from __future__ import annotations

import os
import tempfile

# Before torch is imported anywhere: one inductor cache per test session, so
# compiled fixtures are shared inside the run but nothing leaks between runs.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="torchpulse-inductor-"))

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests.support import DaemonProcess, require_tool, start_daemon

# No per-example deadline: the 2-core machine is shared, and a slow example is not a failure.
# In CI the examples are derandomized, so a CI result is the same on every run and reproduces.
settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, database=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(name="require_tool")
def require_tool_fixture() -> Callable[[str], str]:
    """Return a tool's path; skip without it, but fail when $CI is set (CI must have it)."""
    return require_tool


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    """A real `torchpulse daemon` process on a temporary socket and a free port."""
    proc = start_daemon(tmp_path)
    try:
        yield proc
    finally:
        proc.stop()
