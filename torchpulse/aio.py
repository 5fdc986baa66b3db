"""asyncio stream helpers shared by the daemon's agent server and its metrics listener."""

from __future__ import annotations

import asyncio


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
