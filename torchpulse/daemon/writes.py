"""Writes to a peer of the agent socket, bounded in time: a peer that stops reading is cut off."""

from __future__ import annotations

import asyncio

from torchpulse.limits import AGENT_SOCKET_WRITE_TIMEOUT


class StalledReader(Exception):
    """The peer did not take what was written to it within AGENT_SOCKET_WRITE_TIMEOUT."""


async def drain(writer: asyncio.StreamWriter) -> None:
    """`writer.drain()`, bounded by AGENT_SOCKET_WRITE_TIMEOUT."""
    try:
        async with asyncio.timeout(AGENT_SOCKET_WRITE_TIMEOUT):
            await writer.drain()
    except TimeoutError:
        raise StalledReader from None
