"""`torchpulse status` and `ctl` against a socket that does not answer like this daemon: one line, status 1."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import REPO
from torchpulse.protocol import HEADER, MAGIC, PROTOCOL_VERSION


def _answer(data: bytes) -> Callable[[socket.socket], None]:
    def answer(conn: socket.socket) -> None:
        conn.recv(65536)
        conn.sendall(data)

    return answer


ANSWERS: dict[str, Callable[[socket.socket], None]] = {
    "another service": _answer(b"HTTP/1.1 400 Bad Request\r\n\r\n"),
    "newer protocol": _answer(HEADER.pack(MAGIC, PROTOCOL_VERSION + 1, 0, 1) + b"\xc0"),
    "undecodable body": _answer(HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, 2) + b"\xc1\xc1"),
    # A daemon killed with the request unread: the client's recv (or send) fails with a reset.
    "connection reset": lambda conn: None,
}


@contextlib.contextmanager
def _peer(path: Path, answer: Callable[[socket.socket], None]) -> Iterator[None]:
    """A real Unix socket server that handles one connection with `answer`, then closes it."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)
    server.settimeout(60)

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                answer(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.close()
        thread.join(10)


@pytest.mark.process
@pytest.mark.parametrize("command", [["status"], ["ctl", "status", "--run", "r", "--timeout", "5"]])
@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_a_peer_that_is_not_this_daemon_is_reported_in_one_line(tmp_path: Path, name: str, command: list[str]) -> None:
    """No traceback for garbage, another protocol version or a reset: one line, status 1."""
    path = tmp_path / "peer.sock"
    with _peer(path, ANSWERS[name]):
        result = subprocess.run(
            [sys.executable, "-m", "torchpulse", *command, "--socket", str(path)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert (1, "", 1) == (result.returncode, result.stdout, len(result.stderr.splitlines())), result.stderr
    assert result.stderr.startswith("torchpulse: ")
