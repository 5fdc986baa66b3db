"""A small asyncio HTTP/1.1 server for /metrics, on the daemon's event loop.

Serving on the loop (rather than prometheus_client's threaded server) means
collectors read the registry on the thread that writes it: no locks, no torn
reads. Requests are bounded in header size and time, so slow or oversized
clients are cut off without affecting agents.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import time
from collections.abc import Callable
from typing import Final

import structlog

from torchpulse.exporters.prometheus import CONTENT_TYPE, Exposition

log = structlog.get_logger("torchpulse.exporters.http")
MAX_HEADER_BYTES: Final = 8192
HEADER_TIMEOUT: Final = 5.0
IDLE_TIMEOUT: Final = 60.0
MAX_CONNECTIONS: Final = 256
# A client that leaves a response unread this long is cut off: a stalled reader
# would otherwise hold a connection slot and a rendered body forever.
WRITE_TIMEOUT: Final = 30.0
LANDING = b"""<html><head><title>torchpulse</title></head><body><h1>torchpulse</h1>
<p><a href="/metrics">Metrics</a></p></body></html>"""


class MetricsServer:
    def __init__(self, exposition: Exposition, health: Callable[[], bool] = lambda: True) -> None:
        self.exposition = exposition
        self.health = health
        self._server: asyncio.Server | None = None
        self._open = 0
        # Connections waiting for their next request, and since when.
        self._waiting: dict[asyncio.StreamWriter, float] = {}
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_HEADER_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open += 1
        try:
            if self._open > MAX_CONNECTIONS and not self._evict_oldest_waiting():
                await self._respond(writer, 503, b"too many connections\n", keep_alive=False)
                return
            first = True
            while True:
                self._waiting[writer] = time.monotonic()
                try:
                    request = await self._read_request(reader, HEADER_TIMEOUT if first else IDLE_TIMEOUT)
                finally:
                    self._waiting.pop(writer, None)
                first = False
                if request is None:
                    return
                method, target, version, headers = request
                keep_alive = _keep_alive(version, headers)
                await self._route(writer, method, target, headers, keep_alive)
                if not keep_alive:
                    return
        except (ConnectionError, TimeoutError, asyncio.LimitOverrunError, ValueError):
            # No graceful close: it would wait for a stalled peer to read what is buffered.
            writer.transport.abort()
        finally:
            self._open -= 1
            writer.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(WRITE_TIMEOUT):
                    await writer.wait_closed()
            writer.transport.abort()  # a no-op once closed

    def _evict_oldest_waiting(self) -> bool:
        """At the limit, drop the connection that has waited longest for a request (slowloris first)."""
        if not self._waiting:
            return False
        oldest = min(self._waiting, key=self._waiting.__getitem__)
        del self._waiting[oldest]
        oldest.transport.abort()
        return True

    async def _read_request(
        self, reader: asyncio.StreamReader, timeout: float
    ) -> tuple[str, str, str, dict[str, str]] | None:
        async with asyncio.timeout(timeout):
            try:
                raw = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return None
        if len(raw) > MAX_HEADER_BYTES:
            raise ValueError("request header too large")
        lines = raw.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            raise ValueError("malformed request line")
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if headers.get("content-length", "0") not in ("", "0"):
            raise ValueError("request bodies are not accepted")
        return parts[0], parts[1], parts[2], headers

    async def _route(self, writer: asyncio.StreamWriter, method: str, target: str,
                     headers: dict[str, str], keep_alive: bool) -> None:
        path = target.split("?", 1)[0]
        # A HEAD answer carries no body on any path: body bytes would be read as the next response.
        head = method == "HEAD"
        if method not in ("GET", "HEAD"):
            await self._respond(writer, 405, b"method not allowed\n", keep_alive=keep_alive)
        elif path == "/metrics":
            # Always text format 0.0.4: Prometheus accepts it whatever it asks for first.
            body, content_type = self.exposition.render(), CONTENT_TYPE
            encoding = None
            if _accepts_gzip(headers.get("accept-encoding", "")):
                body, encoding = gzip.compress(body, compresslevel=1), "gzip"
            await self._respond(writer, 200, body, content_type, keep_alive, encoding, head)
        elif path == "/healthz":
            ok = self.health()
            await self._respond(writer, 200 if ok else 503, b"ok\n" if ok else b"unhealthy\n",
                                keep_alive=keep_alive, head=head)
        elif path == "/":
            await self._respond(writer, 200, LANDING, "text/html; charset=utf-8", keep_alive, head=head)
        else:
            await self._respond(writer, 404, b"not found\n", keep_alive=keep_alive, head=head)

    @staticmethod
    async def _respond(writer: asyncio.StreamWriter, status: int, body: bytes,
                       content_type: str = "text/plain; charset=utf-8", keep_alive: bool = True,
                       encoding: str | None = None, head: bool = False) -> None:
        reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}
        lines = [
            f"HTTP/1.1 {status} {reason.get(status, 'Error')}",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}",
            f"Connection: {'keep-alive' if keep_alive else 'close'}",
        ]
        if encoding:
            lines.append(f"Content-Encoding: {encoding}")
        if content_type == CONTENT_TYPE:
            lines.append("Vary: Accept-Encoding")  # the body depends on it: caches must not mix the two
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        if not head:
            writer.write(body)
        async with asyncio.timeout(WRITE_TIMEOUT):
            await writer.drain()


def _tokens(value: str) -> list[str]:
    """The comma-separated items of a header, lowercased, each without its parameters."""
    return [item.split(";", 1)[0].strip().lower() for item in value.split(",")]


def _keep_alive(version: str, headers: dict[str, str]) -> bool:
    """RFC 9112: HTTP/1.1 persists unless `close`; HTTP/1.0 closes unless `keep-alive`.

    An HTTP/1.0 client kept open reads until the idle timeout for the end of a body it
    thinks is delimited by the close (curl -0, netcat and shell health checks).
    """
    tokens = _tokens(headers.get("connection", ""))
    if version.upper() == "HTTP/1.0":
        return "keep-alive" in tokens
    return "close" not in tokens


def _accepts_gzip(accept_encoding: str) -> bool:
    """True unless gzip is absent or refused with q=0 (`gzip;q=0`, RFC 9110 12.5.3)."""
    for item in accept_encoding.split(","):
        coding, _, params = item.partition(";")
        if coding.strip().lower() not in ("gzip", "x-gzip"):
            continue
        for param in params.split(";"):
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    return float(value.strip()) > 0
                except ValueError:
                    return False
        return True
    return False
