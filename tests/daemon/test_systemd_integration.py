"""The real daemon under socket activation and sd_notify, the way systemd runs it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import REPO, free_port, require_tool, wait_for
from torchpulse.daemon.client import request_status


def _datagrams(sock: socket.socket, until: float) -> list[str]:
    sock.settimeout(0.2)
    messages = []
    while time.monotonic() < until:
        try:
            messages.append(sock.recv(4096).decode())
        except TimeoutError:
            continue
    return messages


@pytest.mark.process
def test_socket_activated_daemon_notifies_ready_pings_watchdog_and_survives_restart(tmp_path: Path) -> None:
    """Under LISTEN_FDS the daemon serves the inherited socket, says READY=1 with STATUS=, pings
    WATCHDOG=1 from its loop, says STOPPING=1 on SIGTERM, and the socket outlives it."""
    agent_sock = tmp_path / "agent.sock"
    notify_path = tmp_path / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), NOTIFY_SOCKET=str(notify_path), WATCHDOG_USEC="400000")
    cmd = [
        require_tool("systemd-socket-activate"),
        "-l",
        str(agent_sock),
        "--fdname=agent",
        "-E",
        "NOTIFY_SOCKET",
        "-E",
        "WATCHDOG_USEC",
        "-E",
        "PYTHONPATH",
        sys.executable,
        "-m",
        "torchpulse",
        "daemon",
        "--socket",
        str(tmp_path / "unused.sock"),
        "--listen",
        f"127.0.0.1:{port}",
        "--state-dir",
        str(tmp_path / "state"),
    ]
    # systemd-socket-activate waits for the first connection before starting the daemon, like
    # systemd: connecting is what starts it.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(agent_sock.exists, timeout=10)
        reply = request_status(agent_sock, timeout=30)
        assert [] == reply.runs
        messages = _datagrams(notify, time.monotonic() + 1.5)
        assert messages[0].startswith("READY=1\nSTATUS=0 runs, 0 ranks connected")
        assert sum(m == "WATCHDOG=1" for m in messages) >= 3
        assert not (tmp_path / "unused.sock").exists()
        proc.terminate()
        proc.wait(15)
        assert "STOPPING=1" in _datagrams(notify, time.monotonic() + 0.5) or proc.returncode is not None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        notify.close()
