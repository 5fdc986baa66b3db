"""Filesystem observation of checkpoint roots: watchdog threads in, immutable events out.

Each root has its own observer (a dispatcher thread and one emitter thread).
watchdog's observer holds one lock while it schedules a watch (the first
polling snapshot, the recursive inotify walk) and while it dispatches events,
so with a shared observer one root on a hung mount would stall every other
root. Their threads never touch daemon state: each relevant change becomes a
`WatchEvent` handed to the asyncio loop with `call_soon_threadsafe`. Backend
failures (a root deleted, the inotify watch limit, a tree too deep to walk)
become events too, never a dead thread.

A root is watched at its resolved path and its events are reported under
the configured one: inotify does not follow a symlinked root (watchdog adds
IN_DONT_FOLLOW), so a watch on the link itself would see nothing created in it.

`ensure`, `unwatch` and `stop` block (they walk and join); the service runs
them off the loop, one at a time per root. `watched` is cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Final, Literal, cast

import structlog
from watchdog.events import (
    DirDeletedEvent,
    FileCreatedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers.api import BaseObserver, EventEmitter
from watchdog.observers.inotify import InotifyEmitter
from watchdog.observers.polling import PollingEmitter

try:  # watchdog >= 7: watch groups on one shared inotify instance
    from watchdog.observers.inotify import InotifyWatchGroup
    from watchdog.observers.inotify_c import InotifyFD
except ImportError:  # older ones raise the limit at the first walk, and ignore it for new subdirectories
    InotifyWatchGroup = None  # type: ignore[assignment,misc]

from torchpulse.daemon.checkpoints.mounts import Mount, choose_observer, read_mounts

log = structlog.get_logger("torchpulse.daemon.checkpoints.watcher")
EventKind = Literal["commit", "root_deleted", "backend_error"]
# Blocking read timeout of the inotify threads; bounds how long stop() waits.
INOTIFY_TIMEOUT: Final = 0.5
# How long stopping observers waits for their threads. One stuck in a poll of a
# hung mount is left behind (a daemon thread); it exits when the mount answers.
JOIN_TIMEOUT: Final = 2.0
# inotify_add_watch's watch limit and inotify_init's instance limit: polling needs neither.
_INOTIFY_LIMITS: Final = frozenset({errno.ENOSPC, errno.EMFILE})


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


def describe(exc: BaseException) -> str:
    """A short reason for a log line."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return f"{type(exc).__name__}: {exc}"[:300]


def unreadable(directory: str) -> str | None:
    """Why the daemon cannot list `directory` and reach what is in it (missing, not a directory, no r or x
    permission), or None when it can.

    Opened as `directory/.`: looking up `.` needs search (x) permission, the open read (r) permission.
    The observers do not tell: watchdog ignores EACCES from inotify_add_watch (an inotify watch on a root
    the daemon may not read "succeeds" and never delivers an event), and its polling emitter keeps
    retrying a snapshot that fails so, quietly after one warning.
    """
    try:
        with os.scandir(f"{directory}/."):  # not Path: it drops the `.`
            return None
    except OSError as exc:
        return describe(exc)


