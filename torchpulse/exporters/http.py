"""A small asyncio HTTP/1.1 server for /metrics, on the daemon's event loop.

Serving on the loop (rather than prometheus_client's threaded server) means
collectors read the registry on the thread that writes it: no locks, no torn
reads. Requests are bounded in header size and time, so slow or oversized
clients are cut off without affecting agents; a request it cannot parse is
answered (400, 414, 431, ...) before the connection is closed.
"""

from __future__ import annotations

import asyncio
import gzip
import re
import time
from collections.abc import Callable
from typing import Final

import structlog

from torchpulse.aio import HeldReplies, close_connection
from torchpulse.exporters.prometheus import CONTENT_TYPE, Exposition
from torchpulse.limits import (
    HTTP_HEADER_TIMEOUT,
    HTTP_IDLE_TIMEOUT,
    HTTP_LINGER_TIMEOUT,
    HTTP_MAX_CONNECTIONS,
    HTTP_MAX_HEADER_BYTES,
    HTTP_MAX_HELD_BYTES,
    HTTP_WRITE_CHUNK,
    HTTP_WRITE_TIMEOUT,
    MAX_RENDER_REUSE_SECONDS,
)

log = structlog.get_logger("torchpulse.exporters.http")
REASONS: Final = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Content Too Large",
    414: "URI Too Long",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}
# RFC 9110 5.6.2 (methods, field names); RFC 9112 3.2 (a target is visible ASCII).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TARGET = re.compile(r"[\x21-\x7e]+")
_VERSION = re.compile(r"HTTP/([0-9])\.[0-9]")
LANDING = b"""<html><head><title>torchpulse</title></head><body><h1>torchpulse</h1>
<p><a href="/metrics">Metrics</a></p></body></html>"""


