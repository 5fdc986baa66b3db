"""Faults around the daemon: killed under socket activation, killed peers, stuck jobs, bad state dirs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import REPO, DaemonProcess, free_port, select, start_daemon, wait_for
from torchpulse.daemon.client import request_status
from torchpulse.probes.agent.sender import HEARTBEAT_INTERVAL
from torchpulse.protocol import Hello, encode

# Puts the listening socket on fd 3 and sets LISTEN_PID to its own pid (as systemd does for the
# process it starts), then execs the daemon.
EXEC_WITH_LISTEN_PID = (
    "import os, sys; fd = int(sys.argv[1])\n"
    "if fd != 3:\n    os.dup2(fd, 3)\n"
    "os.environ['LISTEN_PID'] = str(os.getpid()); os.execv(sys.argv[2], sys.argv[2:])"
)


class SocketHolder:
    """What systemd's socket unit does: own the listening agent socket, start daemons on it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.path = tmp / "agent.sock"
        self.port = free_port()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.path))
        self.listener.listen(128)
        self.proc: subprocess.Popen[bytes] | None = None

    def start_daemon(self) -> subprocess.Popen[bytes]:
        fd = self.listener.fileno()
        env = dict(os.environ, PYTHONPATH=str(REPO), LISTEN_FDS="1", LISTEN_FDNAMES="agent")
        log = (self.tmp / f"daemon-{time.monotonic_ns()}.log").open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                EXEC_WITH_LISTEN_PID,
                str(fd),
                sys.executable,
                "-m",
                "torchpulse",
                "daemon",
                "--socket",
                str(self.tmp / "unused.sock"),
                "--listen",
                f"127.0.0.1:{self.port}",
                "--state-dir",
                str(self.tmp / "state"),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=(fd,),
        )
        return self.proc

    def scrape(self) -> str:
        """The exposition, or "" while no daemon listens."""
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as response:
                return str(response.read().decode())
        except OSError:
            return ""


@pytest.mark.process
def test_sigkill_under_socket_activation_keeps_the_socket_and_the_counts(tmp_path: Path) -> None:
    """A 2-rank job keeps training through a daemon SIGKILL; the held socket queues reconnects and
    the restarted daemon ends at exactly N steps per rank, with no exception in the job."""
    from tests.support import parse_exposition

    holder = SocketHolder(tmp_path)
    daemon = holder.start_daemon()
    steps = 60
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        TORCHPULSE_SOCKET=str(holder.path),
        OMP_NUM_THREADS="1",
        TORCHPULSE_PROBES="optimizer",
    )
    jobs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torchpulse",
                "run",
                "--run-name",
                "sa",
                "--",
                sys.executable,
                "-m",
                "torchpulse.demo_job",
                "--steps",
                str(steps),
                "--step-sleep",
                "0.05",
            ],
            cwd=REPO,
            env=dict(env, RANK=str(r), WORLD_SIZE="2"),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for r in range(2)
    ]
    try:
        wait_for(lambda: "torchpulse_optimizer_steps_total" in holder.scrape(), timeout=60)
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(10)
        # While no daemon runs, connections still succeed: the socket is held, not gone.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(str(holder.path))
        time.sleep(1.0)
        daemon = holder.start_daemon()
        results = [(job.wait(120), job.stderr.read() if job.stderr else "") for job in jobs]
        assert [0, 0] == [code for code, _ in results]
        assert all("Traceback" not in err for _, err in results)

        def final() -> dict[str, float]:
            samples = parse_exposition(holder.scrape())
            return {
                dict(k)["rank"]: v for k, v in select(samples, "torchpulse_optimizer_steps_total", run="sa").items()
            }

        wait_for(lambda: {"0": float(steps), "1": float(steps)} == final(), timeout=30)
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
        daemon.terminate()
        daemon.wait(10)
        holder.listener.close()


