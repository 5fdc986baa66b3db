"""A real daemon keeps serving through garbage, truncated and oversized frames and churn."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

import msgspec
import pytest

from tests.support import DaemonProcess, rejected_frames, select, send_raw, start_daemon, wait_for
from torchpulse.daemon.client import request_status
from torchpulse.protocol import HEADER, MAGIC, PROTOCOL_VERSION, Batch, CtlRequest, Hello, Sample, encode

HELLO = Hello("hostile", 0, 0, 1, os.getpid(), "h", "2.13.0", "0.1.0", "test", 0.0)


def _send(daemon: DaemonProcess, data: bytes, close_write: bool = True) -> bytes:
    return send_raw(daemon.socket_path, data, close_write)


def test_bad_frames_are_rejected_counted_and_answered(daemon: DaemonProcess) -> None:
    """Random bytes, a truncated frame, an oversized prefix and an unknown type are each counted."""
    _send(daemon, os.urandom(64).replace(b"TP", b"XX"))
    _send(daemon, encode(HELLO)[:-3])
    reply = _send(daemon, HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, 1 << 30), close_write=False)
    unknown = msgspec.msgpack.encode({"type": "from_the_future"})
    _send(daemon, HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, len(unknown)) + unknown, close_write=False)
    assert b"oversized" in reply
    wait_for(lambda: 4 == sum(rejected_frames(daemon).values()))
    assert {"bad_magic": 1, "truncated": 1, "oversized": 1, "unknown_type": 1} == rejected_frames(daemon)


def test_version_mismatch_gets_an_error_reply_not_a_crash(daemon: DaemonProcess) -> None:
    """An agent of another protocol version is told so in plain words."""
    body = encode(HELLO)[HEADER.size :]
    reply = _send(daemon, HEADER.pack(MAGIC, PROTOCOL_VERSION + 1, 0, len(body)) + body, close_write=False)
    assert b"version_mismatch" in reply and b"upgrade the agent and the daemon together" in reply


def test_batches_of_unknown_families_are_refused_but_the_rank_stays(daemon: DaemonProcess) -> None:
    """A series of an unknown family is counted and skipped; the valid series next to it is kept."""
    batch = Batch(1, 0.0, [Sample("made_up_total", (), 1.0), Sample("optimizer_steps_total", ("SGD#0",), 4.0)], [], [])
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(daemon.socket_path))
        sock.sendall(encode(HELLO) + encode(batch))
        wait_for(lambda: bool(select(daemon.scrape(), "torchpulse_optimizer_steps_total", run="hostile")))
        samples = daemon.scrape()
    rejected = select(samples, "torchpulse_daemon_series_rejected_total")
    assert {"unknown_family": 1.0} == {dict(k)["reason"]: v for k, v in rejected.items() if v}


def test_two_hundred_connections_opened_and_dropped(daemon: DaemonProcess) -> None:
    """Connection churn leaves the daemon answering status and scrapes, with no connection left open."""
    for i in range(200):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(daemon.socket_path))
        if i % 2:
            sock.sendall(struct.pack(">I", 5))
        sock.close()
    wait_for(lambda: 0.0 == select(daemon.scrape(), "torchpulse_daemon_connections")[()])
    assert daemon.proc.poll() is None
    assert [] == request_status(daemon.socket_path).runs


def test_hello_fields_longer_than_their_limit_are_refused(daemon: DaemonProcess) -> None:
    """A run name, version or command line past its length limit is refused before it becomes a label."""
    long_command = Hello("r", 0, 0, 1, os.getpid(), "h", "2.13.0", "0.1.0", "x" * 513, 0.0)
    long_version = Hello("r", 0, 0, 1, os.getpid(), "h", "v" * 201, "0.1.0", "x", 0.0)
    command_reply = _send(daemon, encode(long_command), close_write=False)
    version_reply = _send(daemon, encode(long_version), close_write=False)
    assert b"hello: command is longer than 512 characters" in command_reply
    assert b"hello: torch_version is longer than 200 characters" in version_reply
    assert [] == request_status(daemon.socket_path).runs


@pytest.mark.process
def test_runs_and_ranks_past_their_caps_are_refused_and_ended_ones_make_room(tmp_path: Path) -> None:
    """A client inventing run names or rank numbers cannot make the daemon hold more than the caps."""
    config = tmp_path / "torchpulse.toml"
    config.write_text("[runs]\nmax_runs = 2\nmax_ranks_per_run = 2\n")
    daemon = start_daemon(tmp_path, extra_args=["--config", str(config)])

    def hello(run: str, rank: int) -> Hello:
        return Hello(run, rank, 0, 4, os.getpid(), "h", "2.13.0", "0.1.0", "test", 0.0)

    def connect(run: str, rank: int) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(daemon.socket_path))
        sock.sendall(encode(hello(run, rank)))
        return sock

    try:
        a0, a1, b0 = connect("a", 0), connect("a", 1), connect("b", 0)
        wait_for(lambda: 3.0 == select(daemon.scrape(), "torchpulse_daemon_connections")[()])
        assert b"too_many_runs" in _send(daemon, encode(hello("c", 0)), close_write=False)
        assert b"too_many_ranks" in _send(daemon, encode(hello("a", 2)), close_write=False)
        # Counted before the refusals were sent, but a scrape may be served the render of the wait above:
        # the exporter reuses a render younger than the time it took.
        wait_for(lambda: 2 <= sum(rejected_frames(daemon).values()))
        assert {"too_many_runs": 1, "too_many_ranks": 1} == rejected_frames(daemon)
        a1.close()  # a disconnected rank makes room for a new rank of its run
        wait_for(lambda: 2.0 == select(daemon.scrape(), "torchpulse_daemon_connections")[()])
        a2 = connect("a", 2)
        b0.close()  # an ended run (in its grace period) makes room for a new run
        wait_for(lambda: 2.0 == select(daemon.scrape(), "torchpulse_daemon_connections")[()])
        c0 = connect("c", 0)
        wait_for(lambda: 3.0 == select(daemon.scrape(), "torchpulse_daemon_connections")[()])
        runs = {(r.run, tuple(sorted(k.rank for k in r.ranks))) for r in request_status(daemon.socket_path).runs}
        assert {("a", (0, 2)), ("c", (0,))} == runs, runs
        assert daemon.proc.poll() is None
        for sock in (a0, a2, c0):
            sock.close()
    finally:
        daemon.stop()


def test_bytes_after_a_ctl_request_get_an_error_reply_not_silence(daemon: DaemonProcess) -> None:
    """A ctl client sends one request, then only waits; one that sends more while its command waits for a rank
    is still there to read why it gets no answer (it used to be taken for a hang-up: no reply, an info line)."""
    request = CtlRequest(HELLO.run, None, "enable", {"probe": "autograd"}, 30.0)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as agent:
        agent.connect(str(daemon.socket_path))
        agent.sendall(encode(HELLO))  # a rank that never answers: the command waits for it
        wait_for(lambda: [HELLO.run] == [run.run for run in request_status(daemon.socket_path).runs])
        raw = _send(daemon, encode(request) + b"?", close_write=False)
    assert raw, "no reply: the client was taken for one that hung up"
    reply = msgspec.msgpack.decode(raw[HEADER.size :])
    assert ("unexpected_type", True) == (
        reply["code"],
        "'enable' command for run 'hostile' was dropped" in reply["message"],
    )
    # Counted before the reply was sent, but a scrape may be served an earlier render (the exporter reuses one
    # younger than the time it took): the one of the daemon's readiness check.
    wait_for(lambda: "unexpected_type" in rejected_frames(daemon))
    assert {"unexpected_type": 1} == rejected_frames(daemon)
    assert [] == [e for e in daemon.log_lines() if str(e.get("event", "")).startswith("command abandoned")]
