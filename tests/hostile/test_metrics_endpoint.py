"""The /metrics endpoint under attack: slowloris, a connection flood, stalled readers, oversized requests.

Real daemon processes and real loopback sockets; every attack loop is
bounded. Throughout, an agent's batches must still be applied and a scrape
must still answer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import socket
import time
import urllib.request

import pytest

from tests.hostile.agents import RawAgent
from tests.support import DaemonProcess, select, wait_for
from torchpulse.exporters import http
from torchpulse.exporters.http import MetricsServer
from torchpulse.limits import HTTP_HEADER_TIMEOUT, HTTP_MAX_CONNECTIONS, HTTP_MAX_HEADER_BYTES


def _steps(daemon: DaemonProcess, run: str) -> float | None:
    values = select(daemon.scrape(), "torchpulse_optimizer_steps_total", run=run)
    return next(iter(values.values()), None)


def _open(daemon: DaemonProcess, first: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
    if first:
        sock.sendall(first)
    return sock


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return True


def test_slowloris_is_cut_off_while_agents_and_scrapes_continue(daemon: DaemonProcess) -> None:
    """Forty clients trickling header bytes are dropped after the header timeout; meanwhile nothing else waits."""
    agent = RawAgent(daemon.socket_path, "under-slowloris")
    loris = [_open(daemon, b"GET /metrics HTTP/1.1\r\nX-Slow: ") for _ in range(40)]
    seen, latencies = [], []
    started = time.monotonic()
    step = 0
    while time.monotonic() - started < HTTP_HEADER_TIMEOUT - 1:  # bounded: ends before the server's cut-off
        step += 1
        agent.steps(step)
        for sock in loris:
            with contextlib.suppress(OSError):
                sock.send(b"a")
        t0 = time.perf_counter()
        wait_for(lambda: _steps(daemon, "under-slowloris") == step, timeout=5)  # noqa: B023
        latencies.append(time.perf_counter() - t0)
        seen.append(step)
        time.sleep(0.3)
    closed = [_closed_by_server(sock, within=HTTP_HEADER_TIMEOUT + 3) for sock in loris]
    for sock in loris:
        sock.close()
    agent.close()
    assert (True, [True] * 40) == (len(seen) >= 5, closed)
    assert max(latencies) < 2.0, latencies


def test_connection_flood_beyond_the_limit_still_lets_prometheus_in(daemon: DaemonProcess) -> None:
    """With 300 silent connections held open, a scrape is answered 200 (the oldest idle one is evicted)."""
    agent = RawAgent(daemon.socket_path, "under-flood")
    flood = [_open(daemon) for _ in range(HTTP_MAX_CONNECTIONS + 44)]
    try:
        agent.steps(7)
        statuses = []
        for _ in range(5):
            with urllib.request.urlopen(daemon.metrics_url, timeout=10) as response:
                statuses.append(response.status)
        assert ([200] * 5, 7.0) == (statuses, _steps(daemon, "under-flood"))
    finally:
        for sock in flood:
            sock.close()
        agent.close()


def test_many_concurrent_scrapes_all_answer_and_ingest_continues(daemon: DaemonProcess) -> None:
    """Sixty-four scrapers at once, four scrapes each, while an agent keeps sending: all 200, no batch lost."""
    agent = RawAgent(daemon.socket_path, "under-scrapes")

    def scrape(_: int) -> int:
        codes = 0
        for _ in range(4):
            with urllib.request.urlopen(daemon.metrics_url, timeout=20) as response:
                response.read()
                codes += response.status == 200
        return codes

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        futures = [pool.submit(scrape, i) for i in range(64)]
        for step in range(1, 21):
            agent.steps(step)
            time.sleep(0.02)
        answered = sum(f.result() for f in futures)
    wait_for(lambda: _steps(daemon, "under-scrapes") == 20.0, timeout=10)
    agent.close()
    assert 64 * 4 == answered


# Each bad request, and the status it is answered with before its connection is closed.
BAD_REQUESTS = {
    "header_over_8k": (b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * (2 * HTTP_MAX_HEADER_BYTES) + b"\r\n\r\n", 431),
    "headers_over_8k_in_all": (b"GET /metrics HTTP/1.1\r\n" + b"X-Many: 12345678\r\n" * 1000 + b"\r\n", 431),
    "target_over_8k": (b"GET /" + b"a" * (2 * HTTP_MAX_HEADER_BYTES) + b" HTTP/1.1\r\n\r\n", 414),
    "megabyte_without_crlf": (b"G" * (1 << 20), 400),
    "request_with_a_body": (b"POST /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", 413),
    "chunked_body": (b"GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 413),
    "malformed_request_line": (b"GET\r\n\r\n", 400),
    # No blank line after it: answered at once, not after the header timeout.
    "missing_http_version": (b"GET /metrics\r\n", 400),
    "http_2_preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),
    "header_without_colon": (b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n", 400),
    "content_length_not_a_number": (b"GET /metrics HTTP/1.1\r\nContent-Length: \xb2\r\n\r\n", 400),
    "binary_garbage": (bytes(range(256)) * 64 + b"\r\n\r\n", 400),
}


def _answer(sock: socket.socket, within: float) -> tuple[bytes, bool]:
    """What the server sent, and whether it closed the connection within `within` seconds."""
    sock.settimeout(within)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except (ConnectionResetError, BrokenPipeError):
        return b"".join(chunks), True
    except TimeoutError:
        return b"".join(chunks), False
    return b"".join(chunks), True


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_oversized_and_malformed_requests_are_answered_then_closed(daemon: DaemonProcess, name: str) -> None:
    """Each bad request gets its 4xx/5xx answer and the end of its connection; the daemon keeps serving."""
    request, status = BAD_REQUESTS[name]
    agent = RawAgent(daemon.socket_path, "under-bad-requests")
    sock = _open(daemon)
    with contextlib.suppress(ConnectionResetError, BrokenPipeError):  # before the fix: cut off while sending
        sock.sendall(request)
    answer, closed = _answer(sock, within=HTTP_HEADER_TIMEOUT + 2)
    sock.close()
    agent.steps(3)
    wait_for(lambda: _steps(daemon, "under-bad-requests") == 3.0, timeout=5)
    agent.close()
    assert (f"HTTP/1.1 {status} ", True, None) == (answer[:13].decode("latin-1"), closed, daemon.proc.poll())
    assert b"\r\nConnection: close\r\n" in answer


def test_pipelined_requests_are_answered_in_order(daemon: DaemonProcess) -> None:
    """Two hundred pipelined /healthz requests on one connection get two hundred answers."""
    sock = _open(daemon, b"GET /healthz HTTP/1.1\r\n\r\n" * 199 + b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
    chunks = []
    sock.settimeout(10)
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    sock.close()
    assert 200 == b"".join(chunks).count(b"HTTP/1.1 200 OK")


class _BigExposition:
    """Eight megabytes per scrape: more than loopback socket buffers hold."""

    def render(self) -> bytes:
        return b"# x\n" * (2 << 20)


def test_a_client_that_stops_reading_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that pipelines scrapes but never reads is aborted after the write timeout, freeing its slot."""
    monkeypatch.setattr(http, "HTTP_WRITE_TIMEOUT", 0.5)

    async def scenario() -> tuple[int, int, bool, int]:
        server = MetricsServer(_BigExposition())  # type: ignore[arg-type]
        await server.start("127.0.0.1", 0)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(b"GET /metrics HTTP/1.1\r\n\r\n" * 4)
        loop = asyncio.get_running_loop()
        # Counted once its task starts, a few loop passes after the accept: after a stall of the loop (a loaded
        # machine) a sleep's timer can end first. Checked every pass instead; the connection then stays
        # counted for HTTP_WRITE_TIMEOUT, stuck writing the first 8 MB response, so no pass-by-pass check misses it.
        deadline = loop.time() + 5
        while server._open != 1 and loop.time() < deadline:
            await asyncio.sleep(0)
        during = server._open
        deadline = loop.time() + 5
        while server._open and loop.time() < deadline:
            await asyncio.sleep(0.05)
        after = server._open
        received, ended = 0, False
        sock.settimeout(5)
        try:
            while chunk := sock.recv(1 << 20):
                received += len(chunk)
            ended = True
        except ConnectionResetError:
            ended = True
        except TimeoutError:
            pass
        sock.close()
        await server.close()
        return during, after, ended, received

    during, after, ended, received = asyncio.run(scenario())
    assert (1, 0, True, True) == (during, after, ended, received < 4 * len(_BigExposition().render()))
