"""Whom an agent talks to: a socket another user listens on gets neither the job's hello nor a say over it.

The "daemon" is a plain listener run as uid 65534, which records what it receives; the agent runs as
uid 65533 (no such user needs to exist), both in forked children of this root process.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch  # noqa: F401  (imported here: the agent's child, as another user, cannot read root's Python)

from tests.support import as_user
from torchpulse.probes.agent import control, probe  # noqa: F401  (the same: what the agent imports late)
from torchpulse.probes.agent.agent import Agent
from torchpulse.probes.agent.config import AgentConfig
from torchpulse.probes.agent.identity import current_identity
from torchpulse.probes.agent.sender import Sender
from torchpulse.probes.families import FAMILY_TABLE

LISTENER_UID = 65534  # nobody: the other user
JOB_UID = 65533
REFUSAL = "not connecting: another user listens on the daemon's socket"
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="acting as other users needs root")


@pytest.fixture
def squatted_default() -> Iterator[Path]:
    """The job user's default socket directory without XDG_RUNTIME_DIR, made by the other user after the job
    started (`torchpulse run` had already put its path into TORCHPULSE_SOCKET)."""
    directory = Path(f"/tmp/torchpulse-{JOB_UID}")
    if directory.exists():
        pytest.skip(f"{directory} exists already")
    directory.mkdir(mode=0o755)
    os.chown(directory, LISTENER_UID, LISTENER_UID)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _listen_as(uid: int, path: Path) -> tuple[int, int]:
    """A listener run as `uid` on `path` that writes `connection BYTES` to a pipe for each connection it
    takes: its pid and the pipe's read end, once it listens."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.bind(str(path))
            path.chmod(0o666)
            server.listen(16)
            os.write(write_end, b"listening\n")
            while True:
                connection, _ = server.accept()
                connection.settimeout(0.5)
                try:
                    received = len(connection.recv(65536))
                except OSError:
                    received = 0
                connection.close()
                os.write(write_end, f"connection {received}\n".encode())
        finally:
            os._exit(1)
    os.close(write_end)
    assert os.read(read_end, 64) == b"listening\n"
    return pid, read_end


def _stop_listener(pid: int, read_end: int) -> list[int]:
    """Bytes the listener received on each connection, in order."""
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as pipe:
        return [int(line.split()[1]) for line in pipe.read().decode().splitlines()]


class _Collected(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _agent_as(uid: int, socket_path: Path, seconds: float = 1.5) -> list[str]:
    """An agent with something to send, run as `uid` for `seconds` against `socket_path`, retrying quickly:
    the warnings it logged."""

    def run() -> tuple[int, bytes]:
        warnings = _Collected(logging.WARNING)
        logging.getLogger("torchpulse.agent").addHandler(warnings)
        config = AgentConfig(socket_path=socket_path, probes=(), backoff_initial=0.05, backoff_max=0.1)
        agent = Agent(config, current_identity(), FAMILY_TABLE)
        agent.active = True  # as after its first step: it connects
        sender = Sender(agent)
        sender.start()
        time.sleep(seconds)
        sender.stop(2.0, goodbye=False)
        return 0, "\n".join(warnings.messages).encode()

    code, out = as_user(run, uid)
    assert 0 == code, out
    return out.decode().splitlines()


@pytest.mark.process
@pytest.mark.parametrize("where", ["squatted default directory", "sticky shared directory"])
def test_an_agent_sends_nothing_to_another_users_listener_warns_once_and_retries(
    where: str, shared: Path, request: pytest.FixtureRequest
) -> None:
    """The job's default path in a directory the other user made, and a path the job chose in a /tmp-like
    directory (whose owner is root) where the other user got in first: the listener gets connections (the agent
    retries with backoff) but not one byte, and the job's stderr has one line naming the uid and the socket."""
    if where == "sticky shared directory":
        directory = shared / "sticky"
        directory.mkdir()
        directory.chmod(0o1777)
    else:
        directory = request.getfixturevalue("squatted_default")
    path = directory / "agent.sock"
    listener = _listen_as(LISTENER_UID, path)
    try:
        warnings = _agent_as(JOB_UID, path)
    finally:
        received = _stop_listener(*listener)
    assert (True, {0}) == (len(received) >= 2, set(received)), received
    [warning] = warnings
    assert (True, True, True) == (
        warning.startswith(f"torchpulse: {REFUSAL}"),
        f"socket='{path}'" in warning,
        f"uid={LISTENER_UID}" in warning,
    ), warning


@pytest.mark.process
def test_the_same_user_is_a_daemon_only_where_the_job_chose_their_directory(
    shared: Path, squatted_default: Path
) -> None:
    """A colleague's daemon in the colleague's directory, named by the job (TORCHPULSE_SOCKET): the agent says
    hello. The same user on the job's default path: it does not."""
    chosen = shared / "colleague"
    chosen.mkdir(mode=0o755)
    os.chown(chosen, LISTENER_UID, LISTENER_UID)
    results = []
    for path in (chosen / "agent.sock", squatted_default / "agent.sock"):
        listener = _listen_as(LISTENER_UID, path)
        try:
            warnings = _agent_as(JOB_UID, path, seconds=0.5)
        finally:
            received = _stop_listener(*listener)
        results.append((received[0] > 0, sum(REFUSAL in warning for warning in warnings)))
    assert [(True, 0), (False, 1)] == results
