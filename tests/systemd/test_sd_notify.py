"""sd_notify and the watchdog, against real AF_UNIX datagram sockets."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from torchpulse.daemon import systemd


@pytest.fixture
def path_listener(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A datagram socket bound to a filesystem path, published as $NOTIFY_SOCKET."""
    address = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(address))
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", str(address))
        yield sock


@pytest.fixture
def abstract_listener(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A datagram socket in the abstract namespace, published with systemd's '@' spelling."""
    name = f"torchpulse-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        yield sock


def test_notify_sends_one_datagram_to_a_path_socket(path_listener: socket.socket) -> None:
    """READY=1 and STATUS= arrive as one datagram, exactly as sent."""
    sent = systemd.notify("READY=1\nSTATUS=2 runs")

    assert sent is True
    assert path_listener.recv(4096) == b"READY=1\nSTATUS=2 runs"


def test_notify_reaches_an_abstract_socket(abstract_listener: socket.socket) -> None:
    """A leading '@' in $NOTIFY_SOCKET addresses the abstract namespace."""
    assert systemd.notify("STOPPING=1") is True
    assert abstract_listener.recv(4096) == b"STOPPING=1"


def test_notify_is_a_no_op_outside_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without $NOTIFY_SOCKET nothing is sent and False is returned."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert systemd.notify("READY=1") is False


@pytest.mark.parametrize("value", ["", "relative/path", "vsock:2:1234"])
def test_notify_ignores_addresses_it_cannot_use(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """Empty, relative and non-Unix addresses are refused, not guessed at."""
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert systemd.notify("READY=1") is False


def test_notify_reports_a_vanished_socket_as_false(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A send error (nobody listening) returns False instead of raising into the daemon."""
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert systemd.notify("READY=1") is False


def test_notify_does_not_block_on_a_full_queue(path_listener: socket.socket) -> None:
    """When the receiver stops reading, sends fail fast instead of stalling the event loop."""
    started = time.monotonic()
    results = [systemd.notify("WATCHDOG=1") for _ in range(5000)]

    assert time.monotonic() - started < 5
    assert results[0] is True
    assert results[-1] is False


def test_status_message_is_one_line() -> None:
    """STATUS= must be a single line: a newline would start another assignment."""
    message = systemd.status_message(runs=2, ranks=16, checkpoint_roots=3, checkpoints_not_valid=1)

    assert message == "STATUS=2 runs, 16 ranks connected; 3 checkpoint roots, 1 not valid"


def test_reloading_message_carries_the_monotonic_clock() -> None:
    """RELOADING=1 comes with MONOTONIC_USEC= from CLOCK_MONOTONIC, as systemd >= 253 wants."""
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    reloading, monotonic = systemd.reloading_message().split("\n")
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000

    assert reloading == "RELOADING=1"
    key, value = monotonic.split("=")
    assert key == "MONOTONIC_USEC"
    assert before <= int(value) <= after


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("30000000", None, 15.0),
        ("30000000", "self", 15.0),
        ("30000000", "other", None),
        ("0", "self", None),
        ("garbage", "self", None),
        (None, None, None),
        ("30000000", "garbage", None),
    ],
)
def test_watchdog_interval_is_half_the_timeout_for_this_process(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None, expected: float | None
) -> None:
    """WATCHDOG_USEC is honoured only for WATCHDOG_PID (when set) and halved."""
    pid_values = {"self": str(os.getpid()), "other": str(os.getpid() + 1), "garbage": "x"}
    for key, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid_values.get(pid or "", pid))):
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)

    assert expected == systemd.watchdog_interval()


def _drain(sock: socket.socket) -> list[bytes]:
    sock.setblocking(False)
    received = []
    while True:
        try:
            received.append(sock.recv(4096))
        except BlockingIOError:
            return received


def test_watchdog_pinger_sends_from_the_event_loop(path_listener: socket.socket) -> None:
    """WATCHDOG=1 is sent every interval while the loop turns, even while a worker is busy."""

    async def scenario() -> None:
        pinger = asyncio.create_task(systemd.watchdog_pinger(0.04))
        # Work off the loop (the validation worker's stand-in) must not hold the pings back.
        await asyncio.to_thread(time.sleep, 0.25)
        pinger.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pinger

    asyncio.run(scenario())

    pings = _drain(path_listener)
    assert {b"WATCHDOG=1"} == set(pings)
    assert len(pings) >= 5


def test_watchdog_pinger_stops_while_the_loop_is_blocked(path_listener: socket.socket) -> None:
    """A synchronous call that blocks the loop also blocks the pings, so systemd notices."""

    async def scenario() -> None:
        pinger = asyncio.create_task(systemd.watchdog_pinger(0.02))
        await asyncio.sleep(0)  # first ping
        _drain(path_listener)
        time.sleep(0.3)  # a hung loop
        blocked = _drain(path_listener)
        pinger.cancel()
        assert blocked == []

    asyncio.run(scenario())


def test_watchdog_pinger_refuses_a_non_positive_interval() -> None:
    """A zero interval would spin the loop; it is rejected up front."""
    with pytest.raises(ValueError, match="positive"):
        asyncio.run(systemd.watchdog_pinger(0))
