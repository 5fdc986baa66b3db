"""`torchpulse ctl` against real training processes and a real daemon."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.support import (
    REPO,
    DaemonProcess,
    Samples,
    as_user,
    parse_exposition,
    select,
    start_daemon,
    wait_for,
)
from torchpulse import cli
from torchpulse.daemon.client import send_ctl
from torchpulse.protocol import Batch, CtlRequest, Hello, Sample, encode


def _job(daemon: DaemonProcess, run: str, job: list[str], rank: int = 0, ranks: int = 1) -> subprocess.Popen[str]:
    """`torchpulse run --run-name RUN -- python JOB...` as `rank` of `ranks`, with the optimizer probe."""
    return subprocess.Popen(
        [sys.executable, "-m", "torchpulse", "run", "--run-name", run, "--", sys.executable, *job],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=daemon.env(RANK=str(rank), WORLD_SIZE=str(ranks), OMP_NUM_THREADS="1", TORCHPULSE_PROBES="optimizer"),
    )


def _jobs(daemon: DaemonProcess, run: str, steps: int, sleep: float, ranks: int = 2) -> list[subprocess.Popen[str]]:
    demo_job = ["-m", "torchpulse.demo_job", "--steps", str(steps), "--step-sleep", str(sleep)]
    return [_job(daemon, run, demo_job, rank, ranks) for rank in range(ranks)]


def _ctl(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchpulse", "ctl", *args, "--socket", str(daemon.socket_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=daemon.env(),
    )


def _ctl_as_user(uid: int, argv: list[str]) -> tuple[int, str]:
    """Run the ctl CLI code as `uid` (in-process in a forked child): its exit code and stderr."""

    def ctl() -> tuple[int, bytes]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main(argv)
        return code, err.getvalue().encode()

    code, stderr = as_user(ctl, uid)
    return code, stderr.decode()


def _wait_connected(daemon: DaemonProcess, run: str, ranks: int = 2) -> None:
    wait_for(lambda: ranks == sum(select(daemon.scrape(), "torchpulse_agent_up", run=run).values()), timeout=60)


def _fresh_scrape(daemon: DaemonProcess) -> Samples:
    """A scrape rendered after this call began.

    The exporter serves a render again while it is younger than the time it took, so a scrape may show the
    state from before a change the test has seen on another channel. Renders differ from one another (each
    carries its collectors' durations): a body unlike the first one fetched here was rendered since.
    """
    first = daemon.scrape_text()
    latest = [first]

    def rendered_since() -> bool:
        latest[0] = daemon.scrape_text()
        return latest[0] != first

    wait_for(rendered_since)
    return parse_exposition(latest[0])


def _agent_step(daemon: DaemonProcess, run: str) -> int:
    """The step counter of rank 0's agent, from `ctl status` (answered at once by its agent thread)."""
    reply = send_ctl(daemon.socket_path, CtlRequest(run, [0], "status", {}, 20.0), 30.0)
    step = reply.results[0].data.get("step")
    assert isinstance(step, int), reply
    return step


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait(30)


def test_trace_on_two_ranks_covers_the_same_requested_steps(daemon: DaemonProcess, tmp_path: Path) -> None:
    """Both ranks write a Chrome trace of exactly N optimizer steps, starting at the same step."""
    procs = _jobs(daemon, "tr", steps=100000, sleep=0.01)
    try:
        _wait_connected(daemon, "tr")
        result = _ctl(daemon, "trace", "--run", "tr", "--steps", "5", "--out", str(tmp_path), "--timeout", "60")
        assert 0 == result.returncode, result.stdout + result.stderr
        lines = result.stdout.splitlines()
        assert 2 == len(lines)
        starts = set()
        for line in lines:
            fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
            starts.add((fields["first_step"], fields["last_step"]))
            events = json.loads(Path(fields["path"]).read_text())["traceEvents"]
            steps = [e for e in events if str(e.get("name", "")).startswith("Optimizer.step#AdamW.step")]
            assert 5 == len(steps)
        assert 1 == len(starts)
        first, last = starts.pop()
        assert 4 == int(last) - int(first)
    finally:
        _stop(procs)


def test_disable_takes_effect_at_the_next_step_and_enable_resumes(daemon: DaemonProcess) -> None:
    """After `ctl disable optimizer` the step counter stops moving; `ctl enable` makes it move again."""
    procs = _jobs(daemon, "ed", steps=100000, sleep=0.005, ranks=1)

    def steps() -> float:
        return sum(select(_fresh_scrape(daemon), "torchpulse_optimizer_steps_total", run="ed").values())

    try:
        _wait_connected(daemon, "ed", 1)
        assert 0 == _ctl(daemon, "disable", "optimizer", "--run", "ed").returncode
        answered = time.monotonic()
        # The answer may have gone out ahead of the batch with the rank's last counted step: the sender
        # drained the step values, the training thread then applied the command and queued its answer, and
        # the sender sent the older batch, then the answer. That step comes in the sender's next batch: once
        # the daemon has taken a batch of the rank's since the answer came, it holds the final count. (With
        # nothing left to send, that batch is the agent's heartbeat, a few seconds on.)
        wait_for(lambda: (daemon.last_frame_after("ed") or 0.0) > answered, timeout=30)
        frozen = steps()
        # Frozen while the job steps on: the rank's own counter (which `ctl status` reads) moves past it.
        moved_from = _agent_step(daemon, "ed")
        wait_for(lambda: _agent_step(daemon, "ed") >= moved_from + 50, timeout=30)
        assert frozen == steps()
        assert 0 == _ctl(daemon, "enable", "optimizer", "--run", "ed").returncode
        wait_for(lambda: steps() > frozen, timeout=10)
        assert procs[0].poll() is None
    finally:
        _stop(procs)


def test_a_rank_that_cannot_answer_times_out_and_a_gone_rank_is_reported(daemon: DaemonProcess) -> None:
    """A stopped rank (alive, not stepping) times out; the other answers; a killed rank is not_connected."""
    procs = _jobs(daemon, "dead", steps=100000, sleep=0.005)
    try:
        _wait_connected(daemon, "dead")
        procs[1].send_signal(signal.SIGSTOP)
        started = time.monotonic()
        result = _ctl(daemon, "enable", "optimizer", "--run", "dead", "--timeout", "2")
        assert time.monotonic() - started < 20
        assert 1 == result.returncode
        lines = result.stdout.splitlines()
        assert lines[0].startswith("rank   0  ok")
        assert lines[1].startswith("rank   1  timeout       no answer within 2s")
        procs[1].kill()
        procs[1].wait(30)
        wait_for(lambda: 1 == sum(select(daemon.scrape(), "torchpulse_agent_up", run="dead").values()))
        gone = _ctl(daemon, "status", "--run", "dead", "--rank", "1", "--timeout", "2")
        assert (1, "rank   1  not_connected rank is not connected") == (gone.returncode, gone.stdout.strip())
    finally:
        _stop(procs)


@pytest.mark.process
@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_a_caller_outside_the_allowed_users_is_refused() -> None:
    """Another user who can reach the socket gets a clear refusal, and the daemon logs who asked."""
    shared = Path(tempfile.mkdtemp(prefix="torchpulse-ctl-"))
    shared.chmod(0o755)
    daemon = start_daemon(shared)
    try:
        daemon.socket_path.chmod(0o666)
        code, stderr = _ctl_as_user(65534, ["ctl", "status", "--run", "any", "--socket", str(daemon.socket_path)])
        assert (
            1,
            "torchpulse: refused: uid 65534 may not send commands to this run (allowed: root, the daemon's "
            "user or the user whose job reports the run)\n",
        ) == (code, stderr)
        wait_for(lambda: any(e.get("event") == "command refused" and e.get("uid") == 65534 for e in daemon.log_lines()))
    finally:
        daemon.stop()


def test_commands_are_not_starved_by_heavy_event_traffic(daemon: DaemonProcess) -> None:
    """While four connections flood the daemon with batches, a status command still answers quickly."""
    procs = _jobs(daemon, "busy", steps=100000, sleep=0.005, ranks=1)
    stop = threading.Event()

    def flood(index: int) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(daemon.socket_path))
            sock.sendall(encode(Hello(f"flood{index}", 0, 0, 1, os.getpid(), "h", "2.13", "0.1.0", "x", 0.0)))
            frame = encode(
                Batch(1, 0.0, [Sample("optimizer_steps_total", (f"SGD#{i}",), 1.0) for i in range(500)], [], [])
            )
            while not stop.is_set():
                sock.sendall(frame)

    threads = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(4)]
    try:
        _wait_connected(daemon, "busy", 1)
        for thread in threads:
            thread.start()
        time.sleep(0.5)
        started = time.monotonic()
        result = _ctl(daemon, "status", "--run", "busy", "--timeout", "10")
        elapsed = time.monotonic() - started
        assert 0 == result.returncode, result.stdout + result.stderr
        assert elapsed < 8, elapsed
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)
        _stop(procs)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["status", "--run", "x", "--rank", "99999999999999999999999"], "argument --rank: must be from 0 to"),
        (["status", "--run", "x", "--rank", "-1"], "argument --rank: must be from 0 to"),
        (["status", "--run", "x", "--timeout", "nan"], "argument --timeout: must be from 0 (exclusive) to 3600"),
        (["status", "--run", "x", "--timeout", "inf"], "argument --timeout: must be from 0 (exclusive) to 3600"),
        (["status", "--run", "x", "--timeout", "0"], "argument --timeout: must be from 0 (exclusive) to 3600"),
        (["autograd-log", "99999999999999999999999", "--run", "x"], "argument passes: must be from 1 to 100"),
        (["sample", "autograd", "1e-30", "--run", "x"], "argument rate: must be 0 (off) or from 1e-06 to 1, got 1e-30"),
        (["trace", "--steps", "100000", "--out", "/tmp/t", "--run", "x"], "argument --steps: must be from 1 to 100"),
        (
            ["trace", "--steps", "5", "--out", "/tmp/t", "--run", "x", "--start-step", "1" + "0" * 30],
            "argument --start-step: must be from 0 to",
        ),
    ],
)
def test_out_of_range_numbers_are_a_usage_error_not_a_traceback(
    daemon: DaemonProcess, args: list[str], error: str
) -> None:
    """Numbers msgpack cannot carry or agents would refuse fail in the CLI with exit 2 and one clear line."""
    result = _ctl(daemon, *args)
    assert (2, "") == (result.returncode, result.stdout), result.stderr
    assert error in result.stderr
    assert "Traceback" not in result.stderr