def _exhausts_inotify(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _INOTIFY_LIMITS


class _WatchLimit:
    """The shared inotify instance, seen by one root's watch group: remembers running out of watches.

    watchdog ignores any error adding a watch for a subdirectory (meant for one
    deleted during the walk), the watch limit included: past the limit, every
    new checkpoint directory would go unwatched without a word.
    """

    def __init__(self, inotify: InotifyFD) -> None:
        self._inotify = inotify
        self.error: OSError | None = None  # set on the thread that added the watch, read by the emitter's

    def add_callback(self, *args: Any) -> Any:
        try:
            return self._inotify.add_callback(*args)
        except OSError as exc:
            if _exhausts_inotify(exc) and self.error is None:
                self.error = exc
            raise

    def remove_callbacks(self, *args: Any) -> None:
        self._inotify.remove_callbacks(*args)


_limit_hook_noted = False


def _note_no_limit_hook(exc: BaseException) -> None:
    global _limit_hook_noted
    if not _limit_hook_noted:
        _limit_hook_noted = True
        log.warning(
            "this watchdog's inotify internals differ: running out of inotify watches below a root "
            "is noticed only by the periodic sweep",
            error=describe(exc),
        )


class _SafeInotifyEmitter(InotifyEmitter):
    _limit: _WatchLimit | None = None

    def on_thread_start(self) -> None:
        if InotifyWatchGroup is None:
            super().on_thread_start()
            return
        # InotifyEmitter's, with the group adding its watches through a _WatchLimit. Private to
        # watchdog 7: another shape falls back to its own start (the limit is then met silently).
        try:
            limit = _WatchLimit(self._inotify_fd)
            group = InotifyWatchGroup(
                cast("InotifyFD", limit),
                os.fsencode(self.watch.path),
                is_recursive=self.watch.is_recursive,
                event_mask=self.get_event_mask_from_filter(),
                follow_symlink=self.watch.follow_symlink,
            )
        except (AttributeError, TypeError) as exc:
            _note_no_limit_hook(exc)
            super().on_thread_start()
            return
        self._limit = limit
        if self._limit.error is not None:
            group.deactivate()  # the watches it did get are needed elsewhere
            raise self._limit.error
        self._inotify = group

    def queue_events(self, timeout: float, *, full_events: bool = False) -> None:
        try:
            super().queue_events(timeout, full_events=full_events)
            # A new subdirectory it could not watch: its creation is the event just read.
            if self._limit is not None and self._limit.error is not None:
                raise self._limit.error
        # The watch limit reached by a new subdirectory; RecursionError walking a very deep new one.
        except Exception as exc:
            self.queue_event(BackendError(self.watch.path, error=describe(exc)))
            self.stop()


class _SafePollingEmitter(PollingEmitter):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # lstat: a symlink below the root (`latest` -> step-N) is not walked into, as inotify does not follow
        # one either. Followed, every checkpoint it points at would be validated a second time under the
        # link's path, and a link to an ancestor walked until RecursionError.
        super().__init__(*args, stat=os.lstat, **kwargs)

    def queue_events(self, timeout: float) -> None:
        try:
            super().queue_events(timeout)
        except Exception as exc:  # RecursionError: a snapshot of a tree ~1000 levels deep
            self.queue_event(BackendError(self.watch.path, error=describe(exc)))
            self.stop()


class _RootObserver(BaseObserver):
    def on_thread_stop(self) -> None:
        # watchdog's own stop joins the emitters without a timeout, under the
        # lock its dispatcher needs: an emitter stuck on a hung mount would hold
        # the stopping thread forever. Signal them; `_stop_all` joins, bounded.
        for emitter in list(self.emitters):
            emitter.stop()


class _Handler(FileSystemEventHandler):
    """Runs on a watchdog thread: classify, then hand over to the loop."""

    def __init__(self, root: str, target: str, send: Callable[[WatchEvent], None], lost: threading.Event) -> None:
        self.root = root
        self.target = target  # the resolved root, where the events happen
        self.send = send
        # Set before the service hears of the loss, so that `watched()` never reports this watch again.
        self.lost = lost

    def _under_root(self, path: str) -> str:
        """`path` (under the resolved root) as it reads under the configured root."""
        relative = os.path.relpath(path, self.target)
        outside = relative == ".." or relative.startswith("../")
        return path if outside else str(PurePath(self.root, relative))

    def dispatch(self, event: FileSystemEvent) -> None:
        if isinstance(event, BackendError):
            self.lost.set()
            self.send(WatchEvent("backend_error", self.root, self.root, event.error))
        elif isinstance(event, FileMovedEvent) and is_metadata_name(PurePath(str(event.dest_path)).name):
            # `.metadata.tmp` renamed to `.metadata`: the save committed.
            self.send(WatchEvent("commit", self.root, self._under_root(str(PurePath(str(event.dest_path)).parent))))
        elif isinstance(event, FileCreatedEvent) and is_metadata_name(PurePath(str(event.src_path)).name):
            self.send(WatchEvent("commit", self.root, self._under_root(str(PurePath(str(event.src_path)).parent))))
        elif isinstance(event, DirDeletedEvent) and os.path.normpath(str(event.src_path)) == self.target:
            self.lost.set()
            self.send(WatchEvent("root_deleted", self.root, self.root))


@dataclass(frozen=True, slots=True)
class Outcome:
    """What `Watcher.ensure` did for a root."""

    observer: str  # the one it runs (or tried): "inotify" or "polling"
    error: str | None = None
    exhausted: bool = False  # inotify's watch or instance limit: polling needs neither
    changed: bool = False  # newly scheduled, not already watched that way
    unreadable: bool = False  # the root cannot be listed (`error` says why): not watched at all


@dataclass(frozen=True, slots=True)
class _Entry:
    kind: str
    target: str  # the resolved root it watches: a symlinked root pointed elsewhere needs a new watch
    interval: float
    observer: BaseObserver
    lost: threading.Event

    def live(self, poll_interval: float) -> bool:
        """Running and current: a dead emitter thread, a lost root or an old poll interval is not."""
        if self.lost.is_set() or not self.observer.is_alive():
            return False
        if self.kind == "polling" and self.interval != poll_interval:
            return False
        emitters: list[EventEmitter] = list(self.observer.emitters)
        return bool(emitters) and all(emitter.is_alive() for emitter in emitters)


class Watcher:
    """Schedules roots on the right observer and forwards their events to `deliver` on `loop`."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        deliver: Callable[[WatchEvent], None],
        poll_interval: float,
        mounts: Callable[[], list[Mount]] = read_mounts,
    ) -> None:
        self._loop = loop
        self._deliver = deliver
        self._poll_interval = poll_interval
        self._mounts = mounts
        # Changed from the threads that schedule roots, read on the loop.
        self._lock = threading.Lock()
        self._watches: dict[str, _Entry] = {}
        self._stopped = False

    def _send(self, event: WatchEvent) -> None:
        # From a watchdog thread; the loop may already be closed at shutdown.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._deliver, event)

    def watched(self) -> dict[str, str]:
        """Root -> observer kind, for the roots whose watch is running and current right now."""
        with self._lock:
            entries = list(self._watches.items())
        return {root: entry.kind for root, entry in entries if entry.live(self._poll_interval)}

    def kind_of(self, root: str) -> str | None:
        """The observer kind of `root`'s watch, running or not."""
        with self._lock:
            entry = self._watches.get(root)
        return None if entry is None else entry.kind

    def scheduled(self) -> set[str]:
        """Every root with a watch, running or not (what `unwatch` has to clean up)."""
        with self._lock:
            return set(self._watches)

    def ensure(self, root: str, observer: str) -> Outcome:
        """Blocking: watch `root` recursively with `observer` unless it is watched that way already.

        "auto" picks by the mount table, with symlinks resolved: a root that
        links into an NFS mount needs polling however its own path reads. A
        root the daemon cannot read is not watched (its watch, if any, stops).
        """
        kind = observer
        try:
            target = os.path.realpath(root)
            kind = choose_observer(target, observer, self._mounts())
            # Checked first, also for a live watch: an inotify watch outlives a chmod of its root.
            problem = unreadable(target)
            if problem is not None:
                self.unwatch(root)
                return Outcome(kind, error=problem, unreadable=True)
            with self._lock:
                entry = self._watches.get(root)
            if entry is not None and entry.kind == kind and entry.target == target and entry.live(self._poll_interval):
                return Outcome(kind)
            self.unwatch(root)
            self._schedule(root, target, kind)
        # Anything: OSError, ValueError (a NUL byte), RecursionError (a tree too deep to walk)...
        except Exception as exc:
            return Outcome(kind, error=describe(exc), exhausted=kind == "inotify" and _exhausts_inotify(exc))
        return Outcome(kind, changed=True)

    def _schedule(self, root: str, target: str, kind: str) -> None:
        interval = self._poll_interval
        if kind == "polling":
            observer = _RootObserver(_SafePollingEmitter, timeout=interval)
        else:
            observer = _RootObserver(_SafeInotifyEmitter, timeout=INOTIFY_TIMEOUT)
        observer.name = f"torchpulse-watch-{kind}"
        lost = threading.Event()
        observer.schedule(_Handler(root, target, self._send, lost), target, recursive=True)
        try:
            observer.start()  # the first snapshot or the recursive inotify walk happens here
        except BaseException:
            _stop_all([observer])
            raise
        with self._lock:
            if not self._stopped:
                self._watches[root] = _Entry(kind, target, interval, observer, lost)
                return
        _stop_all([observer])  # scheduled while the daemon was stopping
        raise RuntimeError("the watcher is stopped")

    def unwatch(self, root: str) -> None:
        """Blocking (boundedly): stop watching `root`."""
        with self._lock:
            entry = self._watches.pop(root, None)
        if entry is not None:
            _stop_all([entry.observer])

    def set_poll_interval(self, seconds: float) -> None:
        """Polled roots then count as not watched, and the service schedules them again (off the loop)."""
        self._poll_interval = seconds

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            observers = [entry.observer for entry in self._watches.values()]
            self._watches.clear()
        _stop_all(observers)


def _stop_all(observers: list[BaseObserver], timeout: float = JOIN_TIMEOUT) -> None:
    """Stop observers and their emitters, waiting at most `timeout` for all of them together."""
    for observer in observers:
        observer.stop()
    deadline = time.monotonic() + timeout
    for observer in observers:
        for thread in [*observer.emitters, observer]:
            # RuntimeError: never started (its first snapshot failed).
            with contextlib.suppress(RuntimeError):
                thread.join(max(0.0, deadline - time.monotonic()))
