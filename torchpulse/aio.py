"""asyncio stream helpers shared by the daemon's agent server and its metrics listener."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def close_connection(writer: asyncio.StreamWriter, timeout: float) -> None:
    """Close gracefully (what is buffered is still sent), or abort a peer that does not take it in `timeout`."""
    writer.close()
    try:
        async with asyncio.timeout(timeout):
            await writer.wait_closed()
    except Exception:
        # Only here: once a close flushed a buffered reply and completed, the transport has let go of its
        # loop, and abort() would raise AttributeError (asyncio on 3.11 logs it as an unhandled exception).
        writer.transport.abort()


class HeldReplies:
    """Replies being written to clients, each written a chunk at a time as its client reads it.

    A client that asked and never read used to hold its whole reply in its transport until the write
    timeout: a hundred such connections held a hundred copies. Written in chunks, connections share one
    body and each copies at most a chunk. The bodies held, each counted once however many connections
    share it, stay within `budget`: past it, the connection that has been writing the longest is cut off
    (a client reading at a normal speed is never the oldest). The agent server's status replies and the
    metrics listener's responses both go through one of these.
    """

    def __init__(self, budget: int, chunk: int, on_cut_off: Callable[[int], None], log_interval: float = 60.0) -> None:
        self.budget = budget
        self.chunk = chunk
        # Told how many connections were cut off, once per `log_interval` at most: a client connecting in
        # a loop must not flood the journal.
        self._on_cut_off = on_cut_off
        self._log_interval = log_interval
        self._writing: dict[asyncio.StreamWriter, tuple[float, bytes]] = {}  # since when, and its body
        self._cut_off = 0  # since the last report
        self._reported_at = -log_interval

    def held(self) -> int:
        """Bytes of the bodies connections are writing, each body once."""
        return sum(len(body) for body in {id(body): body for _, body in self._writing.values()}.values())

    def make_room(self, body: bytes) -> None:
        """Cut off the connections writing the longest until `body` fits in the budget with the others."""
        if any(held is body for _, held in self._writing.values()):
            return  # shared with a reply in progress: it costs nothing more
        # One reply alone may be larger than the budget: with nobody left to cut off, it is served.
        while self.held() + len(body) > self.budget and self.cut_off_oldest():
            pass

    def cut_off_oldest(self, stuck_for: float = 0.0) -> bool:
        """Abort the connection writing the longest (only one writing for `stuck_for` seconds or more);
        False when there is none."""
        now = time.monotonic()
        candidates = [w for w, (since, _) in self._writing.items() if now - since >= stuck_for]
        if not candidates:
            return False
        oldest = min(candidates, key=lambda w: self._writing[w][0])
        del self._writing[oldest]
        oldest.transport.abort()  # its task ends on the lost connection
        self._cut_off += 1
        if now - self._reported_at >= self._log_interval:
            self._on_cut_off(self._cut_off)
            self._cut_off, self._reported_at = 0, now
        return True

    async def write(self, writer: asyncio.StreamWriter, body: bytes, prefix: bytes = b"") -> None:
        """Write `prefix` (headers), then `body` a chunk at a time as the client takes it; the caller bounds
        how long it may take."""
        self._writing[writer] = (time.monotonic(), body)
        try:
            if prefix:
                writer.write(prefix)
            view = memoryview(body)
            for start in range(0, len(view), self.chunk):
                writer.write(view[start : start + self.chunk])
                await writer.drain()
            await writer.drain()
        finally:
            self._writing.pop(writer, None)
