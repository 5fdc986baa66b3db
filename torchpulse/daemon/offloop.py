"""Blocking filesystem calls off the event loop, in threads that a hung mount cannot pin.

`asyncio.to_thread` runs on the default executor: a call stuck on a hung NFS
mount takes one of its few workers for good, and the executor's threads are
joined at interpreter exit, so the daemon could not even stop. Here each call
gets its own daemon thread; callers keep at most one call per root in flight,
so the number of threads stays bounded by the number of roots.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def off_loop(call: Callable[[], T], name: str) -> asyncio.Future[T]:
    """Run `call` in a new daemon thread; the future settles on the running loop.

    Cancelling the future abandons the call; the thread ends when the call returns.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def succeed(result: T) -> None:
        if not future.done():  # else cancelled meanwhile
            future.set_result(result)

    def fail(error: BaseException) -> None:
        if not future.done():
            future.set_exception(error)

    def run() -> None:
        deliver: Callable[[], None]
        try:
            result = call()
        except BaseException as exc:  # handed to the awaiting task, which decides
            deliver = functools.partial(fail, exc)
        else:
            deliver = functools.partial(succeed, result)
        # The loop may be closed by now (shutdown): nobody waits any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(deliver)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
