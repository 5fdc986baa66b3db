"""Guards that make a quiet failure loud, for every test: tests/conftest.py imports them (and `-p` loads this
module as a plugin, as tests/test_guards.py does).

A probe that fails logs once, disables itself and lets the job train on: by design in production, and a way for
a broken probe's test to pass. A thread left running by a test (a sender never stopped, an observer never
joined) goes on in the tests after it. Each guard fails the test that had the fault, unless the test says, by a
marker, that the fault is what it is about.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator

import pytest

# Children the tests start end with the traceback instead of disabling the probe (see probes/agent/config.py).
os.environ.setdefault("TORCHPULSE_PROBE_ERRORS", "fatal")

# How long a test's threads get to end after it: stopping a sender or an observer joins within this.
THREAD_GRACE_SECONDS = 5.0
# Threads that outlive a test by design, kept by a library for the whole process: watchdog's one inotify reader
# (an InotifyFD thread, unnamed) and its dispatcher, tqdm's monitor of progress bars.
LIBRARY_THREAD_PREFIXES = ("pytest_timeout", "InotifyFD-Dispatcher", "tqdm_monitor")
LIBRARY_THREAD_TYPES = frozenset({"InotifyFD"})


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "probe_errors: the test makes a probe fail on purpose")
    config.addinivalue_line("markers", "leaks_threads: the test leaves threads running on purpose")


@pytest.fixture(autouse=True)
def no_swallowed_probe_errors(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fails the test during which a probe of this process failed and disabled itself."""
    from torchpulse.probes.agent import probe as probe_core

    failures: list[str] = []

    def record(probe: probe_core.Probe, exc: BaseException) -> None:
        failures.append(f"probe {probe.name}: {''.join(traceback.format_exception(exc)).rstrip()}")

    monkeypatch.setattr(probe_core, "after_probe_error", record)
    yield
    if failures and request.node.get_closest_marker("probe_errors") is None:
        pytest.fail(
            "a probe failed and disabled itself during the test (mark it probe_errors if that is its point):\n"
            + "\n".join(failures),
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def no_thread_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the test that left a thread of its own running THREAD_GRACE_SECONDS after it ended."""
    before = set(threading.enumerate())
    yield
    if request.node.get_closest_marker("leaks_threads") is not None:
        return
    deadline = time.monotonic() + THREAD_GRACE_SECONDS
    while leaked := _started_since(before):
        if time.monotonic() > deadline:
            names = ", ".join(sorted(thread.name for thread in leaked))
            pytest.fail(f"the test left threads running: {names}", pytrace=False)
        time.sleep(0.02)


def _started_since(before: set[threading.Thread]) -> list[threading.Thread]:
    return [
        thread
        for thread in threading.enumerate()
        if thread not in before and thread.is_alive() and not _kept_by_a_library(thread)
    ]


def _kept_by_a_library(thread: threading.Thread) -> bool:
    if thread.name.startswith(LIBRARY_THREAD_PREFIXES) or type(thread).__name__ in LIBRARY_THREAD_TYPES:
        return True
    # Inductor's compile pool: one ThreadPoolExecutor for the process, made by the first compile that wants it.
    pool = _inductor_compile_pool()
    owner = getattr(thread, "_args", (None,))[:1]
    return pool is not None and bool(owner) and isinstance(owner[0], weakref.ref) and owner[0]() is pool


def _inductor_compile_pool() -> object | None:
    async_compile = sys.modules.get("torch._inductor.async_compile")
    pool = getattr(getattr(async_compile, "AsyncCompile", None), "pool", None)
    if pool is None or not hasattr(pool, "cache_info") or pool.cache_info().currsize == 0:
        return None  # never made: asking for it would make it
    return pool()
