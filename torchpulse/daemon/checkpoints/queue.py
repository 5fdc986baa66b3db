"""Committed checkpoints waiting for validation: debounced, newest first, a bounded number at once.

When saves come faster than validations, the newest checkpoint's status is what matters, and the backlog
waits. A path found again while it is validated is checked once more when that validation ends (the
validation may have read the previous save).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine

from torchpulse.daemon.checkpoints.roots import log_crash

Validate = Callable[[str, str | None], Coroutine[object, object, None]]


class ValidationQueue:
    def __init__(self, debounce_seconds: Callable[[], float], max_concurrent: Callable[[], int]) -> None:
        self._debounce_seconds = debounce_seconds
        self._max_concurrent = max_concurrent
        self._debounce: dict[str, asyncio.TimerHandle] = {}
        # Paths waiting in the order they were found, the last next, each with the root it was found under
        # (None: announced outside every root, validated under "other").
        self.pending: dict[str, str | None] = {}
        self.in_flight: set[str] = set()
        # Found again while being validated: path -> the root it was found under.
        self._again: dict[str, str | None] = {}
        self._has_pending = asyncio.Event()
        self._slot_free = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def commit(self, path: str, root: str | None) -> None:
        """`.metadata` appeared in `path` under `root`: queued once things have been quiet for a moment."""
        handle = self._debounce.pop(path, None)
        if handle is not None:
            handle.cancel()
        loop = asyncio.get_running_loop()
        self._debounce[path] = loop.call_later(self._debounce_seconds(), self.enqueue, path, root)

    def debouncing(self, path: str) -> bool:
        return path in self._debounce

    def enqueue(self, path: str, root: str | None) -> None:
        """Queue `path` now (again after its validation ends, when one runs)."""
        self._debounce.pop(path, None)
        if path in self.in_flight:
            self._again[path] = root
        elif path not in self.pending:
            self.pending[path] = root
            self._has_pending.set()

    def limit_changed(self) -> None:
        """max_concurrent_validations may have been raised: look for a free slot again."""
        self._slot_free.set()

    async def run(self, validate: Validate) -> None:
        """Start validations for ever, the newest path first, while slots are free."""
        while True:
            # A slot first, then the path: one found while waiting may be newer.
            while len(self._tasks) >= self._max_concurrent():
                self._slot_free.clear()
                await self._slot_free.wait()
            if not self.pending:
                self._has_pending.clear()
                await self._has_pending.wait()
                continue
            path = next(reversed(self.pending))
            found_under = self.pending.pop(path)
            self.in_flight.add(path)
            task = asyncio.create_task(validate(path, found_under), name=f"validate {path}")
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._finished, path))

    def _finished(self, path: str, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self.in_flight.discard(path)
        self._slot_free.set()
        log_crash(task, "checkpoint validation crashed", path=path)
        if path in self._again:
            self.enqueue(path, self._again.pop(path))  # validated again only if its key changed

    def stop(self) -> list[asyncio.Task[None]]:
        """Cancel the debounce timers; returns the validations running, for the caller to cancel and await."""
        for handle in self._debounce.values():
            handle.cancel()
        return list(self._tasks)
