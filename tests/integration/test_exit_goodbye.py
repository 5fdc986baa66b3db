"""A rank that ends normally says goodbye (exited); one that fails does not (gone: the down alert fires)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.support import DaemonProcess, run_job, select, wait_for

JOB = textwrap.dedent("""
    import atexit, sys, torch

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    how = sys.argv[1]
    if how == "raise":
        raise RuntimeError("NCCL watchdog timeout (simulated)")
    if how == "exit":
        sys.exit(3)
    if how == "interrupt":
        raise KeyboardInterrupt
    if how == "atexit_exit":
        atexit.register(sys.exit, 4)  # runs before the agent's own handler; Python ignores its SystemExit
    """)


@pytest.mark.parametrize(
    ("how", "code", "exited", "cause"),
    [
        ("raise", 1, 0.0, "RuntimeError"),
        ("exit", 3, 0.0, "sys.exit(3)"),
        ("return", 0, 1.0, None),
        ("interrupt", -2, 1.0, None),  # Ctrl-C, a deliberate stop: Python ends itself by SIGINT
        ("atexit_exit", 0, 1.0, None),  # a failing sys.exit() in an atexit callback leaves the status 0
    ],
)
def test_only_a_normal_end_says_goodbye(
    daemon: DaemonProcess, tmp_path: Path, how: str, code: int, exited: float, cause: str | None
) -> None:
    run = f"end-{how}"
    env = daemon.env(OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE="1", TORCHPULSE_FLUSH_INTERVAL="0.05")
    result = run_job(JOB, tmp_path, run, env, how)
    assert code == result.returncode, result.stderr
    key = (("rank", "0"), ("run", run))
    # The daemon logs the agent's last events before its disconnection.
    wait_for(lambda: any(e.get("event") == "agent disconnected" and e.get("run") == run for e in daemon.log_lines()))
    assert {key: 0.0} == select(daemon.scrape(), "torchpulse_agent_up", run=run)
    assert {key: 5.0} == {
        k[1:]: v for k, v in select(daemon.scrape(), "torchpulse_optimizer_steps_total", run=run).items()
    }
    assert {key: exited} == select(daemon.scrape(), "torchpulse_agent_exited", run=run)
    failing = [
        e.get("cause")
        for e in daemon.log_lines()
        if e.get("event") == "process exiting on failure" and e.get("run") == run
    ]
    disconnected = [
        (e.get("level"), e.get("said_goodbye"))
        for e in daemon.log_lines()
        if e.get("event") == "agent disconnected" and e.get("run") == run
    ]
    assert [("info", True) if exited else ("warning", False)] == disconnected
    assert ([] if cause is None else [cause]) == failing, [e.get("event") for e in daemon.log_lines()]
