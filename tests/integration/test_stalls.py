"""A stuck rank of a real 2-rank torchrun job: both ranks read stalled, and `ctl stacks` shows where each is."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import PYTHON, REPO, DaemonProcess, select, wait_for

TORCHRUN = str(Path(sys.executable).parent / "torchrun")

# Rank 1 parks in a function of its own at step 5 until the file RELEASE exists; rank 0 goes on into the
# all-reduce of step 5 and waits there for rank 1.
TRAIN = textwrap.dedent("""
    import os, pathlib, time
    import torch, torch.distributed as dist

    def blocked_in_a_function_of_the_test(release):
        while not release.exists():
            time.sleep(0.05)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10):
        if rank == 1 and step == 5:
            blocked_in_a_function_of_the_test(pathlib.Path(os.environ["RELEASE"]))
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
    dist.destroy_process_group()
""")


@pytest.mark.process
def test_a_rank_stuck_in_a_function_and_its_peer_waiting_in_the_collective_both_read_stalled_with_their_stacks(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """With a 2 s threshold, both ranks read torchpulse_agent_stalled 1 within a few seconds; `ctl stacks` shows
    rank 1 in the test's function and rank 0 in all_reduce, and both go back to 0 once rank 1 is let go."""
    script, release = tmp_path / "train.py", tmp_path / "release"
    script.write_text(TRAIN)
    job = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "torchpulse",
            "run",
            "--run-name",
            "stuck",
            "--",
            TORCHRUN,
            "--nproc-per-node",
            "2",
            str(script),
        ],
        cwd=REPO,
        env=daemon.env(TORCHPULSE_STALL_SECONDS="2", RELEASE=str(release)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def stalled() -> dict[str, float]:
            found = select(daemon.scrape(), "torchpulse_agent_stalled", run="stuck")
            return {dict(key)["rank"]: value for key, value in found.items()}

        wait_for(lambda: {"0": 1.0, "1": 1.0} == stalled(), timeout=60)
        ctl = [PYTHON, "-m", "torchpulse", "ctl", "stacks", "--run", "stuck", "--socket", str(daemon.socket_path)]
        shown = subprocess.run(ctl, capture_output=True, text=True, timeout=30, cwd=REPO)
        assert 0 == shown.returncode, shown.stderr
        blocks = {block.split(":", 1)[0]: block for block in shown.stdout.strip().split("\n\n")}
        assert ["rank 0", "rank 1"] == sorted(blocks)
        assert ", in blocked_in_a_function_of_the_test\n" in blocks["rank 1"] + "\n"
        assert "dist.all_reduce(p.grad)" in blocks["rank 0"]
        assert "rank 1: step 5, last step " in blocks["rank 1"]
        as_json = subprocess.run([*ctl, "--json"], capture_output=True, text=True, timeout=30, cwd=REPO)
        results = {r["rank"]: r for r in json.loads(as_json.stdout)["results"]}
        assert (5, 5) == (results[0]["data"]["step"], results[1]["data"]["step"])
        logged = [line for line in daemon.log_lines() if str(line.get("event")).startswith("rank stalled")]
        assert {0, 1} == {line["rank"] for line in logged}
        release.touch()
        assert 0 == job.wait(60), job.stdout.read() if job.stdout else ""
        wait_for(lambda: {"0": 0.0, "1": 0.0} == stalled() or not stalled(), timeout=30)
    finally:
        release.touch()
        if job.poll() is None:
            job.kill()
            job.wait()