def test_a_peer_killed_mid_frame_is_counted_and_the_daemon_serves_on(daemon: DaemonProcess) -> None:
    """A process that dies after half a frame leaves a `truncated` rejection and nothing else."""
    frame = encode(Hello("half", 0, 0, 1, 1, "h", "2.13", "0.1.0", "x", 0.0))
    code = (
        "import socket, os, sys, time\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.connect(sys.argv[1])\n"
        f"s.sendall({frame[: len(frame) // 2]!r}); print('sent', flush=True); time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(daemon.socket_path)], stdout=subprocess.PIPE, text=True)
    try:
        # Killed only once the half frame is sent: killed before (a slow start on a loaded machine), the
        # daemon saw no connection, or one that ended cleanly between frames, and counted nothing.
        assert child.stdout is not None
        assert "sent\n" == child.stdout.readline()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        if child.stdout is not None:
            child.stdout.close()
    wait_for(
        lambda: (
            1.0
            == select(daemon.scrape(), "torchpulse_daemon_frames_rejected_total", reason="truncated").get(
                (("reason", "truncated"),)
            )
        )
    )
    assert [] == request_status(daemon.socket_path).runs


def test_a_job_stuck_in_a_long_step_stays_up_and_answers_status(daemon: DaemonProcess, tmp_path: Path) -> None:
    """While the main thread sleeps inside a step, heartbeats keep the rank up and ctl status answers."""
    script, entered, release = tmp_path / "stuck.py", tmp_path / "entered", tmp_path / "release"
    # The long step lasts until the test has checked everything (`release`), two minutes at most: a step of a
    # fixed 12 s could end, on a loaded machine, before the checks inside it were done. `entered` holds the
    # monotonic time (the same clock in every process) at which the step began, written whole by a rename.
    script.write_text(
        "import os, sys, time, torch, torchpulse\n"
        "entered, release = sys.argv[1:]\n"
        "torchpulse.attach(probes=('optimizer',))\n"
        "m = torch.nn.Linear(2, 2); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for i in range(3):\n"
        "    m(torch.ones(1, 2)).sum().backward(); o.step()\n"
        "    if i == 1:  # the long step\n"
        "        with open(entered + '.tmp', 'w') as f:\n"
        "            f.write(repr(time.monotonic()))\n"
        "        os.rename(entered + '.tmp', entered)\n"
        "        deadline = time.monotonic() + 120\n"
        "        while not os.path.exists(release) and time.monotonic() < deadline:\n"
        "            time.sleep(0.05)\n"
    )
    job = subprocess.Popen(
        [sys.executable, str(script), str(entered), str(release)], cwd=REPO, env=daemon.env(TORCHPULSE_RUN="stuck")
    )
    try:
        wait_for(entered.exists, timeout=60)
        began = float(entered.read_text())

        # A frame that arrived more than half a heartbeat interval into the step: the step's own batch is sent
        # within a flush interval (0.25 s), so this is a heartbeat sent while the main thread waits.
        wait_for(lambda: (daemon.last_frame_after("stuck") or 0.0) > began + HEARTBEAT_INTERVAL / 2, timeout=30)
        assert {(("rank", "0"), ("run", "stuck")): 1.0} == select(daemon.scrape(), "torchpulse_agent_up", run="stuck")
        status = subprocess.run(
            [
                sys.executable,
                "-m",
                "torchpulse",
                "ctl",
                "status",
                "--run",
                "stuck",
                "--socket",
                str(daemon.socket_path),
                "--timeout",
                "5",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            env=daemon.env(),
        )
        assert 0 == status.returncode, status.stdout
        assert " step=2 " in status.stdout
        release.touch()
        assert 0 == job.wait(60)
    finally:
        release.touch()
        if job.poll() is None:
            job.kill()
            job.wait(10)


@pytest.mark.process
def test_an_unusable_state_directory_degrades_with_one_clear_line(tmp_path: Path) -> None:
    """A state dir that cannot be created is logged once; agents and scrapes keep working."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    daemon = start_daemon(tmp_path, extra_args=["--state-dir", str(blocker / "state")])
    try:
        warnings = [e for e in daemon.log_lines() if e.get("event", "").startswith("state directory not writable")]
        assert 1 == len(warnings)
        assert [1.0] == list(select(daemon.scrape(), "torchpulse_build_info").values())
        assert [] == request_status(daemon.socket_path).runs
    finally:
        daemon.stop()
