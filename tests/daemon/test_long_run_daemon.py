"""A daemon that runs for months, seen from its clients: what scrapers (slow, stalled, many) cost it.

Real daemon processes, real sockets; measured from /proc, /metrics and `status`. The daemon holds
many ended runs here (crashed ranks stay for `runs.lost_grace_period_seconds`), so its exposition is
megabytes, as it is on a busy node.
"""

from __future__ import annotations

import random
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.load import SimAgent
from tests.support import DaemonProcess, start_daemon, wait_for
from torchpulse.daemon.client import request_status
from torchpulse.protocol import encode

RUNS = 150  # four crashed ranks each: about 10 MB of exposition


def _crashed_rank(path: Path, run: str, rank: int) -> None:
    """A rank with the series a real job sends (histograms, autograd nodes), gone without a goodbye."""
    agent = SimAgent(run, rank, random.Random(rank))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(encode(agent.hello()))
        sock.recv(4096)  # Welcome
        for _ in range(3):
            sock.sendall(encode(agent.step_interval(50, time.time())))


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    daemon = start_daemon(tmp_path_factory.mktemp("busy"))
    try:
        for n in range(RUNS):
            for rank in range(4):
                _crashed_rank(daemon.socket_path, f"ci-job-{n:05d}", rank)
        wait_for(lambda: RUNS == len(request_status(daemon.socket_path).runs), timeout=20)
        yield daemon
    finally:
        daemon.stop()


def _status_seconds(daemon: DaemonProcess) -> float:
    start = time.perf_counter()
    request_status(daemon.socket_path, timeout=60)
    return time.perf_counter() - start


def test_scrapers_that_never_read_hold_a_bounded_amount_of_memory_and_do_not_stall_the_loop(
    busy: DaemonProcess,
) -> None:
    """100 connections ask for /metrics (10 MB) and never read the answer. Each once held its own copy
    until the write timeout (100 x 10 MB: gigabytes) and each cost a render on the loop (`status` waited
    half a minute). Now the unsent bytes of all connections have a budget (the connection stuck the
    longest is cut off past it) and the scrapes queued behind a render get that render."""
    exposition = len(busy.scrape_text())
    assert exposition > 5_000_000
    before, descriptors = busy.rss_mib(), busy.descriptors()
    stalled = []
    for _ in range(100):
        sock = socket.create_connection(("127.0.0.1", busy.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        stalled.append(sock)
    try:
        worst_status, peak = 0.0, before
        for _ in range(8):
            time.sleep(0.25)
            worst_status = max(worst_status, _status_seconds(busy))
            peak = max(peak, busy.rss_mib())
        # A normal scrape is still served in full meanwhile (the scrape's own timings differ in length).
        text = busy.scrape_text()
        assert (True, True) == (abs(len(text) - exposition) < 1000, text.endswith('{collector="checkpoints"} 1.0\n'))
    finally:
        for sock in stalled:
            sock.close()
    wait_for(lambda: busy.descriptors() <= descriptors, timeout=10)
    # The budget (128 MiB), a few renders, and slack for the allocator.
    assert (peak - before < 400, worst_status < 5.0) == (True, True), (peak - before, worst_status)


def _render_mark(body: bytes) -> bytes:
    """The line that differs between two renders: how long the agent series took."""
    return next(
        line
        for line in body.splitlines()
        if line.startswith(b'torchpulse_scrape_collector_duration_seconds{collector="agent_series"}')
    )


def test_scrapes_that_arrive_together_share_one_render(busy: DaemonProcess) -> None:
    """Twenty scrapes sent at once (Prometheus pairs, a crowd of dashboards) queue behind the first
    render; each rendered the exposition again, so the loop was busy for all of them in turn. They now
    get the render that just finished: a handful of renders, each body whole."""
    bodies: list[bytes] = []
    barrier = threading.Barrier(20)

    def scrape() -> None:
        barrier.wait()
        with urllib.request.urlopen(busy.metrics_url, timeout=60) as response:
            bodies.append(response.read())

    threads = [threading.Thread(target=scrape) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    renders = {_render_mark(body) for body in bodies}
    assert (20, True) == (len(bodies), len(renders) <= 10), len(renders)
    assert all(body.endswith(b"\n") and b"torchpulse_agent_up" in body for body in bodies)
