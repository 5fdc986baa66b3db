"""Filesystem observation of checkpoint roots: watchdog threads in, immutable events out.

One inotify observer and one polling observer serve every root. Their threads
never touch daemon state: each relevant change becomes a `WatchEvent` handed
to the asyncio loop with `call_soon_threadsafe`. Backend failures (a root
deleted, the inotify watch limit) become events too, never a dead thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Final, Literal

import structlog
from watchdog.events import (
    DirDeletedEvent,
    FileCreatedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers.api import BaseObserver, ObservedWatch
from watchdog.observers.inotify import InotifyEmitter
from watchdog.observers.polling import PollingEmitter

log = structlog.get_logger("torchpulse.daemon.watcher")
EventKind = Literal["commit", "root_deleted", "backend_error"]
# Blocking read timeout of the inotify threads; bounds how long stop() waits.
INOTIFY_TIMEOUT: Final = 0.5


def is_metadata_name(name: str) -> bool:
    """The commit marker of a DCP save (`.metadata`, or `__N.metadata` without collectives)."""
    return name == ".metadata" or (name.endswith(".metadata") and name.startswith("__"))


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: EventKind
    root: str
    # The checkpoint directory for "commit"; the root otherwise.
    path: str
    detail: str = ""


@dataclass(unsafe_hash=True)
class BackendError(FileSystemEvent):
    """Queued by an emitter whose backend failed; it stops after queueing this."""

    event_type: str = field(default="backend_error", init=False)
    error: str = ""


class _SafeInotifyEmitter(InotifyEmitter):
    def queue_events(self, timeout: float, *, full_events: bool = False) -> None:
        try:
            super().queue_events(timeout, full_events=full_events)
        except OSError as exc:  # ENOSPC while adding a watch for a new subdirectory
            self.queue_event(BackendError(self.watch.path, error=f"{exc.strerror or exc}"))
            self.stop()


class _SafePollingEmitter(PollingEmitter):
    def queue_events(self, timeout: float) -> None:
        try:
            super().queue_events(timeout)
        except OSError as exc:
            self.queue_event(BackendError(self.watch.path, error=f"{exc.strerror or exc}"))
            self.stop()


class _Handler(FileSystemEventHandler):
    """Runs on a watchdog thread: classify, then hand over to the loop."""

    def __init__(self, root: str, send: Callable[[WatchEvent], None]) -> None:
        self.root = root
        self.send = send

    def dispatch(self, event: FileSystemEvent) -> None:
        if isinstance(event, BackendError):
            self.send(WatchEvent("backend_error", self.root, self.root, event.error))
        elif isinstance(event, FileMovedEvent) and is_metadata_name(PurePath(str(event.dest_path)).name):
            # `.metadata.tmp` renamed to `.metadata`: the save committed.
            self.send(WatchEvent("commit", self.root, str(PurePath(str(event.dest_path)).parent)))
        elif isinstance(event, FileCreatedEvent) and is_metadata_name(PurePath(str(event.src_path)).name):
            self.send(WatchEvent("commit", self.root, str(PurePath(str(event.src_path)).parent)))
        elif isinstance(event, DirDeletedEvent) and os.path.normpath(str(event.src_path)) == self.root:
            self.send(WatchEvent("root_deleted", self.root, self.root))


class Watcher:
    """Schedules roots on the right observer and forwards their events to `deliver` on `loop`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[WatchEvent], None],
                 poll_interval: float) -> None:
        self._loop = loop
        self._deliver = deliver
        self._poll_interval = poll_interval
        self._observers: dict[str, BaseObserver] = {}
        self._watches: dict[str, tuple[str, ObservedWatch]] = {}

    def _send(self, event: WatchEvent) -> None:
        # From a watchdog thread; the loop may already be closed at shutdown.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._deliver, event)

    def _observer(self, kind: str) -> BaseObserver:
        observer = self._observers.get(kind)
        if observer is None:
            if kind == "polling":
                observer = BaseObserver(_SafePollingEmitter, timeout=self._poll_interval)
            else:
                observer = BaseObserver(_SafeInotifyEmitter, timeout=INOTIFY_TIMEOUT)
            observer.name = f"torchpulse-watch-{kind}"
            observer.daemon = True
            observer.start()
            self._observers[kind] = observer
        return observer

    def watched(self) -> dict[str, str]:
        """Root -> observer kind, for what is scheduled right now."""
        return {root: kind for root, (kind, _) in self._watches.items()}

    def watch(self, root: str, kind: str) -> str | None:
        """Start watching `root` recursively; None on success, else why it failed."""
        self.unwatch(root)
        try:
            watch = self._observer(kind).schedule(_Handler(root, self._send), root, recursive=True)
        except OSError as exc:
            return exc.strerror or str(exc)
        self._watches[root] = (kind, watch)
        return None

    def unwatch(self, root: str) -> None:
        entry = self._watches.pop(root, None)
        if entry is not None:
            kind, watch = entry
            with contextlib.suppress(KeyError, OSError):
                self._observers[kind].unschedule(watch)

    def set_poll_interval(self, seconds: float) -> None:
        """Polling roots move to a new polling observer with the new interval."""
        if seconds == self._poll_interval:
            return
        self._poll_interval = seconds
        polled = [root for root, (kind, _) in self._watches.items() if kind == "polling"]
        for root in polled:
            self.unwatch(root)
        old = self._observers.pop("polling", None)
        if old is not None:
            _stop(old)
        for root in polled:
            self.watch(root, "polling")

    def stop(self) -> None:
        self._watches.clear()
        observers, self._observers = list(self._observers.values()), {}
        for observer in observers:
            _stop(observer)


def _stop(observer: Any) -> None:
    observer.unschedule_all()
    observer.stop()
    observer.join(timeout=5)
