"""Frames read from the agent socket, with the bodies of large ones bounded across all connections."""

from __future__ import annotations

import asyncio
from typing import Final

from torchpulse.protocol import HEADER_SIZE, FrameError, decode_agent_frame, parse_header

# Once a header arrived, its body must follow within this long: a peer cannot park
# a half-sent frame (up to MAX_FRAME_BYTES of buffer) on a connection for ever.
FRAME_BODY_TIMEOUT: Final = 30.0
# Bodies of large frames being read, all connections together. Such a frame waits
# for room (one may always proceed alone, so no size starves). Small frames skip
# the wait: StreamReader holds at most ~128 KiB per connection besides a pending
# body, so an agent's usual batches never queue behind a peer parking big ones.
MAX_BUFFERED_BYTES: Final = 64 << 20
SMALL_FRAME_BYTES: Final = 64 << 10


class FrameReader:
    def __init__(self) -> None:
        self._buffered = 0
        self._buffer_freed = asyncio.Event()

    async def read(self, reader: asyncio.StreamReader, timeout: float) -> object | None:
        """The next frame, decoded; None when the peer closed between frames. `timeout` bounds the header."""
        try:
            async with asyncio.timeout(timeout):
                header = await reader.readexactly(HEADER_SIZE)
            length = parse_header(header)
            async with asyncio.timeout(FRAME_BODY_TIMEOUT):
                await self._reserve(length)
                try:
                    body = await reader.readexactly(length)
                finally:
                    self._release(length)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise FrameError("truncated", "connection closed in the middle of a frame") from None
            return None
        return decode_agent_frame(body)

    async def _reserve(self, length: int) -> None:
        if length <= SMALL_FRAME_BYTES:
            return
        while self._buffered and self._buffered + length > MAX_BUFFERED_BYTES:
            self._buffer_freed.clear()
            await self._buffer_freed.wait()
        self._buffered += length

    def _release(self, length: int) -> None:
        if length <= SMALL_FRAME_BYTES:
            return
        self._buffered -= length
        self._buffer_freed.set()
