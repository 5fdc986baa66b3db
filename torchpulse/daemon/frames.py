"""Frames read from the agent socket, with the bodies of large ones bounded across all connections."""

from __future__ import annotations

import asyncio

from torchpulse.limits import FRAME_BODY_TIMEOUT, MAX_BUFFERED_BYTES, SMALL_FRAME_BYTES
from torchpulse.protocol import HEADER_SIZE, FrameError, decode_agent_frame, parse_header


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
