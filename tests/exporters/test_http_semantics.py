"""HTTP semantics of the /metrics server that scrapers and health checks rely on, against a real daemon.

Each test reads until the server closes the connection: a server that keeps a
connection open it should close shows up as the socket timeout (30 s, half the
server's 60 s idle timeout), not as a wrong answer.
"""

from __future__ import annotations

import gzip
import socket
from pathlib import Path

import pytest

from tests.support import DaemonProcess, parse_exposition, select, start_daemon

READ_TIMEOUT = 30.0


def _exchange(daemon: DaemonProcess, request: bytes) -> bytes:
    """Send raw request bytes and return everything the server sends until it closes."""
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=READ_TIMEOUT) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _split(raw: bytes) -> tuple[dict[str, str], bytes]:
    """Headers (lowercased names) and body of one response that ends at the connection's end."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    return {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}, body


@pytest.mark.parametrize("path", ["/", "/healthz", "/metrics", "/no-such-page"])
def test_head_answers_carry_no_body_on_any_path(daemon: DaemonProcess, path: str) -> None:
    """HEAD then GET on one connection: the HEAD answer is headers only, so the next answer starts right after."""
    raw = _exchange(daemon, f"HEAD {path} HTTP/1.1\r\n\r\nGET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n".encode())
    _, after_head = raw.split(b"\r\n\r\n", 1)
    assert (2, True) == (raw.count(b"HTTP/1.1 "), after_head.startswith(b"HTTP/1.1 200 OK\r\n")), raw[:400]
    assert after_head.endswith(b"\r\n\r\nok\n")


def test_lines_ended_by_a_bare_lf_are_understood(daemon: DaemonProcess) -> None:
    """RFC 9112 2.2: a server may take a lone LF as a line's end; `printf ... | nc` users write them."""
    headers, body = _split(_exchange(daemon, b"\r\nGET /healthz HTTP/1.1\nConnection: close\n\n"))
    assert ("close", b"ok\n") == (headers["connection"], body)


def test_http_1_0_requests_are_answered_and_closed(daemon: DaemonProcess) -> None:
    """An HTTP/1.0 request without keep-alive gets its answer and then the end of the connection."""
    headers, body = _split(_exchange(daemon, b"GET /healthz HTTP/1.0\r\n\r\n"))
    assert ("close", b"ok\n") == (headers["connection"], body)


def test_http_1_0_keep_alive_is_honoured(daemon: DaemonProcess) -> None:
    """HTTP/1.0 with `Connection: keep-alive` stays open for a second request on the same connection."""
    raw = _exchange(daemon, b"GET /healthz HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /healthz HTTP/1.0\r\n\r\n")
    assert 2 == raw.count(b"HTTP/1.1 200 OK")


def test_close_among_other_connection_tokens_closes(daemon: DaemonProcess) -> None:
    """`Connection: TE, close` is a token list: close is honoured wherever it appears."""
    headers, body = _split(_exchange(daemon, b"GET /healthz HTTP/1.1\r\nConnection: TE, Close\r\nTE: trailers\r\n\r\n"))
    assert ("close", b"ok\n") == (headers["connection"], body)


@pytest.mark.parametrize(
    ("accept", "gzipped"),
    [
        ("gzip", True),
        ("GZIP;q=0.5, identity", True),
        ("x-gzip", True),
        ("gzip;q=0, identity", False),
        ("gzip; q=0.000", False),
        ("identity", False),
        ("deflate, br", False),
    ],
)
def test_gzip_follows_accept_encoding_quality(daemon: DaemonProcess, accept: str, gzipped: bool) -> None:
    """gzip only when the client accepts it with q > 0; the answer says it varies with Accept-Encoding."""
    headers, body = _split(
        _exchange(daemon, f"GET /metrics HTTP/1.1\r\nAccept-Encoding: {accept}\r\nConnection: close\r\n\r\n".encode())
    )
    assert (gzipped, "Accept-Encoding") == (headers.get("content-encoding") == "gzip", headers.get("vary"))
    text = (gzip.decompress(body) if gzipped else body).decode()
    assert [1.0] == list(select(parse_exposition(text), "torchpulse_build_info").values())


@pytest.mark.process
def test_a_refused_method_is_told_which_ones_are_served(tmp_path: Path) -> None:
    """A 405 answer carries `Allow: GET, HEAD` (RFC 9110 15.5.6) on every path."""
    daemon = start_daemon(tmp_path)
    try:
        answers = []
        for request in (
            b"POST /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            b"DELETE /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        ):
            with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as conn:
                conn.sendall(request)
                reply = b""
                while chunk := conn.recv(65536):
                    reply += chunk
            head = reply.split(b"\r\n\r\n", 1)[0].decode().split("\r\n")
            answers.append((head[0], [line for line in head if line.startswith("Allow:")]))
    finally:
        daemon.stop()
    assert [("HTTP/1.1 405 Method Not Allowed", ["Allow: GET, HEAD"])] * 2 == answers