def test_an_undecodable_run_name_is_addressed_as_the_agents_send_it(daemon: DaemonProcess) -> None:
    """A run name with a non-UTF-8 byte (the agent sends it with "?") reaches the daemon, no traceback."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchpulse",
            "ctl",
            "status",
            "--run",
            b"caf\xe9".decode("utf-8", "surrogateescape"),
            "--socket",
            str(daemon.socket_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=daemon.env(),
    )
    assert (1, "run caf?: no such run, or no ranks connected\n", "") == (
        result.returncode,
        result.stdout,
        result.stderr,
    )


def test_a_rank_that_exits_while_a_command_waits_is_reported_at_once(daemon: DaemonProcess) -> None:
    """A stopped rank is killed while `ctl` waits for it: the answer is not_connected right away,
    not a timeout at the end of --timeout."""
    procs = _jobs(daemon, "gone", steps=100000, sleep=0.005, ranks=1)
    try:
        _wait_connected(daemon, "gone", 1)
        procs[0].send_signal(signal.SIGSTOP)
        started = time.monotonic()
        ctl = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torchpulse",
                "ctl",
                "enable",
                "autograd",
                "--run",
                "gone",
                "--timeout",
                "60",
                "--socket",
                str(daemon.socket_path),
            ],
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=daemon.env(),
        )
        wait_for(lambda: any(e.get("event") == "command received" for e in daemon.log_lines()))
        procs[0].kill()
        stdout, stderr = ctl.communicate(timeout=90)
        assert time.monotonic() - started < 30
        assert (
            1,
            "rank   0  not_connected the rank disconnected before answering (it exited, detached or reconnected)",
        ) == (ctl.returncode, stdout.strip()), stderr
    finally:
        _stop(procs)


def test_a_rank_named_twice_gets_the_command_once_and_an_unknown_rank_is_named(daemon: DaemonProcess) -> None:
    """ranks [0, 0, 7] from a raw client: one answer for rank 0, and rank 7 is not part of the run."""
    procs = _jobs(daemon, "twice", steps=100000, sleep=0.005, ranks=1)
    try:
        _wait_connected(daemon, "twice", 1)
        reply = send_ctl(daemon.socket_path, CtlRequest("twice", [0, 0, 7], "status", {}, 20.0), 30.0)
        assert [(0, "ok"), (7, "not_connected")] == [(r.rank, r.status) for r in reply.results]
        assert "no such rank in this run" == reply.results[1].message
    finally:
        _stop(procs)


# A training loop that ends on its own three steps into a trace: its last step comes while the profiler
# captures, however long the command took to reach it (a job of a fixed number of steps may end before).
JOB_ENDING_MID_TRACE = """
import time

