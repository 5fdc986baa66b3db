"""An agent inside a job that runs for weeks: what reaches the daemon, and the job's stderr, over time.

Real jobs (subprocesses with the agent attached) against real daemon processes.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO, DaemonProcess, select, start_daemon, wait_for

# 2,000 events with 4 KiB details (what a recompile storm's guard texts look like) in one flush are
# twice MAX_FRAME_BYTES; one more event is larger than a frame on its own.
BIG_BATCH_JOB = """
import torch, torchpulse
from torchpulse.probes.attach import current_agent
torchpulse.attach(probes=("optimizer",))
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
model(torch.randn(2, 4)).sum().backward()
opt.step()
agent = current_agent()
assert agent.flush(10)
for n in range(2000):
    agent.emit("info", "recompile", detail="x" * 4096, n=n)
agent.emit("info", "huge", **{f"f{n}": "y" * 4096 for n in range(1100)})
opt.step()
assert agent.flush(10)
opt.step()
torchpulse.detach()
"""

# Steps until told to stop, so the test decides when the job ends.
LONG_JOB = """
import sys, time, pathlib, torch, torchpulse
torchpulse.attach(probes=("optimizer",))
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
stop = pathlib.Path(sys.argv[1])
while not stop.exists():
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    time.sleep(0.01)
torchpulse.detach()
"""


def _job(daemon: DaemonProcess, source: str, run: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", source, *args],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=daemon.env(TORCHPULSE_RUN=run, OMP_NUM_THREADS="1"),
    )


@pytest.mark.process
def test_a_batch_larger_than_a_frame_is_sent_in_halves_and_an_item_larger_than_a_frame_is_counted(
    tmp_path: Path,
) -> None:
    """Every one of 2,000 large events reaches the daemon's log over the one connection (no reset, no
    stderr line); the single event larger than a frame is dropped and counted as `oversized`."""
    daemon = start_daemon(tmp_path)
    try:
        job = _job(daemon, BIG_BATCH_JOB, "big")
        _out, err = job.communicate(timeout=120)
        assert (0, "") == (job.returncode, err)
        lines = daemon.log_lines()
        assert 2000 == sum(1 for e in lines if e.get("event") == "recompile")
        assert 1 == sum(1 for e in lines if e.get("event") == "agent connected")
        dropped = select(daemon.scrape(), "torchpulse_agent_events_dropped_total", run="big")
        assert {"oversized": 1.0} == {dict(k)["reason"]: v for k, v in dropped.items() if v}
    finally:
        daemon.stop()


@pytest.mark.process
def test_a_daemon_restarted_again_and_again_costs_the_job_a_bounded_number_of_stderr_lines(tmp_path: Path) -> None:
    """Five daemon restarts under one job: the first three outages (connection.FREE_UNREACHABLE_NOTES) are
    each one line and a reconnect line, the later ones none; the job reconnects after every one and ends
    with exit status 0."""
    daemon = start_daemon(tmp_path)
    stop = tmp_path / "stop"
    job = _job(daemon, LONG_JOB, "restarts", str(stop))
    try:
        for _ in range(5):
            wait_for(lambda d=daemon: bool(select(d.scrape(), "torchpulse_agent_up", run="restarts")), timeout=30)
            daemon.stop(signal.SIGKILL)
            daemon = daemon.restart()
        wait_for(lambda: bool(select(daemon.scrape(), "torchpulse_agent_up", run="restarts")), timeout=30)
        stop.touch()
        _out, err = job.communicate(timeout=60)
        lines = err.splitlines()
        assert 0 == job.returncode, err
        assert 3 == sum(1 for line in lines if "daemon not reachable" in line), err
        assert 3 == sum(1 for line in lines if "reconnected to the daemon" in line), err
        assert 6 == len(lines), err
        assert "further outages are reported at most once every 3600s" in lines[4]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(30)
        daemon.stop()
