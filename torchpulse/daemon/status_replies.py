"""Status replies to `torchpulse status`, built on the loop: one build for all the requests waiting."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from torchpulse.limits import MAX_STATUS_SPACING
from torchpulse.protocol import StatusReply, encode


class StatusReplies:
    """Encoded status replies, built on the loop: one build for all the requests waiting when it starts."""

    def __init__(self, status: Callable[[], StatusReply]) -> None:
        self._status = status
        self._pending: asyncio.Future[bytes] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._not_before = 0.0  # loop time: the last build's end plus its duration

    async def next(self) -> bytes:
        """A reply built after this call (so it shows whatever the caller saw happen before asking)."""
        if self._pending is None:
            loop = asyncio.get_running_loop()
            self._pending = loop.create_future()
            self._timer = loop.call_at(max(loop.time(), self._not_before), self._build)
        # Shielded: one waiter's connection ending (its task cancelled) must not cancel the others' reply.
        return await asyncio.shield(self._pending)

    def _build(self) -> None:
        pending, self._pending, self._timer = self._pending, None, None
        assert pending is not None
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            body = encode(self._status())
        except Exception as exc:  # an oversized reply (FrameError), a daemon bug: each waiter reports it
            pending.set_exception(exc)
        else:
            pending.set_result(body)
        end = loop.time()
        self._not_before = end + min(end - start, MAX_STATUS_SPACING)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._pending is not None:
            self._pending.cancel()
        self._pending = self._timer = None
