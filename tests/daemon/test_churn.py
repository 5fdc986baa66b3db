"""A daemon that runs for months: what agents that come and go, or misbehave, leave behind.

Real daemon processes, real sockets; measured from /proc and from /metrics.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import DaemonProcess, reload_config, start_daemon, wait_for
from torchpulse.daemon.client import request_status
from torchpulse.daemon.connections import NODE_LOG_EVENT
from torchpulse.limits import EVENT_LOG_BURST
from torchpulse.protocol import Batch, Goodbye, Hello, LogEvent, Sample, StatusRequest, encode

SUPPRESSED = "agent log events suppressed: this rank sends more than the daemon writes"
# Ended runs are held for an hour while a test looks at them, then for a second (the test reloads the config).
LONG_GRACE = "[runs]\ngrace_period_seconds = 3600\nlost_grace_period_seconds = 3600\n"
SHORT_GRACE = "[runs]\ngrace_period_seconds = 1\nlost_grace_period_seconds = 1\n"


def _connect(path: Path, run: str, rank: int, pid: int) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    sock.sendall(encode(Hello(run, rank, rank, 8, pid, "h", "2.13.0", "0.1.0", "train.py", 1.0)))
    sock.recv(4096)  # Welcome
    return sock


def _session(path: Path, run: str, rank: int, goodbye: bool) -> None:
    """A short-lived rank: hello, one batch, then a goodbye (normal exit) or none (a crash)."""
    with _connect(path, run, rank, 100_000 + rank) as sock:
        sock.sendall(encode(Batch(1, 0.0, [Sample("optimizer_steps_total", ("SGD#0",), 5.0)], [], [])))
        if goodbye:
            sock.sendall(encode(Goodbye("exit")))


def _exposed_samples(daemon: DaemonProcess) -> int:
    """How many samples the daemon's /metrics shows now (its lines that are no comment)."""
    return sum(1 for line in daemon.scrape_text().splitlines() if line and not line.startswith("#"))


@pytest.fixture
def churn_daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    """A daemon reading tmp_path/tp.toml, which holds ended runs for an hour until a test shortens that."""
    config = tmp_path / "tp.toml"
    config.write_text(LONG_GRACE)
    daemon = start_daemon(tmp_path, extra_args=["--config", str(config)])
    yield daemon
    daemon.stop()


@pytest.mark.process
def test_a_thousand_short_runs_leave_no_series_descriptors_or_runs_behind(
    churn_daemon: DaemonProcess, tmp_path: Path
) -> None:
    """1,000 runs of one short rank each (a third crash): after the grace period the exposition, the
    descriptors and `status` are what they were before any of them connected."""
    daemon = churn_daemon
    series, descriptors = _exposed_samples(daemon), daemon.settled_descriptors()
    for n in range(1000):
        _session(daemon.socket_path, f"job-{n}", n % 8, goodbye=n % 3 != 0)
    # With a 1 s grace period from the start, housekeeping (every second) forgot the first runs while the
    # later ones were still being made whenever that took more than a second (a loaded CI machine).
    wait_for(lambda: 1000 == len(request_status(daemon.socket_path).runs), timeout=20)
    assert series + 2000 < _exposed_samples(daemon)
    reload_config(daemon, tmp_path / "tp.toml", SHORT_GRACE)  # applied to the runs already held
    wait_for(lambda: not request_status(daemon.socket_path).runs, timeout=20)
    assert series == _exposed_samples(daemon)
    # A descriptor may be open for a moment (a scrape's, the state store's): wait for it to settle.
    wait_for(lambda: daemon.descriptors() <= descriptors, timeout=10)


