"""The guards of tests/support/guards.py fail a test that has the fault, and only that test."""

from __future__ import annotations

import pytest

from tests.support import REPO

pytest_plugins = ["pytester"]

# The inner session, in a process of its own (pytester's in-process runs drop the modules they imported, and one
# of torch's cannot be imported twice): the guards come from its conftest, as the suite's come from tests/'.
GUARDED_CONFTEST = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from tests.support import guards
from tests.support.guards import no_swallowed_probe_errors, no_thread_leaks, pytest_configure
guards.THREAD_GRACE_SECONDS = 0.5  # the thread test's leak is known to stay
"""
PREAMBLE = """
import threading
import pytest
import torch
from tests.support import local_agent
"""

PROBE_RAISES_IN_A_HOOK = """
def train_with_a_broken_optimizer_probe():
    agent = local_agent(("optimizer",))
    probe = agent.probes["optimizer"]
    probe._before_step = lambda *a: 1 / 0
    probe.uninstall()
    probe.install()
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()  # the job trains on: the probe disabled itself
    agent.drain()
    agent.shutdown()

def test_unmarked():
    train_with_a_broken_optimizer_probe()

@pytest.mark.probe_errors
def test_marked():
    train_with_a_broken_optimizer_probe()

def test_clean():
    agent = local_agent(("optimizer",))
    model = torch.nn.Linear(4, 3)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    agent.drain()
    agent.shutdown()
"""

THREAD_LEFT_RUNNING = """
stop = threading.Event()

def test_unmarked():
    threading.Thread(target=stop.wait, name="left-running", daemon=True).start()

@pytest.mark.leaks_threads
def test_marked():
    threading.Thread(target=stop.wait, name="left-on-purpose", daemon=True).start()

def test_joined():
    thread = threading.Thread(target=lambda: None, name="joined")
    thread.start()
    thread.join()

def test_after():
    stop.set()  # the leaks end here, so the runs that follow see none of them
"""


def _run(pytester: pytest.Pytester, body: str) -> pytest.RunResult:
    pytester.makeconftest(GUARDED_CONFTEST)
    pytester.makepyfile(test_inner=PREAMBLE + body)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")


@pytest.mark.process
def test_a_probe_that_raised_inside_a_hook_fails_the_test_unless_it_is_marked(pytester: pytest.Pytester) -> None:
    """The optimizer probe's hook raises: the job's steps all run, and the unmarked test fails at teardown."""
    result = _run(pytester, PROBE_RAISES_IN_A_HOOK)
    outcomes = result.parseoutcomes()
    assert (3, 1) == (outcomes.get("passed"), outcomes.get("errors"))  # a teardown error follows a passed call
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_unmarked*",
            "a probe failed and disabled itself during the test*",
            "probe optimizer: Traceback*",
        ]
    )
    assert "test_marked" not in "\n".join(line for line in result.outlines if "ERROR" in line)


@pytest.mark.process
def test_a_thread_left_running_fails_the_test_that_started_it_unless_it_is_marked(pytester: pytest.Pytester) -> None:
    """A thread still alive THREAD_GRACE_SECONDS after its test fails that test; a joined one, a marked one don't."""
    result = _run(pytester, THREAD_LEFT_RUNNING)
    assert (4, 1) == (result.parseoutcomes().get("passed"), result.parseoutcomes().get("errors"))
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_unmarked*", "the test left threads running: left-running"])


FAST_TIER_STARTS_A_PROCESS = """
import subprocess
import pytest

def test_unmarked():
    subprocess.run(["true"], check=True)

@pytest.mark.process
def test_marked():
    subprocess.run(["true"], check=True)

def test_no_process():
    assert 2 == 1 + 1
"""


@pytest.mark.process
def test_a_fast_tier_test_that_starts_a_process_fails_and_a_marked_one_is_left_out(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make test-fast`'s session (tests/conftest.py under TORCHPULSE_TEST_TIER=fast) refuses a process start."""
    monkeypatch.setenv("TORCHPULSE_TEST_TIER", "fast")
    # The suite's own tier hooks, for the inner session.
    hooks = "from tests.conftest import pytest_collection_modifyitems, pytest_configure"
    pytester.makeconftest(f"import sys\nsys.path.insert(0, {str(REPO)!r})\n{hooks}\n")
    pytester.makepyfile(test_inner=FAST_TIER_STARTS_A_PROCESS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", "-m", "not process")
    outcomes = result.parseoutcomes()
    assert (1, 1, 1) == (outcomes.get("passed"), outcomes.get("failed"), outcomes.get("deselected"))
    result.stdout.fnmatch_lines(
        ["*StartedAProcess: *test_unmarked* starts a process: mark the test pytest.mark.process*"]
    )
