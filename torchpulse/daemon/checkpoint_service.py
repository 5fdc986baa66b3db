"""The checkpoint watcher: roots, announcements, debounce, bounded validation, sweeps.

Everything here runs on the daemon's event loop. Filesystem events arrive
from the watcher threads as `WatchEvent`s; agents' announcements arrive from
the agent server. A committed checkpoint is debounced, re-stat'ed, skipped
when its metadata key was validated before (also before a restart), and
validated in a worker process, at most `max_concurrent_validations` at once.
A periodic sweep finds what events missed: checkpoints committed while the
daemon was down, saves that never committed, roots that came back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Final

import structlog

from torchpulse.checkpoints.model import DATA_SUFFIXES, Level, ValidationResult
from torchpulse.checkpoints.worker import Limits
from torchpulse.daemon import checkpoint_runner
from torchpulse.daemon.checkpoint_config import CheckpointsConfig
from torchpulse.daemon.checkpoint_mounts import Mount, choose_observer, read_mounts
from torchpulse.daemon.checkpoint_scan import Scan, deleted, metadata_key, scan
from torchpulse.daemon.checkpoint_state import Record, StateStore
from torchpulse.daemon.checkpoint_stats import CheckpointStats
from torchpulse.daemon.watcher import Watcher, WatchEvent
from torchpulse.protocol import CheckpointSaved

log = structlog.get_logger("torchpulse.daemon.checkpoints")
OTHER: Final = "other"
MAX_SWEEP_INTERVAL: Final = 60.0
# Forgetting records of deleted checkpoints stats every recorded path: hourly is plenty.
PRUNE_INTERVAL: Final = 3600.0


class CheckpointService:
    def __init__(self, config: CheckpointsConfig, state_dir: Path, mounts: list[Mount] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._clock = clock  # wall clock: announcement times outlive the process
        self.stats = CheckpointStats()
        self._state_dir = state_dir
        self._mounts = mounts
        self._store: StateStore | None = None
        self._watcher: Watcher | None = None
        self._announced: dict[str, float] = {}  # announced root -> last announcement
        self._folded: set[str] = set()
        self._wanted: dict[str, str] = {}  # root -> observer kind it should have
        self._watch_errors: dict[str, str] = {}
        self._debounce: dict[str, asyncio.TimerHandle] = {}
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._in_flight: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._slot_free = asyncio.Event()
        self._sweep_now = asyncio.Event()
        self._background: list[asyncio.Task[None]] = []
        self._pruned_at = -PRUNE_INTERVAL  # monotonic; the first sweep prunes

    # -- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._store = StateStore(self._state_dir)
        self.stats.restore(self._store.latest_per_root(), self._store.last_valid_per_root())
        kept = list(self._store.announced_roots().items())[: self.config.max_announced_roots]
        self._announced = dict(kept)
        self._expire_announced()  # before the watcher exists: the one sync below covers it
        self._watcher = Watcher(loop, self._on_watch_event, self.config.poll_interval_seconds)
        self._sync_roots()
        self._background = [asyncio.create_task(self._dispatch(), name="checkpoint-dispatch"),
                            asyncio.create_task(self._sweeps(), name="checkpoint-sweep")]

    async def close(self) -> None:
        for handle in self._debounce.values():
            handle.cancel()
        tasks = [*self._background, *self._tasks]
        for task in tasks:
            task.cancel()
        # Cancelling a validation kills its worker; unrecorded, it runs again after a restart.
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._watcher is not None:
            await asyncio.to_thread(self._watcher.stop)
        if self._store is not None:
            self._store.close()

    def apply_config(self, config: CheckpointsConfig) -> None:
        """SIGHUP: new roots, observers and limits apply at once; running validations finish."""
        self.config = config
        if self._watcher is not None:
            self._watcher.set_poll_interval(config.poll_interval_seconds)
            self._sync_roots()
        self._slot_free.set()
        self._sweep_now.set()

    def summary(self) -> tuple[int, int]:
        """(roots watched, roots whose latest checkpoint is not valid)."""
        return len(self._roots()), self.stats.not_valid()

    def roots(self) -> list[str]:
        """The roots wanted now, configured and announced, sorted."""
        return sorted(self._roots())

    # -- roots ------------------------------------------------------------------
    def _roots(self) -> dict[str, str]:
        """Root path -> configured observer (announced roots use the section's)."""
        roots = {root.path: root.observer if root.observer != "auto" else self.config.observer
                 for root in self.config.roots}
        for path in self._announced:
            roots.setdefault(path, self.config.observer)
        return roots

    def _sync_roots(self) -> None:
        mounts = self._mounts if self._mounts is not None else read_mounts()
        wanted = {path: choose_observer(path, observer, mounts) for path, observer in self._roots().items()}
        assert self._watcher is not None
        for root in set(self._wanted) - set(wanted):
            self._watcher.unwatch(root)
            log.info("stopped watching a checkpoint root", root=root)
        self._wanted = wanted
        labels = {self._label(root) for root in wanted}
        for label in labels:
            self.stats.root(label)
        # A root no longer configured or announced (restored from the state
        # store, removed on SIGHUP, expired) must not export frozen series forever.
        self.stats.retain(labels | {OTHER})
        self._rewatch()

    def _expire_announced(self) -> None:
        """Forget announced roots that no job has announced a save under for the TTL."""
        now = self._clock()
        expired = [root for root, last in self._announced.items()
                   if now - last > self.config.announced_root_ttl_seconds]
        for root in expired:
            del self._announced[root]
            assert self._store is not None
            self._store.remove_announced_root(root)
            log.info("announced checkpoint root expired: no save announced under it for the TTL",
                     root=root, ttl_seconds=self.config.announced_root_ttl_seconds)
        if expired and self._watcher is not None:
            self._sync_roots()

    def _rewatch(self) -> None:
        """Schedule every wanted root that is not watched (new, failed before, or deleted)."""
        assert self._watcher is not None
        watched = self._watcher.watched()
        for root, kind in self._wanted.items():
            if watched.get(root) == kind:
                continue
            error = self._watcher.watch(root, kind)
            if error is None:
                self._watch_errors.pop(root, None)
                log.info("watching checkpoint root", root=root, observer=kind)
            elif self._watch_errors.get(root) != error:
                # Logged once per reason; the sweep retries quietly.
                self._watch_errors[root] = error
                log.warning("cannot watch checkpoint root; retrying at each sweep", root=root, observer=kind,
                            error=error)

    def _root_of(self, path: str) -> str | None:
        best: str | None = None
        for root in self._roots():
            if (path == root or path.startswith(root.rstrip("/") + "/")) and (best is None or len(root) > len(best)):
                best = root
        return best

    def _label(self, root: str | None) -> str:
        return OTHER if root is None or root in self._folded else root

    # -- inputs -------------------------------------------------------------------
    def _on_watch_event(self, event: WatchEvent) -> None:
        if event.kind == "commit":
            self._commit(event.path)
            return
        assert self._watcher is not None
        self._watcher.unwatch(event.root)
        if event.kind == "backend_error" and self._wanted.get(event.root) == "inotify":
            # Most often the inotify watch limit: polling needs no watches.
            self._wanted[event.root] = "polling"
        log.warning("checkpoint root watch lost; retrying at each sweep", root=event.root, reason=event.kind,
                    error=event.detail, now_using=self._wanted.get(event.root))

    def announce(self, run: str, rank: int, saved: CheckpointSaved) -> None:
        """An agent saved a checkpoint; rank 0's announcement asks for its validation."""
        if not saved.validate:
            return
        path = os.path.normpath(saved.path)
        if not Path(path).is_absolute():
            log.info("announced checkpoint is not a local path; not validated", run=run, path=saved.path)
            return
        assert self._store is not None
        root = self._root_of(path)
        if root in self._announced:
            self._announced[root] = self._clock()
            self._store.touch_announced_root(root, self._announced[root])
        elif root is None:
            self._expire_announced()
            parent = str(Path(path).parent)
            if len(self._announced) < self.config.max_announced_roots:
                self._announced[parent] = self._clock()
                self._store.touch_announced_root(parent, self._announced[parent])
                self._folded.discard(parent)
                self._sync_roots()
            elif parent not in self._folded:
                self._folded.add(parent)
                log.warning("too many announced checkpoint roots; this one is validated but not watched and "
                            "its metrics use root=\"other\"", root=parent, run=run,
                            max_announced_roots=self.config.max_announced_roots)
        self._commit(path)

    def _commit(self, path: str) -> None:
        """`.metadata` appeared in `path`: validate once things have been quiet for a moment."""
        handle = self._debounce.pop(path, None)
        if handle is not None:
            handle.cancel()
        loop = asyncio.get_running_loop()
        self._debounce[path] = loop.call_later(self.config.debounce_seconds, self._enqueue, path)

    def _enqueue(self, path: str) -> None:
        self._debounce.pop(path, None)
        if path not in self._queued:
            self._queued.add(path)
            self._queue.put_nowait(path)

    # -- validation ---------------------------------------------------------------
    async def _dispatch(self) -> None:
        while True:
            path = await self._queue.get()
            while len(self._tasks) >= self.config.max_concurrent_validations:
                self._slot_free.clear()
                await self._slot_free.wait()
            self._queued.discard(path)
            if path in self._in_flight:
                # The running validation re-checks the key when it ends.
                continue
            self._in_flight.add(path)
            task = asyncio.create_task(self._validate(path), name=f"validate {path}")
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._finished, path))

    def _finished(self, path: str, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._in_flight.discard(path)
        self._slot_free.set()
        if not task.cancelled() and task.exception() is not None:
            log.error("checkpoint validation crashed", path=path, error=repr(task.exception()))

    async def _validate(self, path: str) -> None:
        found = await asyncio.to_thread(metadata_key, path)
        incomplete = found is None
        if found is None:
            key, committed_at = await asyncio.to_thread(_incomplete_key, path)
            if key is None:
                log.info("checkpoint vanished before validation", path=path)
                return
            if time.time() - committed_at < self.config.incomplete_after_seconds:
                # Its metadata went away (an overwrite in progress): not incomplete yet.
                return
        else:
            key, committed_at = found
        assert self._store is not None
        if self._store.key_of(path) == key:
            return
        root = self._root_of(path)
        level = Level.METADATA if incomplete else Level(self.config.level)
        started = time.monotonic()
        result = await checkpoint_runner.validate(path, level, self._limits())
        elapsed = time.monotonic() - started
        after = await asyncio.to_thread(metadata_key, path)
        if not incomplete and after is None and not await asyncio.to_thread(Path(path).exists):
            # Retention scripts delete old checkpoints all the time: not a finding, not an alert.
            log.info("checkpoint deleted during validation; result discarded", path=path, status=result.status.value)
            return
        if not incomplete and (after is None or after[0] != key):
            # Overwritten (or deleted) while it was read: that result describes nothing on disk.
            log.info("checkpoint changed during validation; validating again", path=path)
            self._enqueue(path)
            return
        self._record(path, root, key, committed_at, result, elapsed)

    def _limits(self) -> Limits:
        return Limits(timeout_seconds=self.config.validation_timeout_seconds,
                      memory_bytes=self.config.validation_memory_limit_bytes, idle_io=True, drop_cache=True)

    def _record(self, path: str, root: str | None, key: str, committed_at: float, result: ValidationResult,
                elapsed: float) -> None:
        findings = Counter((f.rule, f.severity.value) for f in result.findings)
        stats = result.stats
        record = Record(path=path, root=self._label(root), key=key, status=result.status.value,
                        level=result.level.value, validated_at=time.time(), committed_at=committed_at,
                        bytes=int(stats.get("bytes", 0)), duration_seconds=round(elapsed, 6),
                        findings=dict(findings))
        assert self._store is not None
        self._store.save(record)
        self.stats.record(record)
        level = "info" if result.status.value == "valid" else "warning"
        getattr(log, level)("checkpoint validated", path=path, root=record.root, status=record.status,
                            validation_level=record.level, findings=len(result.findings), bytes=record.bytes,
                            duration_seconds=record.duration_seconds,
                            first_finding=result.findings[0].message[:300] if result.findings else None)

    # -- sweeps -------------------------------------------------------------------
    def sweep_interval(self) -> float:
        return min(MAX_SWEEP_INTERVAL, max(0.5, self.config.incomplete_after_seconds / 4))

    async def _sweeps(self) -> None:
        while True:
            try:
                await self.sweep()
            except Exception:  # a bad root must not stop the sweeps of the others
                log.exception("checkpoint sweep failed; retrying")
            self._sweep_now.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._sweep_now.wait(), self.sweep_interval())

    async def sweep(self) -> None:
        """Catch up on what events missed, report stale uncommitted saves, re-watch lost roots."""
        self._expire_announced()
        self._rewatch()
        assert self._store is not None
        now = time.time()
        for root in list(self._wanted):
            result: Scan = await asyncio.to_thread(scan, root)
            for ckpt in sorted(result.committed, key=lambda c: -c.committed_at):
                if self._store.key_of(ckpt.path) != ckpt.key and ckpt.path not in self._debounce:
                    self._enqueue(ckpt.path)
            stale = [u for u in result.uncommitted if now - u.newest_write >= self.config.incomplete_after_seconds]
            self.stats.root(self._label(root)).incomplete = len(stale)
            for save in stale:
                if self._store.key_of(save.path) != _incomplete_key_for(save.newest_write):
                    self._enqueue(save.path)
        if time.monotonic() - self._pruned_at >= PRUNE_INTERVAL:
            self._pruned_at = time.monotonic()
            await self.prune()

    async def prune(self) -> None:
        """Forget the records of checkpoint directories deleted since (a job's retention policy)."""
        assert self._store is not None
        rows = self._store.prunable()
        gone = await asyncio.to_thread(deleted, [path for path, _ in rows])
        forgotten = [row for row, is_gone in zip(rows, gone, strict=True) if is_gone]
        if forgotten:
            self._store.forget(forgotten)
            log.info("forgot the records of deleted checkpoints", count=len(forgotten))


def _incomplete_key_for(newest_write: float) -> str:
    return f"incomplete:{newest_write!r}"


def _incomplete_key(path: str) -> tuple[str | None, float]:
    """Key of a save that never committed: its newest data file's mtime."""
    try:
        mtimes = [entry.stat().st_mtime for entry in Path(path).iterdir() if entry.name.endswith(DATA_SUFFIXES)]
    except OSError:
        return None, 0.0
    if not mtimes:
        return None, 0.0
    return _incomplete_key_for(max(mtimes)), max(mtimes)