@pytest.mark.process
def test_a_client_that_stops_reading_a_large_status_reply_is_cut_off(tmp_path: Path) -> None:
    """Status clients that never read a reply of 4,800 ranks are disconnected after the write timeout:
    they do not keep a descriptor, a connection slot and the reply's buffer for ever."""
    daemon = start_daemon(tmp_path)
    try:
        for n in range(600):  # crashed ranks are held for the grace period, so `status` lists them all
            for rank in range(8):
                _session(daemon.socket_path, f"a-run-with-a-realistic-name-{n:04d}", rank, goodbye=False)
        wait_for(lambda: 600 == len(request_status(daemon.socket_path).runs), timeout=20)
        baseline = daemon.settled_descriptors()  # not the connection of the request_status just answered
        stalled = []
        for _ in range(5):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(daemon.socket_path))
            sock.sendall(encode(StatusRequest()))
            stalled.append(sock)
        # Each reply takes the loop a moment to build: wait for all five (well inside AGENT_SOCKET_WRITE_TIMEOUT).
        wait_for(lambda: baseline + 5 <= daemon.descriptors(), timeout=5)
        # AGENT_SOCKET_WRITE_TIMEOUT (10 s) and some slack for a loaded machine.
        wait_for(lambda: daemon.descriptors() <= baseline, timeout=20)
        assert 600 == len(request_status(daemon.socket_path).runs)
        for sock in stalled:
            sock.close()
    finally:
        daemon.stop()


@pytest.mark.process
def test_an_agent_flooding_log_events_gets_a_burst_then_a_rate_and_one_line_saying_how_many(tmp_path: Path) -> None:
    """16,000 events from one rank: the burst is written, the rest is counted in `suppressed` lines
    (written + suppressed = sent), and another rank's events are still written."""
    daemon = start_daemon(tmp_path)
    try:
        sent = EVENT_LOG_BURST + 6000
        with _connect(daemon.socket_path, "flood", 0, 1) as flood:
            for seq in range(sent // 2000):
                events = [LogEvent(0.0, "warning", "autograd.nonfinite_gradients", {"n": n}) for n in range(2000)]
                flood.sendall(encode(Batch(seq, 0.0, [], [], events)))
            with _connect(daemon.socket_path, "quiet", 0, 2) as quiet:
                quiet.sendall(encode(Batch(1, 0.0, [], [], [LogEvent(0.0, "info", "recompile", {})])))
                wait_for(lambda: any(e.get("event") == "recompile" for e in daemon.log_lines()), timeout=20)
        wait_for(
            lambda: any(e.get("event") == "agent disconnected" and e.get("run") == "flood" for e in daemon.log_lines()),
            timeout=20,
        )
        lines = daemon.log_lines()
        written = sum(1 for e in lines if e.get("event") == "autograd.nonfinite_gradients")
        suppressed = [e["suppressed"] for e in lines if e.get("event") == SUPPRESSED and e.get("run") == "flood"]
        assert sent == written + sum(int(str(n)) for n in suppressed)
        assert EVENT_LOG_BURST <= written < EVENT_LOG_BURST + 1000
        assert 1 <= len(suppressed) <= 2  # the first suppression, then the rest when the rank left
    finally:
        daemon.stop()


@pytest.mark.process
def test_a_requested_autograd_log_of_a_large_model_is_written_whole_and_spares_the_other_budget(tmp_path: Path) -> None:
    """`ctl autograd-log` of a large model: 30,000 `autograd.node` events (three times the general
    burst) all reach the log, and the rank's other events are still written after them."""
    daemon = start_daemon(tmp_path)
    try:
        nodes = 3 * EVENT_LOG_BURST
        with _connect(daemon.socket_path, "big", 0, 1) as agent:
            for seq in range(nodes // 2000):
                events = [LogEvent(0.0, "info", NODE_LOG_EVENT, {"seq": n}) for n in range(2000)]
                agent.sendall(encode(Batch(seq, 0.0, [], [], events)))
            agent.sendall(
                encode(Batch(nodes, 0.0, [], [], [LogEvent(0.0, "warning", "after", {"n": n}) for n in range(100)]))
            )
            wait_for(lambda: sum(1 for e in daemon.log_lines() if e.get("event") == "after") == 100, timeout=30)
        lines = daemon.log_lines()
        assert nodes == sum(1 for e in lines if e.get("event") == NODE_LOG_EVENT)
        assert not [e for e in lines if e.get("event") == SUPPRESSED]
    finally:
        daemon.stop()