class BadRequest(Exception):
    """A request this server will not serve: answered with `status`, then the connection is closed."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def _cut_off(connections: int) -> None:
    log.warning(
        "scrape clients cut off: they do not read their responses and the bodies held for them passed the budget",
        connections=connections,
        max_held_bytes=HTTP_MAX_HELD_BYTES,
    )


class MetricsServer:
    def __init__(self, exposition: Exposition, health: Callable[[], bool] = lambda: True) -> None:
        self.exposition = exposition
        self.health = health
        self._server: asyncio.Server | None = None
        self._open = 0
        # Connections waiting for their next request, and since when.
        self._waiting: dict[asyncio.StreamWriter, float] = {}
        # Every open connection and the task serving it, for `close`.
        self._connections: dict[asyncio.StreamWriter, asyncio.Task[None]] = {}
        self._held = HeldReplies(HTTP_MAX_HELD_BYTES, HTTP_WRITE_CHUNK, _cut_off)
        # The last /metrics body: (when it was rendered, how long that took, the body, its gzip or None).
        self._rendered: tuple[float, float, bytes, bytes | None] | None = None
        self._closing = False
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        try:
            self._server = await asyncio.start_server(self._serve, host, port, limit=HTTP_MAX_HEADER_BYTES)
        except OSError as exc:
            # asyncio says which address, not which setting: name the key and the flag that choose it.
            raise OSError(
                exc.errno,
                f"cannot serve /metrics on {host}:{port} (daemon.listen in the config, or --listen): {exc.strerror}",
            ) from None
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and end the open connections, then return once each one's task has.

        Prometheus keeps its connection open between scrapes and scrapes on over it: left
        open, it keeps Server.wait_closed (Python 3.12.1 and later) waiting for as long as
        the scraper keeps scraping, so a stop ran into systemd's stop timeout (SIGKILL: the
        textfile stayed behind with its last values). On 3.11 the task was cancelled at
        the loop's end instead, which asyncio logs as an error.
        """
        if self._server is None:
            return
        self._closing = True
        self._server.close()
        for writer in list(self._connections):
            writer.transport.abort()
        await asyncio.gather(*self._connections.values(), return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open += 1
        task = asyncio.current_task()
        if task is not None:
            self._connections[writer] = task
        try:
            if self._closing:  # accepted just before `close`: its abort loop did not see this one
                writer.transport.abort()
                return
            if self._open > HTTP_MAX_CONNECTIONS and not self._evict_oldest_waiting():
                await self._respond(writer, 503, b"too many connections\n", keep_alive=False)
                return
            first = True
            while True:
                self._waiting[writer] = time.monotonic()
                try:
                    request = await self._read_request(reader, HTTP_HEADER_TIMEOUT if first else HTTP_IDLE_TIMEOUT)
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
        except BadRequest as exc:
            await self._refuse(reader, writer, exc)
        except (ConnectionError, TimeoutError):
            # No graceful close: it would wait for a stalled peer to read what is buffered.
            writer.transport.abort()
        finally:
            try:
                await close_connection(writer, HTTP_WRITE_TIMEOUT)
            finally:
                # Counted until its socket is closed: a descriptor is held until then.
                self._open -= 1
                self._connections.pop(writer, None)

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
        """The next request's method, target, version and headers; None when the client closed first."""
        async with asyncio.timeout(timeout):
            line = await _read_line(reader, 414)
            size = len(line)
            # RFC 9112 2.2: empty lines before a request line are ignored (within the size limit).
            while line in (b"\r\n", b"\n") and size <= HTTP_MAX_HEADER_BYTES:
                line = await _read_line(reader, 414)
                size += len(line)
            if not line:
                return None
            method, target, version = _request_line(line)
            headers: dict[str, str] = {}
            while (line := await _read_line(reader, 431)) not in (b"\r\n", b"\n"):
                size += len(line)
                if size > HTTP_MAX_HEADER_BYTES:
                    raise BadRequest(431, "request header too large")
                if not line:
                    raise BadRequest(400, "the connection ended inside the request header")
                name, value = _header_field(line)
                headers[name] = value
        if size > HTTP_MAX_HEADER_BYTES:
            raise BadRequest(431, "request header too large")
        length = headers.get("content-length", "0")
        if not (length.isascii() and length.isdigit()):  # "²" is a digit to str.isdigit, not to int()
            raise BadRequest(400, "malformed Content-Length")
        if int(length) or "transfer-encoding" in headers:
            raise BadRequest(413, "request bodies are not accepted")
        return method, target, version, headers

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, exc: BadRequest) -> None:
        """Answer a request that is not served, then close without destroying the answer.

        Closing a socket with unread request bytes in it makes the kernel reset the
        connection, which can discard the answer before the client reads it: the write
        side is shut first, then what the client still sends is read and dropped, for
        HTTP_LINGER_TIMEOUT at most.
        """
        try:
            await self._respond(writer, exc.status, f"{exc}\n".encode(), keep_alive=False)
            if writer.can_write_eof():
                writer.write_eof()
            async with asyncio.timeout(HTTP_LINGER_TIMEOUT):
                while await reader.read(1 << 16):
                    pass
        except (ConnectionError, TimeoutError):
            writer.transport.abort()

    async def _route(
        self, writer: asyncio.StreamWriter, method: str, target: str, headers: dict[str, str], keep_alive: bool
    ) -> None:
        path = target.split("?", 1)[0]
        # A HEAD answer carries no body on any path: body bytes would be read as the next response.
        head = method == "HEAD"
        if method not in ("GET", "HEAD"):
            await self._respond(writer, 405, b"method not allowed\n", keep_alive=keep_alive)
        elif path == "/metrics":
            # Always text format 0.0.4: Prometheus accepts it whatever it asks for first.
            compressed = _accepts_gzip(headers.get("accept-encoding", ""))
            body = self._metrics_body(compressed)
            if not head:
                self._held.make_room(body)
            await self._respond(writer, 200, body, CONTENT_TYPE, keep_alive, "gzip" if compressed else None, head)
        elif path == "/healthz":
            ok = self.health()
            await self._respond(
                writer, 200 if ok else 503, b"ok\n" if ok else b"unhealthy\n", keep_alive=keep_alive, head=head
            )
        elif path == "/":
            await self._respond(writer, 200, LANDING, "text/html; charset=utf-8", keep_alive, head=head)
        else:
            await self._respond(writer, 404, b"not found\n", keep_alive=keep_alive, head=head)

    def _metrics_body(self, compressed: bool) -> bytes:
        """The exposition (gzipped when asked), rendered now or reused from a render younger than its duration."""
        now = time.monotonic()
        cached = self._rendered
        if cached is None or now - cached[0] >= min(cached[1], MAX_RENDER_REUSE_SECONDS):
            body = self.exposition.render()
            done = time.monotonic()
            cached = self._rendered = (done, done - now, body, None)
        if not compressed:
            return cached[2]
        if cached[3] is None:
            start = time.monotonic()
            gz = gzip.compress(cached[2], compresslevel=1)
            # The compression counts towards how long this body is worth keeping.
            cached = self._rendered = (cached[0], cached[1] + time.monotonic() - start, cached[2], gz)
        assert cached[3] is not None
        return cached[3]

    async def _respond(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        body: bytes,
        content_type: str = "text/plain; charset=utf-8",
        keep_alive: bool = True,
        encoding: str | None = None,
        head: bool = False,
    ) -> None:
        lines = [
            f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}",
            f"Connection: {'keep-alive' if keep_alive else 'close'}",
        ]
        if status == 405:
            lines.append("Allow: GET, HEAD")  # RFC 9110 15.5.6: a 405 answer must list the methods served
        if encoding:
            lines.append(f"Content-Encoding: {encoding}")
        if content_type == CONTENT_TYPE:
            lines.append("Vary: Accept-Encoding")  # the body depends on it: caches must not mix the two
        async with asyncio.timeout(HTTP_WRITE_TIMEOUT):
            await self._held.write(writer, b"" if head else body, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))


