"""The agent's connection under a daemon that dies while blocked, and across fork()."""

from __future__ import annotations

import signal
import subprocess
import textwrap
import time

from tests.support import PYTHON, REPO, DaemonProcess


def test_a_daemon_dying_while_the_sender_is_blocked_never_kills_a_job_with_default_sigpipe(
    daemon: DaemonProcess,
) -> None:
    """A job that restored SIGPIPE's default trains on when the stalled daemon dies under a full send buffer."""
    code = textwrap.dedent("""
        import signal, time, torch, torchpulse
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        agent = torchpulse.attach(probes=["optimizer"], flush_interval=0.02)
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(1, 2)).sum().backward(); opt.step()
        assert agent.flush(10)
        print("connected", flush=True)
        start = time.monotonic()
        while time.monotonic() - start < 4:
            agent.emit("info", "filler", blob="x" * 4000)  # fills the stalled daemon's socket buffer
            model(torch.randn(1, 2)).sum().backward(); opt.step(); opt.zero_grad()
            time.sleep(0.001)
        torchpulse.detach()
        print("trained on", flush=True)
        """)
    job = subprocess.Popen(
        [PYTHON, "-c", code], env=daemon.env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert job.stdout is not None
    assert "connected\n" == job.stdout.readline()
    daemon.proc.send_signal(signal.SIGSTOP)
    job_alive_after_stall = job.poll() is None
    time.sleep(1.0)
    daemon.proc.kill()
    daemon.proc.wait(10)
    out, err = job.communicate(timeout=60)
    assert (True, 0, "trained on\n") == (job_alive_after_stall, job.returncode, out), err


def test_a_forked_child_holds_neither_the_daemon_connection_nor_the_wake_pipe(daemon: DaemonProcess) -> None:
    """After fork the child closes its copies of the agent's descriptors, so the parent's death is seen."""
    code = textwrap.dedent("""
        import os, torch, torchpulse
        agent = torchpulse.attach(probes=["optimizer"], flush_interval=0.02)
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(1, 2)).sum().backward(); opt.step()
        assert agent.flush(10)
        sender = agent._sender
        ours = {os.fstat(fd).st_ino for fd in (sender.link.sock.fileno(), sender._wake_r, sender._wake_w)}
        pid = os.fork()
        if pid == 0:
            held = set()
            for name in os.listdir("/proc/self/fd"):
                try:
                    held.add(os.fstat(int(name)).st_ino)
                except OSError:
                    pass
            os._exit(len(ours & held))
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), agent.flush(10), flush=True)
        torchpulse.detach()
        """)
    result = subprocess.run(
        [PYTHON, "-c", code], env=daemon.env(), cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert "0 True" == result.stdout.strip(), result.stderr
