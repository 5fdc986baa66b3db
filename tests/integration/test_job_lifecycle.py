"""Real 2-rank torchrun jobs under `torchpulse run`: elastic restarts, a node leaving, a rank hung in a collective."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support import PYTHON, REPO, DaemonProcess, free_port, select, wait_for

TORCHRUN = str(Path(sys.executable).parent / "torchrun")

# Rank FAIL_RANK raises at step FAIL_AT of the first attempt only; rank SLEEP_RANK sleeps before step SLEEP_AT
# (its peer then waits in the all-reduce). Each attempt uses a store prefix of its own: torchrun's agent store
# keeps the first attempt's gloo addresses, and a restarted gloo group would try to connect to them.
TRAIN = textwrap.dedent("""
    import os, time
    import torch, torch.distributed as dist
    env = lambda name, default: int(os.environ.get(name, default))
    attempt = env("TORCHELASTIC_RESTART_COUNT", 0)
    store = dist.PrefixStore(f"attempt{attempt}", dist.TCPStore(
        os.environ["MASTER_ADDR"], env("MASTER_PORT", 0), is_master=False))
    dist.init_process_group("gloo", store=store, rank=env("RANK", 0), world_size=env("WORLD_SIZE", 1))
    rank = dist.get_rank()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(env("STEPS", 0)):
        if attempt == 0 and rank == env("FAIL_RANK", -1) and step == env("FAIL_AT", -1):
            raise RuntimeError("injected failure")
        if rank == env("SLEEP_RANK", -1) and step == env("SLEEP_AT", -1):
            time.sleep(env("SLEEP_S", 0))
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        time.sleep(env("STEP_MS", 0) / 1000)
    dist.destroy_process_group()
    """)


def _start(
    daemon: DaemonProcess, tmp_path: Path, run: str, *torchrun_args: str, nproc: int = 2, **settings: str
) -> subprocess.Popen[str]:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchpulse",
            "run",
            "--run-name",
            run,
            "--",
            TORCHRUN,
            "--nproc-per-node",
            str(nproc),
            "--monitor-interval",
            "0.5",
            *torchrun_args,
            str(script),
        ],
        cwd=REPO,
        env=daemon.env(**settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _per_rank(daemon: DaemonProcess, name: str, run: str, **labels: str) -> dict[str, float]:
    return {dict(key)["rank"]: value for key, value in select(daemon.scrape(), name, run=run, **labels).items()}


def test_an_elastic_restart_keeps_the_run_and_its_ranks_without_a_rank_claimed_twice(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """Rank 1 fails at step 4 of the first attempt: the restarted ranks take their ranks over in the same run."""
    job = _start(daemon, tmp_path, "elastic", "--max-restarts", "1", STEPS="12", FAIL_RANK="1", FAIL_AT="4")
    assert 0 == job.wait(120), job.stdout.read() if job.stdout else ""
    wait_for(lambda: {"0": 1.0, "1": 1.0} == _per_rank(daemon, "torchpulse_agent_exited", "elastic"))
    # Counters are the process's own: the second attempt's ranks count their 12 steps from 0.
    assert ({"0": 12.0, "1": 12.0}, {}) == (
        _per_rank(daemon, "torchpulse_optimizer_steps_total", "elastic"),
        {
            dict(k)["reason"]: v
            for k, v in select(daemon.scrape(), "torchpulse_daemon_frames_rejected_total").items()
            if v
        },
    )


def test_a_command_that_times_out_on_a_rank_hung_in_a_collective_still_applies_when_it_steps_again(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """`ctl disable` times out while rank 1 sleeps before step 5, says it stays queued, and applies after step 5."""
    job = _start(daemon, tmp_path, "hung", STEPS="9", SLEEP_RANK="1", SLEEP_AT="5", SLEEP_S="8")
    try:
        wait_for(
            lambda: {"0": 5.0, "1": 5.0} == _per_rank(daemon, "torchpulse_optimizer_steps_total", "hung"), timeout=60
        )
        ctl = subprocess.run(
            [
                sys.executable,
                "-m",
                "torchpulse",
                "ctl",
                "disable",
                "autograd",
                "--run",
                "hung",
                "--rank",
                "1",
                "--timeout",
                "1",
            ],
            cwd=REPO,
            env=daemon.env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert 0 == job.wait(60), job.stdout.read() if job.stdout else ""
    finally:
        job.kill()
    assert (
        1,
        "rank   1  timeout       no answer within 1s (the rank is at step 5 and has not reached its next "
        "step boundary, or is stuck; the command stays queued and applies there if the rank gets there)\n",
        "",
    ) == (ctl.returncode, ctl.stdout, ctl.stderr)
    # Rank 1 counted the backward pass of step 5, then applied the command at that step's boundary.
    wait_for(
        lambda: {"0": 9.0, "1": 6.0} == _per_rank(daemon, "torchpulse_backward_passes_total", "hung", kind="backward")
    )


def test_a_rank_restarted_under_another_number_after_a_node_left_is_not_left_down(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """Two one-rank nodes; the first leaves: the second restarts as rank 0 of 1, and its old rank 1 is forgotten."""
    port = free_port()
    # The rendezvous store outlives both nodes, as a dedicated endpoint does in a real elastic job.
    store = subprocess.Popen(
        [
            PYTHON,
            "-c",
            "import time, torch.distributed as d; "
            f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False); "
            "time.sleep(600)",
        ]
    )
    elastic = (
        "--nnodes",
        "1:2",
        "--max-restarts",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "shrink",
        "--rdzv-conf",
        "is_host=false,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2",
    )
    # The rendezvous numbers nodes by their agents' pids: the one started first is rank 0.
    leaving = _start(daemon, tmp_path, "shrink", *elastic, nproc=1, STEPS="40", STEP_MS="100")
    staying = _start(daemon, tmp_path, "shrink", *elastic, nproc=1, STEPS="40", STEP_MS="100")
    try:
        wait_for(lambda: {"0", "1"} == set(_per_rank(daemon, "torchpulse_optimizer_steps_total", "shrink")), timeout=60)
        leaving.send_signal(signal.SIGTERM)
        leaving.wait(30)
        assert 0 == staying.wait(90), staying.stdout.read() if staying.stdout else ""
    finally:
        for proc in (leaving, staying, store):
            proc.kill()
            proc.wait()
    wait_for(lambda: 1.0 == _per_rank(daemon, "torchpulse_agent_exited", "shrink").get("0"))
    samples = daemon.scrape()
    assert ({"0": 0.0}, {"0": 1.0}, {"0": 40.0}, ["1"]) == (
        _per_rank(daemon, "torchpulse_agent_up", "shrink"),
        _per_rank(daemon, "torchpulse_agent_exited", "shrink"),
        _per_rank(daemon, "torchpulse_optimizer_steps_total", "shrink"),
        [dict(key)["world_size"] for key in select(samples, "torchpulse_run_info", run="shrink")],
    )