import torch

model = torch.nn.Linear(8, 8)
optimizer = torch.optim.AdamW(model.parameters())
traced = 0
while traced < 3:
    optimizer.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()  # the agent starts a trace in a hook of the step before the trace's first one
    traced += torch._C._autograd._profiler_enabled()  # torch's own flag: a profiler is capturing
    time.sleep(0.01)
"""


def test_a_job_that_ends_mid_trace_exits_cleanly_and_says_so(daemon: DaemonProcess, tmp_path: Path) -> None:
    """The job finishes its last step while a long trace is capturing: it exits 0, its profiler is stopped by
    the agent's detach, and `ctl` reports a failure at once instead of a timeout."""
    script = tmp_path / "job.py"
    script.write_text(JOB_ENDING_MID_TRACE)
    job = _job(daemon, "short", [str(script)])
    try:
        # Stepping already: the trace's first step is then planned from the job's real step rate.
        wait_for(
            lambda: 5 <= sum(select(daemon.scrape(), "torchpulse_optimizer_steps_total", run="short").values()),
            timeout=60,
        )
        started = time.monotonic()
        result = _ctl(
            daemon, "trace", "--run", "short", "--steps", "100", "--out", str(tmp_path / "traces"), "--timeout", "300"
        )
        assert time.monotonic() - started < 60
        assert 1 == result.returncode
        assert re.fullmatch(
            r"rank   0  failed        the agent detached before the trace of steps \d+\.\.\d+ was "
            r"complete; nothing was written",
            result.stdout.strip(),
        ), result.stdout + result.stderr
        _, stderr = job.communicate(timeout=60)
        assert 0 == job.returncode, stderr
        assert "Traceback" not in stderr
    finally:
        _stop([job])