async def _read_line(reader: asyncio.StreamReader, too_long: int) -> bytes:
    """One line with its terminator; b"" at the end of the stream before any byte of it."""
    try:
        return await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise BadRequest(400, "the connection ended inside the request header") from None
        return b""
    except asyncio.LimitOverrunError:
        # No end of line in the first HTTP_MAX_HEADER_BYTES: a request line that began with a method
        # has a target too long to take (414); bytes that never looked like one are garbage (400).
        head = await reader.read(HTTP_MAX_HEADER_BYTES)
        method, space, _ = head.partition(b" ")
        if too_long == 414 and not (space and _TOKEN.fullmatch(method.decode("latin-1"))):
            raise BadRequest(400, "malformed request line") from None
        message = "request target too long" if too_long == 414 else "request header too large"
        raise BadRequest(too_long, message) from None


def _text(line: bytes) -> str:
    """A line without its terminator (RFC 9112 2.2: a bare LF ends a line too)."""
    return line[:-1].removesuffix(b"\r").decode("latin-1")


def _request_line(line: bytes) -> tuple[str, str, str]:
    parts = _text(line).split(" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not _TARGET.fullmatch(parts[1]):
        raise BadRequest(400, "malformed request line")
    version = _VERSION.fullmatch(parts[2])
    if version is None:
        raise BadRequest(400, "malformed request line")
    if version.group(1) != "1":
        raise BadRequest(505, "only HTTP/1.x is served")
    return parts[0], parts[1], parts[2]


def _header_field(line: bytes) -> tuple[str, str]:
    """A header's lowercased name and its value; RFC 9112 5 and RFC 9110 5.5 say what is refused."""
    name, sep, value = _text(line).partition(":")
    # A name with whitespace before the colon, or a continuation line (obsolete folding), is refused:
    # proxies disagree on what they mean.
    if not sep or not _TOKEN.fullmatch(name):
        raise BadRequest(400, "malformed header field")
    value = value.strip(" \t")
    if "\r" in value or "\0" in value:
        raise BadRequest(400, "malformed header field")
    return name.lower(), value


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
