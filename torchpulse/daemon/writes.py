"""Writes to a peer of the agent socket, bounded in time: a peer that stops reading is cut off."""

from __future__ import annotations

import asyncio
from typing import Final

# A peer that stops reading what the daemon sends it (a status reply of thousands of ranks)
# is cut off after this long: blocked in drain() or in a graceful close, its connection would
# hold a descriptor, a connection slot and the unsent reply for ever.
WRITE_TIMEOUT: Final = 10.0


class StalledReader(Exception):
    """The peer did not take what was written to it within WRITE_TIMEOUT."""


async def drain(writer: asyncio.StreamWriter) -> None:
    """`writer.drain()`, bounded by WRITE_TIMEOUT."""
    try:
        async with asyncio.timeout(WRITE_TIMEOUT):
            await writer.drain()
    except TimeoutError:
        raise StalledReader from None
