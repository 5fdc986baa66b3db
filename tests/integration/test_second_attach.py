"""A second life of the agent in one process, seen from the daemon."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.support import DaemonProcess, run_job, select, wait_for

SECOND_LIFE = textwrap.dedent("""
    import torch, torchpulse

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(steps):
        for _ in range(steps):
            opt.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            opt.step()

    train(5)
    torchpulse.detach()
    train(2)  # not measured
    torchpulse.attach()
    train(3)
    """)


def test_attach_after_detach_continues_the_running_totals_the_daemon_holds(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """A second attach() in one process counts on from the first life's totals instead of sending them from 0."""
    run = "second-life"
    env = daemon.env(OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE="1", TORCHPULSE_FLUSH_INTERVAL="0.05")
    result = run_job(SECOND_LIFE, tmp_path, run, env)
    assert (0, "") == (result.returncode, result.stderr)
    wait_for(
        lambda: 2 == sum(e.get("event") == "agent disconnected" and e.get("run") == run for e in daemon.log_lines())
    )
    key = (("optimizer", "SGD#0"), ("rank", "0"), ("run", run))
    assert {key: 8.0} == select(daemon.scrape(), "torchpulse_optimizer_steps_total", run=run)
    assert {key[1:]: 1.0} == select(daemon.scrape(), "torchpulse_agent_exited", run=run)
