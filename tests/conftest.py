"""Shared fixtures (a real daemon process, a saved checkpoint, a directory every user reaches) and the test tiers.

The process tier (`pytest.mark.process`) is every test that starts a process (a job, a daemon, a
checkpoint-saving rank, a worker, Prometheus): marked by hand, through `slow`, or by the fixtures that start
one (PROCESS_FIXTURES). `make test-fast` runs the rest with TORCHPULSE_TEST_TIER=fast, where a test that
starts a process anyway fails at once, so that the fast tier stays what it says.
"""

from __future__ import annotations

import os
import tempfile

# Before torch is imported anywhere: one inductor cache per test session, so
# compiled fixtures are shared inside the run but nothing leaks between runs.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="torchpulse-inductor-"))

import _posixsubprocess
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests.support import DaemonProcess, built_once, require_tool, start_daemon
from tests.support.checkpoints import save
from tests.support.guards import no_swallowed_probe_errors, no_thread_leaks

__all__ = ["no_swallowed_probe_errors", "no_thread_leaks"]  # autouse: every test runs under both

# No per-example deadline: the 2-core machine is shared, and a slow example is not a failure.
# In CI the examples are derandomized, so a CI result is the same on every run and reproduces.
settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, database=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


FAST_TIER = os.environ.get("TORCHPULSE_TEST_TIER") == "fast"
# Fixtures that start a process: a test using one is in the process tier (inductor's `scenario` runs the C++
# compiler; `require_tool` hands out promtool, Prometheus or systemd-analyze to run; the others start daemons,
# jobs or checkpoint-saving ranks).
PROCESS_FIXTURES = frozenset(
    {
        "require_tool",
        "daemon",
        "small_budget_daemon",
        "known",
        "busy",
        "stopper",
        "saved_checkpoint",
        "single_root",
        "dist2_root",
        "dist4_root",
        "variants",
        "dist_variants",
        "zstd_checkpoint",
        "ranks",
        "scenario",
    }
)


class StartedAProcess(Exception):
    """A test of the fast tier started a process: mark it `pytest.mark.process`."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") or PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.process)


def pytest_configure(config: pytest.Config) -> None:
    """In the fast tier, starting a process fails, in a test and in any fixture a test uses."""
    if not FAST_TIER:
        return

    def refuse(*args: object, **kwargs: object) -> None:
        where = os.environ.get("PYTEST_CURRENT_TEST", "a fixture")
        raise StartedAProcess(f"{where} starts a process: mark the test pytest.mark.process")

    subprocess.Popen.__init__ = refuse  # type: ignore[method-assign,assignment]
    _posixsubprocess.fork_exec = refuse  # multiprocessing's spawn, too
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            setattr(os, name, refuse)


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


@pytest.fixture(scope="session")
def run_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A temporary directory shared by the whole test run: every worker of the parallel runner sees the same."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def single_root(run_tmp: Path) -> Path:
    """Single-process checkpoints (nested, flat, model-only, zstd, safetensors), saved once per run: copy, never
    mutate."""

    return built_once(run_tmp, "single", lambda root: save("all_single", root, timeout=300))


@pytest.fixture(scope="session")
def saved_checkpoint(single_root: Path) -> Path:
    """A genuine single-process DCP checkpoint (AdamW state, bytes items): never mutate it, copy it."""
    return single_root / "single"


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user can traverse (pytest's tmp_path is the test user's alone)."""
    path = Path(tempfile.mkdtemp(prefix="torchpulse-users-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
