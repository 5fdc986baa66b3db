"""`torchpulse ctl` used as on-call does: jobs with unusual loops or probe sets, and what the user is told."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import REPO, DaemonProcess, select, wait_for

# A small loop stepping ~100 times a second; with `--no-optimizer` it updates the weights by hand (no torch.optim).
JOB = """
import sys, time, torch
torch.set_num_threads(1)
model = torch.nn.Linear(8, 1)
opt = None if "--no-optimizer" in sys.argv else torch.optim.SGD(model.parameters(), lr=1e-3)
while True:
    model(torch.randn(4, 8)).pow(2).mean().backward()
    if opt is None:
        with torch.no_grad():
            for p in model.parameters():
                p -= 1e-3 * p.grad
                p.grad = None
    else:
        opt.step()
        opt.zero_grad()
    time.sleep(0.01)
"""


@pytest.fixture
def job(daemon: DaemonProcess, tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    """Started jobs, killed at the end of the test."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait(30)


def _start(
    procs: list[subprocess.Popen[str]], daemon: DaemonProcess, tmp_path: Path, run: str, probes: str, *args: str
) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    procs.append(
        subprocess.Popen(
            [sys.executable, "-m", "torchpulse", "run", "--run-name", run, "--", sys.executable, str(script), *args],
            cwd=REPO,
            text=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=daemon.env(OMP_NUM_THREADS="1", TORCHPULSE_PROBES=probes),
        )
    )
    wait_for(lambda: 1 == sum(select(daemon.scrape(), "torchpulse_agent_up", run=run).values()), timeout=60)


def _ctl(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchpulse", "ctl", *args, "--socket", str(daemon.socket_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=daemon.env(),
    )


def test_a_trace_works_while_the_optimizer_probe_is_off(
    daemon: DaemonProcess, tmp_path: Path, job: list[subprocess.Popen[str]]
) -> None:
    """Without the optimizer probe the daemon has no step metric: the trace's start step comes from the
    agent's own counter, not step 3 long past (which failed every such trace as 'missed the start step')."""
    _start(job, daemon, tmp_path, "noopt-probe", "autograd")
    wait_for(lambda: "step=0 " not in _ctl(daemon, "status", "--run", "noopt-probe").stdout, timeout=30)
    result = _ctl(
        daemon, "trace", "--run", "noopt-probe", "--steps", "2", "--out", str(tmp_path / "tr"), "--timeout", "30"
    )
    assert 0 == result.returncode, result.stdout + result.stderr
    path = Path(dict(p.split("=", 1) for p in result.stdout.split() if "=" in p)["path"])
    events = json.loads(path.read_text())["traceEvents"]
    assert 2 == sum(1 for e in events if e.get("name") == "Optimizer.step#SGD.step")


def test_a_loop_without_an_optimizer_is_told_why_commands_never_apply(
    daemon: DaemonProcess, tmp_path: Path, job: list[subprocess.Popen[str]]
) -> None:
    """A hand-written update never reaches a step boundary: the timeout says so instead of 'or is stuck'."""
    _start(job, daemon, tmp_path, "manual", "autograd", "--no-optimizer")
    result = _ctl(daemon, "disable", "autograd", "--run", "manual", "--timeout", "1")
    assert (
        1,
        "rank   0  timeout       no answer within 1s: the rank has finished no optimizer step yet, and "
        "commands apply right after optimizer.step() (a loop without a torch.optim optimizer never gets "
        "there)",
    ) == (result.returncode, result.stdout.strip()), result.stderr
