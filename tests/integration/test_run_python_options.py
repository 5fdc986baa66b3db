"""`torchpulse run -- python -I/-E/-S ...`: Python never loads the bootstrap, and the user is told so."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import REPO
from torchpulse.launcher import python_flags

WARNING = "torchpulse: warning: the agent will not attach: "


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchpulse", "run", "--", *cmd], cwd=REPO, capture_output=True, text=True, timeout=120
    )


@pytest.mark.process
@pytest.mark.parametrize(
    ("options", "why"),
    [
        (["-I"], "isolated mode (-I) ignores PYTHONPATH"),
        (["-E"], "-E ignores PYTHONPATH"),
        (["-u", "-S"], "-S skips the site module, which loads the bootstrap"),
    ],
)
def test_options_that_keep_the_bootstrap_out_are_reported_and_the_job_still_runs(options: list[str], why: str) -> None:
    """The job runs as asked; one line on stderr says why it gets no agent, instead of a silently missing run."""
    result = _run(sys.executable, *options, "-c", "print('job ran')")
    assert (0, "job ran\n", f"{WARNING}{why}\n") == (result.returncode, result.stdout, result.stderr)


@pytest.mark.process
def test_options_of_the_job_itself_are_not_pythons() -> None:
    """`-I` after `-c CODE`, a script or `-m MODULE` is the job's argument: nothing to report."""
    result = _run(sys.executable, "-c", "import sys; print(sys.argv[1:])", "-I", "-S")
    assert (0, "['-I', '-S']\n", "") == (result.returncode, result.stdout, result.stderr)


@pytest.mark.parametrize(
    ("cmd", "flags"),
    [
        (["python3", "-IS", "train.py"], {"I", "S"}),
        (["/usr/bin/python3.11", "-bEu", "-c", "x"], {"b", "E", "u"}),
        (["python", "-W", "ignore", "-X", "dev", "-I", "-m", "m"], {"I"}),
        (["python3.13t", "-Wignore", "-Xfrozen_modules=off", "-s", "t.py", "-I"], {"s"}),
        (["python", "--check-hash-based-pycs", "never", "-E", "t.py"], {"E"}),
        (["python", "-cI"], set()),
        (["python", "-mI"], set()),
        (["python", "-", "-I"], set()),
        (["torchrun", "-I"], set()),
        (["pythonic-tool", "-I"], set()),
    ],
)
def test_python_flags_reads_only_the_interpreters_own_options(cmd: list[str], flags: set[str]) -> None:
    assert flags == python_flags(cmd)
