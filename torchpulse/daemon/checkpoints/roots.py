"""Each checkpoint root's watch, kept in line with the observer wanted for it, off the event loop.

Scheduling a watch walks the whole tree, so each watch operation runs in its
own thread, at most one per root at a time; a root asked about again while its
operation runs gets one more run after it. `settle` waits for young operations
a bounded time only: a root on a hung network mount stalls neither the loop nor
the other roots.
"""

from __future__ import annotations

import asyncio
import functools
import os
import pwd
import time
from collections.abc import Callable

import structlog

from torchpulse.daemon.checkpoints.watcher import Outcome, Watcher
from torchpulse.daemon.offloop import off_loop
from torchpulse.limits import SETTLE_SECONDS

log = structlog.get_logger("torchpulse.daemon.checkpoints")


class RootWatches:
    """Roots wanted (root -> observer), inotify fallbacks, and the watch operations in flight."""

    def __init__(
        self, watcher: Watcher, configured: Callable[[], dict[str, str]], readable: Callable[[str, bool], None]
    ) -> None:
        self._watcher = watcher
        self._configured = configured  # root -> observer the config (or an announcement) asks for
        self._readable = readable  # told whether each wanted root can be read, after each of its watch operations
        self.wanted: dict[str, str] = {}  # root -> observer wanted now: inotify, polling or auto
        # root -> its configured observer when inotify ran out of watches: polled until the config changes it.
        self._fallbacks: dict[str, str] = {}
        self._errors: dict[str, str] = {}  # root -> the watch error last logged
        self._unreadable: dict[str, str] = {}  # root -> why it cannot be read, as last logged
        self._ops: dict[str, tuple[asyncio.Task[None], float]] = {}  # root -> (operation, monotonic start)
        self._again: set[str] = set()  # roots asked about while their operation was in flight
        self._closing = False

    def sync(self) -> None:
        """Recompute the wanted roots from the configured ones and bring every watch in line."""
        configured = self._configured()
        # A fallback to polling stands until the config changes that root's observer (or drops the root):
        # the inotify limit that caused it does not go away on SIGHUP or when another job announces.
        self._fallbacks = {root: was for root, was in self._fallbacks.items() if configured.get(root) == was}
        wanted = {
            root: "polling" if self._fallbacks.get(root) == observer else observer
            for root, observer in configured.items()
        }
        for root in set(self.wanted) - set(wanted):
            self._errors.pop(root, None)
            self._unreadable.pop(root, None)
            log.info("stopped watching a checkpoint root", root=root)
        self.wanted = wanted
        self.rewatch()

    def rewatch(self) -> None:
        """Bring every root's watch in line with `wanted` (new, failed, lost, dead or dropped roots)."""
        for root in sorted({*self.wanted, *self._watcher.scheduled()}):
            self.reconcile(root)

    def fall_back(self, root: str, error: str) -> None:
        """inotify failed for `root` (most often out of watches): poll it, which needs none."""
        configured = self._configured().get(root)
        if configured is None or self.wanted.get(root) == "polling":
            return
        self._fallbacks[root] = configured
        self.wanted[root] = "polling"
        log.warning(
            "inotify cannot watch this checkpoint root; polling it until the config changes its observer",
            root=root,
            error=error,
        )

    async def settle(self) -> None:
        """Wait for the watch operations in flight, and the re-runs they leave behind, SETTLE_SECONDS at most.

        Only operations younger than that count: a root whose operation is
        older (a hung mount) is neither waited for nor given a second one.
        """
        deadline = time.monotonic() + SETTLE_SECONDS
        while (left := deadline - time.monotonic()) > 0:
            now = time.monotonic()
            young = [task for task, started in self._ops.values() if not task.done() and now - started < SETTLE_SECONDS]
            if not young:
                return
            await asyncio.wait(young, timeout=left)

    def close(self) -> list[asyncio.Task[None]]:
        """Start no more operations; the ones in flight, for the caller to cancel and await."""
        self._closing = True
        return [task for task, _ in self._ops.values()]

    def reconcile(self, root: str) -> None:
        """Start the watch operation of `root`, unless one is in flight (it then runs once more after)."""
        if self._closing:
            return
        if root in self._ops:
            self._again.add(root)
            return
        task = asyncio.create_task(self._reconcile_root(root), name=f"watch {root}")
        self._ops[root] = (task, time.monotonic())
        task.add_done_callback(functools.partial(self._op_done, root))

    def _op_done(self, root: str, task: asyncio.Task[None]) -> None:
        self._ops.pop(root, None)
        log_crash(task, "checkpoint root watch operation crashed", root=root)
        if root in self._again and not self._closing:
            self._again.discard(root)
            self.reconcile(root)

    async def _reconcile_root(self, root: str) -> None:
        watcher = self._watcher
        while True:
            want = self.wanted.get(root)
            if want is None:
                if root not in watcher.scheduled():
                    return
                await off_loop(functools.partial(watcher.unwatch, root), f"torchpulse-unwatch {root}")
                continue  # re-added meanwhile?
            outcome = await off_loop(functools.partial(watcher.ensure, root, want), f"torchpulse-watch {root}")
            if self.wanted.get(root) != want:
                continue  # changed while it ran (SIGHUP, announcement): once more
            if outcome.exhausted and want != "polling":
                self.fall_back(root, outcome.error or "")
                continue
            self._log_outcome(root, outcome)
            return

    def _log_outcome(self, root: str, outcome: Outcome) -> None:
        self._readable(root, not outcome.unreadable)
        if outcome.unreadable:
            self._errors.pop(root, None)  # a watch error after it can be read again is news
            if self._unreadable.get(root) != outcome.error:
                # Once per reason, not per sweep; each sweep checks again.
                self._unreadable[root] = outcome.error or ""
                log.warning(
                    "checkpoint root cannot be read; nothing under it is watched or validated until it can "
                    "(checked again at each sweep)",
                    root=root,
                    error=outcome.error,
                    daemon_user=_user(),
                    fix="create the directory, or let the daemon's user list it (r and x on it, x on every "
                    "directory above it), or drop it from [checkpoints] roots",
                )
            return
        was = self._unreadable.pop(root, None)
        if outcome.error is None:
            self._errors.pop(root, None)
            if was is not None:
                log.info(
                    "checkpoint root can be read again; watching it", root=root, observer=outcome.observer, was=was
                )
            elif outcome.changed:
                log.info("watching checkpoint root", root=root, observer=outcome.observer)
            return
        if was is not None:
            log.info("checkpoint root can be read again", root=root, was=was)
        if self._errors.get(root) != outcome.error:
            # Logged once per reason; the sweep retries quietly.
            self._errors[root] = outcome.error
            log.warning(
                "cannot watch checkpoint root; retrying at each sweep",
                root=root,
                observer=outcome.observer,
                error=outcome.error,
            )


@functools.cache
def _user() -> str:
    """The daemon's user, for the line that says a root cannot be read (the job often writes as another one)."""
    uid = os.geteuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def log_crash(task: asyncio.Task[None], message: str, **fields: str) -> None:
    """Done callback of the service's tasks: an exception that ended one is logged, never lost."""
    if not task.cancelled() and task.exception() is not None:
        log.error(message, error=repr(task.exception()), **fields)
