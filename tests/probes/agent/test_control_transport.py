"""Commands on the agent's side of the socket: what a buggy answer or a flooding peer costs."""

from __future__ import annotations

import contextlib
import dataclasses
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from tests.support import local_agent
from torchpulse.framing import FrameReader
from torchpulse.probes.agent.agent import Agent
from torchpulse.probes.agent.sender import Sender
from torchpulse.protocol import Command, CommandResult, Goodbye, decode_agent_frame, encode


@pytest.fixture
def wired() -> Iterator[tuple[Agent, Sender, socket.socket]]:
    """An agent whose (unstarted) sender owns one end of a socket pair; the test is the daemon."""
    agent = local_agent(("optimizer",))
    assert isinstance(agent, Agent)
    sender = Sender(agent)
    ours, theirs = socket.socketpair()
    ours.settimeout(5)
    theirs.settimeout(5)
    sender.link.sock = ours
    try:
        yield agent, sender, theirs
    finally:
        sender.link.close()
        theirs.close()
        agent.shutdown()


def _answers(sock: socket.socket, count: int) -> list[CommandResult]:
    reader, answers = FrameReader(), []
    while len(answers) < count:
        for body in reader.feed(sock.recv(65536)):
            frame = decode_agent_frame(body)
            assert isinstance(frame, CommandResult)
            answers.append(frame)
    return answers


def test_an_answer_that_cannot_be_encoded_is_still_answered_on_the_same_connection(
    wired: tuple[Agent, Sender, socket.socket],
) -> None:
    """A result carrying an int past msgpack's range becomes a failed answer; the connection stays."""
    agent, sender, daemon = wired
    agent.control.results.append(CommandResult(5, True, "ok", {"sample_every": 10**20}))
    assert sender._read_incoming()
    [answer] = _answers(daemon, 1)
    assert (5, False) == (answer.id, answer.ok)
    assert answer.message.startswith("internal error: answer not encodable")
    assert sender.link.sock is not None


FLOOD = """
import socket, sys
sock = socket.socket(fileno=int(sys.argv[1]))
frame = sys.stdin.buffer.read()
try:
    while True:
        sock.sendall(frame)
except OSError:
    pass
"""


@pytest.mark.process
def test_a_peer_streaming_commands_cannot_keep_the_sender_thread_reading(
    wired: tuple[Agent, Sender, socket.socket],
) -> None:
    """Another process streams status commands without pause: one read pass still ends, and the
    answers went out as it read instead of piling up in the job's memory."""
    agent, sender, daemon = wired
    daemon.settimeout(None)
    stop = threading.Event()
    flood = subprocess.Popen(
        [sys.executable, "-c", FLOOD, str(daemon.fileno())], stdin=subprocess.PIPE, pass_fds=[daemon.fileno()]
    )
    assert flood.stdin is not None
    flood.stdin.write(b"".join(encode(Command(n, "status", {})) for n in range(2000)))
    flood.stdin.close()

    def drain() -> None:
        while not stop.is_set():
            if select.select([daemon], [], [], 0.1)[0]:
                with contextlib.suppress(OSError):
                    daemon.recv(65536)

    draining = threading.Thread(target=drain, daemon=True)
    draining.start()
    assert sender.link.sock is not None
    select.select([sender.link.sock], [], [], 10)
    time.sleep(0.2)  # the socket buffer is full before the sender reads
    done = threading.Event()
    reading = threading.Thread(target=lambda: (sender._read_incoming(), done.set()), daemon=True)
    reading.start()
    try:
        assert done.wait(20), f"the sender thread is still reading ({len(agent.control.results)} answers held)"
        assert 0 == len(agent.control.results), "every answer went out"
    finally:
        stop.set()
        sender.link.close()  # the flood's next send fails and it exits
        flood.wait(30)
        for thread in (draining, reading):
            thread.join(10)


@pytest.mark.parametrize(("was", "goodbye"), [((1, 2), False), ((0, 2), True)])
def test_a_reconnect_for_a_new_world_size_keeps_the_rank_and_one_for_a_new_rank_gives_it_up(
    wired: tuple[Agent, Sender, socket.socket], monkeypatch: pytest.MonkeyPatch, was: tuple[int, int], goodbye: bool
) -> None:
    """Reconnecting as what torch.distributed names: a goodbye only when the rank changed. For the world size
    alone it would give the rank up for a moment, to any other process claiming it."""
    agent, sender, daemon_end = wired
    monkeypatch.setattr(agent, "identity", dataclasses.replace(agent.identity, env_rank=1, env_world_size=4))
    monkeypatch.setattr(sender.link, "connect", lambda: None)
    sender.link.hello_identity = was
    sender.link.rehello()
    received = b""
    while chunk := daemon_end.recv(65536):  # until the sender closed its end to reconnect
        received += chunk
    frames = [decode_agent_frame(body) for body in FrameReader().feed(received)]
    assert ([Goodbye("identity")] if goodbye else []) == frames
