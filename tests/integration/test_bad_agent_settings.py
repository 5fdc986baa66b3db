"""Bad TORCHPULSE_* settings in a job's environment: one line that names the variable, and the job trains."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import run_job

JOB = """
import torch
model = torch.nn.Linear(2, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
print("trained")
"""


NOT_ATTACHED = 'agent not attached: ValueError("TORCHPULSE_FLUSH_INTERVAL: expected seconds'


@pytest.mark.process
@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("TORCHPULSE_FLUSH_INTERVAL", "abc", NOT_ATTACHED),
        ("TORCHPULSE_FLUSH_INTERVAL", "-1", NOT_ATTACHED),
        ("TORCHPULSE_PROBE_ERRORS", "loud", "TORCHPULSE_PROBE_ERRORS: expected disable or fatal, got 'loud'"),
        (
            "TORCHPULSE_OPT_AUTOGRAD_SAMPLE_EVERY",
            "x",
            "probe option invalid; probe skipped (probe='autograd' error=\"TORCHPULSE_OPT_AUTOGRAD_SAMPLE_EVERY: expected an",  # noqa: E501
        ),
        ("TORCHPULSE_OPT_AUTOGRAD_SAMPLE_EVERY", "-5", "(set by TORCHPULSE_OPT_AUTOGRAD_SAMPLE_EVERY)"),
        ("TORCHPULSE_OPT_AUTOGRAD_NONFINITE", "maybe", "TORCHPULSE_OPT_AUTOGRAD_NONFINITE: expected a boolean"),
        (
            "TORCHPULSE_OPT_COMPILE_TOP_K",
            "-3",
            "probe skipped (probe='compile' error='TORCHPULSE_OPT_COMPILE_TOP_K: must be >= 1, got -3')",
        ),
        (
            "TORCHPULSE_OPT_CUDAGRAPH_READINESS_EVERY",
            "0",
            "TORCHPULSE_OPT_CUDAGRAPH_READINESS_EVERY: must be >= 1, got 0",
        ),
    ],
)
def test_a_bad_setting_is_one_line_naming_its_variable_and_the_job_trains(
    tmp_path: Path, variable: str, value: str, says: str
) -> None:
    """A bad option used to read "probe unavailable on this torch" or a bare float() error, or (a negative
    top K) to pass unchecked."""
    env = {**os.environ, "TORCHPULSE_SOCKET": str(tmp_path / "no-daemon.sock"), variable: value}
    result = run_job(JOB, tmp_path, "bad-settings", env)
    assert 0 == result.returncode, result.stderr
    assert "trained" in result.stdout
    named = [line for line in result.stderr.splitlines() if variable in line]
    assert 1 == len(named), result.stderr
    assert says in named[0], named[0]
    assert "unavailable on this torch" not in result.stderr


BROKEN_PROBE_JOB = """
import torch
from torchpulse.probes.attach import current_agent
probe = current_agent().probes["optimizer"]  # attached by `torchpulse run`
probe._before_step = lambda *a: 1 / 0  # a probe bug, inside its hook
probe.uninstall()
probe.install()
model = torch.nn.Linear(2, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
print("trained")
"""


@pytest.mark.process
@pytest.mark.parametrize(("mode", "code"), [("disable", 0), ("fatal", 70)])
def test_a_probe_bug_disables_the_probe_or_under_fatal_ends_the_job_with_its_traceback(
    tmp_path: Path, mode: str, code: int
) -> None:
    """The job trains on by default; TORCHPULSE_PROBE_ERRORS=fatal (what the tests set for every job they start)
    ends it at once with exit status 70 and the probe's traceback on stderr."""
    env = {**os.environ, "TORCHPULSE_SOCKET": str(tmp_path / "no-daemon.sock"), "TORCHPULSE_PROBE_ERRORS": mode}
    result = run_job(BROKEN_PROBE_JOB, tmp_path, "broken-probe", env)
    assert (code, code == 0) == (result.returncode, "trained" in result.stdout), result.stderr
    fatal = "torchpulse: probe optimizer failed; exiting as TORCHPULSE_PROBE_ERRORS=fatal asks"
    assert (fatal in result.stderr, "ZeroDivisionError" in result.stderr) == (code != 0, True)
