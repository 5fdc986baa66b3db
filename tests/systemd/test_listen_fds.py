"""Socket activation: a real listening socket inherited by a real child process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("activated_child.py")

# What systemd does between fork and exec: the passed socket goes to fd 3 and
# LISTEN_PID names the process that will exec the daemon (exec keeps the pid).
ACTIVATE = """
import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


def _child_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("LISTEN_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _listening_socket(path: Path) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()
    return server


def _report(stdout: str) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return report


@pytest.mark.process
def test_child_takes_the_inherited_socket_and_serves_a_client_that_connected_first(
    tmp_path: Path,
) -> None:
    """A client that connected before the daemon started is served on the inherited socket."""
    path = tmp_path / "agent.sock"
    with _listening_socket(path) as server, socket.socket(socket.AF_UNIX) as client:
        client.connect(str(path))  # before the "daemon" exists: waits in the backlog
        client.sendall(b"hello")
        child = subprocess.run(
            [sys.executable, "-c", ACTIVATE, str(server.fileno()), str(CHILD), "--serve"],
            pass_fds=(server.fileno(),),
            env=_child_env(LISTEN_FDS="1", LISTEN_FDNAMES="agent"),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        client.settimeout(10)
        reply = client.recv(64)

    assert child.returncode == 0, child.stderr
    report = _report(child.stdout)
    assert reply == b"echo:hello"
    assert report["names"] == ["agent"]
    assert report["fds"] == [3]
    assert report["families"] == ["AF_UNIX"]
    assert report["inheritable"] == [False]
    assert report["listen_env_left"] == []


@pytest.mark.process
def test_sockets_meant_for_another_process_are_left_alone(tmp_path: Path) -> None:
    """With LISTEN_PID naming another process nothing is taken, yet the variables are cleared."""
    with _listening_socket(tmp_path / "agent.sock") as server:
        os.set_inheritable(server.fileno(), True)
        child = subprocess.run(
            [sys.executable, str(CHILD)],
            pass_fds=(server.fileno(),),
            env=_child_env(LISTEN_PID=str(os.getpid()), LISTEN_FDS="1", LISTEN_FDNAMES="agent"),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    assert child.returncode == 0, child.stderr
    report = _report(child.stdout)
    assert report["names"] == []
    assert report["listen_env_left"] == []


@pytest.mark.process
def test_missing_names_default_to_unknown(tmp_path: Path) -> None:
    """Without LISTEN_FDNAMES every socket is named 'unknown', as sd_listen_fds_with_names says."""
    with _listening_socket(tmp_path / "agent.sock") as server:
        child = subprocess.run(
            [sys.executable, "-c", ACTIVATE, str(server.fileno()), str(CHILD)],
            pass_fds=(server.fileno(),),
            env=_child_env(LISTEN_FDS="1"),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    assert child.returncode == 0, child.stderr
    assert _report(child.stdout)["names"] == ["unknown"]


@pytest.mark.process
def test_systemd_socket_activate_hands_over_the_socket(tmp_path: Path, require_tool: Callable[[str], str]) -> None:
    """systemd's own activator (same code path as PID 1) binds, passes and names the socket."""
    activator = require_tool("systemd-socket-activate")
    path = tmp_path / "agent.sock"
    env = _child_env()
    proc = subprocess.Popen(
        [
            activator,
            "--listen",
            str(path),
            "--fdname",
            "agent",
            "-E",
            f"PYTHONPATH={env['PYTHONPATH']}",
            sys.executable,
            str(CHILD),
            "--serve",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"activator did not bind {path}: {proc.communicate()[1]}")
            time.sleep(0.05)
        with socket.socket(socket.AF_UNIX) as client:
            client.settimeout(30)
            client.connect(str(path))
            client.sendall(b"hello")
            reply = client.recv(64)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()

    assert proc.returncode == 0, stderr
    report = _report(stdout)
    assert reply == b"echo:hello"
    assert report["names"] == ["agent"]
    assert report["fds"] == [3]
    assert report["inheritable"] == [False]
