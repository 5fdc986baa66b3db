"""The checkpoint watcher: roots, announcements, debounce, bounded validation, sweeps.

Everything here runs on the daemon's event loop. Filesystem events arrive
from the watcher threads as `WatchEvent`s; agents' announcements arrive from
the agent server. A committed checkpoint is debounced, re-stat'ed, skipped
when its key (its metadata, and shards rewritten after it: `metadata_key`)
was validated before (also before a restart), and validated in a worker
process (`queue`, `validation`, `records`). A periodic sweep (`sweeps`) finds
what events missed. This class composes those parts and owns their lifecycle:
the state store and the watcher exist from `start` to `close`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from torchpulse.daemon.checkpoints.config import CheckpointsConfig
from torchpulse.daemon.checkpoints.log_once import LogOnce
from torchpulse.daemon.checkpoints.mounts import Mount, read_mounts
from torchpulse.daemon.checkpoints.paths import normalize, unusable_root, usable
from torchpulse.daemon.checkpoints.queue import ValidationQueue
from torchpulse.daemon.checkpoints.records import Records
from torchpulse.daemon.checkpoints.root_set import RootSet, label
from torchpulse.daemon.checkpoints.roots import RootWatches
from torchpulse.daemon.checkpoints.state import StateStore
from torchpulse.daemon.checkpoints.stats import CheckpointStats
from torchpulse.daemon.checkpoints.sweeps import Sweeps
from torchpulse.daemon.checkpoints.validation import Validation
from torchpulse.daemon.checkpoints.watcher import Watcher, WatchEvent
from torchpulse.daemon.offloop import off_loop
from torchpulse.protocol import CheckpointSaved

log = structlog.get_logger("torchpulse.daemon.checkpoints")


@dataclass(frozen=True)
class _Started:
    """The parts that need the state store or the watcher, which exist from start to close."""

    store: StateStore
    watcher: Watcher
    roots: RootSet
    watches: RootWatches
    sweeps: Sweeps


class CheckpointService:
    def __init__(
        self,
        config: CheckpointsConfig,
        state_dir: Path,
        mounts: list[Mount] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._clock = clock  # wall clock: announcement times outlive the process
        self.stats = CheckpointStats()
        self._state_dir = state_dir
        self._mounts = mounts
        self._log_once = LogOnce()
        self.queue = ValidationQueue(
            lambda: self.config.debounce_seconds, lambda: self.config.max_concurrent_validations
        )
        self._started: _Started | None = None
        self._catch_ups: set[asyncio.Task[None]] = set()
        self._background: list[asyncio.Task[None]] = []
        self._closing = False

    # -- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        store = StateStore(self._state_dir)
        watcher: Watcher | None = None
        try:
            self.stats.restore(store.latest_per_root(), store.last_valid_per_root())
            watcher = Watcher(
                asyncio.get_running_loop(), self._on_watch_event, self.config.poll_interval_seconds, self._read_mounts
            )
            await self._start(store, watcher)
        except BaseException:
            if self._started is None:  # out of close()'s reach: a failed start leaves no open state file
                if watcher is not None:
                    await off_loop(watcher.stop, "torchpulse-watch-stop")
                store.close()
            raise

    def _read_mounts(self) -> list[Mount]:
        return read_mounts() if self._mounts is None else list(self._mounts)

    async def _start(self, store: StateStore, watcher: Watcher) -> None:
        roots = RootSet(lambda: self.config, store, self.stats, self._clock, self._log_once)
        roots.restore()
        roots.expire()  # before the first sync of the watches: that sync covers it
        watches = RootWatches(watcher, roots.wanted, self._root_readable)
        records = Records(store, self.stats)
        sweeps = Sweeps(
            lambda: self.config,
            roots,
            watches,
            store,
            records,
            self.queue,
            self.stats,
            self._log_once,
            self._expire_announced,
        )
        validation = Validation(lambda: self.config, roots, records, self.queue.enqueue, self._log_once)
        self._started = _Started(store, watcher, roots, watches, sweeps)
        self._sync_roots()
        # Roots are usually watched when start returns; a hung mount delays the start a bounded time only.
        await watches.settle()
        self._background = [
            asyncio.create_task(self.queue.run(validation.validate), name="checkpoint-dispatch"),
            asyncio.create_task(sweeps.run(), name="checkpoint-sweep"),
        ]

    async def close(self) -> None:
        self._closing = True  # events still arriving from the watch threads start nothing
        started = self._started
        operations = started.watches.close() if started is not None else []
        tasks = [*self._background, *self.queue.stop(), *self._catch_ups, *operations]
        if started is not None:
            tasks += started.sweeps.running()
        for task in tasks:
            task.cancel()
        # Cancelling a validation kills its worker; unrecorded, it runs again after a restart.
        # A cancelled watch operation or scan goes on in its daemon thread; the watcher refuses it once stopped.
        await asyncio.gather(*tasks, return_exceptions=True)
        if started is not None:
            await off_loop(started.watcher.stop, "torchpulse-watch-stop")
            started.store.close()

    def apply_config(self, config: CheckpointsConfig) -> None:
        """SIGHUP: new roots, observers and limits apply at once; running validations finish."""
        self.config = config
        if self._started is not None:
            self._started.roots.apply_config()
            self._started.watcher.set_poll_interval(config.poll_interval_seconds)
            self._sync_roots()
            self._started.sweeps.soon()
        self.queue.limit_changed()

    def summary(self) -> tuple[int, int]:
        """(roots watched, roots whose latest checkpoint is not valid)."""
        return len(self._wanted()), self.stats.not_valid()

    def configured_roots(self) -> tuple[str, ...]:
        """The roots of the config, watched whoever owns them; an announcement's directory may be found there."""
        return tuple(root.path for root in self.config.roots)

    def roots(self) -> list[str]:
        """The roots wanted now, configured and announced, sorted."""
        return sorted(self._wanted())

    def state_persistent(self) -> bool | None:
        """Whether validation results go to the state file (False: memory only); None before start."""
        return None if self._started is None else self._started.store.persistent

    @property
    def store(self) -> StateStore | None:
        """The state store of results, from start to close."""
        return None if self._started is None else self._started.store

    @property
    def watcher(self) -> Watcher | None:
        """The filesystem watcher of the roots, from start to close."""
        return None if self._started is None else self._started.watcher

    @property
    def sweeps(self) -> Sweeps:
        assert self._started is not None, "the service has not started"
        return self._started.sweeps

    async def sweep(self) -> None:
        await self.sweeps.sweep()

    async def prune(self) -> None:
        await self.sweeps.prune()

    # -- roots ------------------------------------------------------------------
    def _wanted(self) -> dict[str, str]:
        if self._started is not None:
            return self._started.roots.wanted()
        return {root.path: root.observer for root in self.config.roots}

    def _sync_roots(self) -> None:
        assert self._started is not None
        roots, watches = self._started.roots, self._started.watches
        watches.sync()
        for root in watches.wanted:
            roots.export_announced(root)
        # A root no longer configured or announced (restored from the state
        # store, removed on SIGHUP, expired) must not export frozen series forever.
        self.stats.retain(roots.exported_labels())

    def _expire_announced(self) -> None:
        assert self._started is not None
        expired, other_expired = self._started.roots.expire()
        if expired or other_expired:
            self._sync_roots()

    def _root_readable(self, root: str, readable: bool) -> None:
        """A watch operation found whether `root` (a wanted root) can be read."""
        self.stats.root(label(root)).readable = readable

    # -- inputs -------------------------------------------------------------------
    def _on_watch_event(self, event: WatchEvent) -> None:
        if self._closing or self._started is None:
            return
        if event.kind == "commit":
            self._commit(event.path, event.root)
            return
        watcher, watches = self._started.watcher, self._started.watches
        if event.kind == "backend_error" and watcher.kind_of(event.root) == "inotify":
            # Most often the inotify watch limit (a deep tree's RecursionError too): polling needs no watches.
            watches.fall_back(event.root, event.detail)
        log.warning(
            "checkpoint root watch lost; retrying at each sweep",
            root=event.root,
            reason=event.kind,
            error=event.detail,
            now_using=watches.wanted.get(event.root),
        )
        # The lost watch no longer counts as watched; its replacement is scheduled off the loop.
        watches.reconcile(event.root)
        # A save committed between the loss and the new watch raised no event: scan once that watch is in place.
        task = asyncio.create_task(self._catch_up(event.root), name=f"catch up {event.root}")
        self._catch_ups.add(task)
        task.add_done_callback(self._catch_ups.discard)

    async def _catch_up(self, root: str) -> None:
        assert self._started is not None
        await self._started.watches.settle()
        if root in self._started.watches.wanted:
            self._started.sweeps.start_scan(root)

    def announce(self, run: str, rank: int, saved: CheckpointSaved) -> None:
        """An agent saved a checkpoint; rank 0's announcement asks for its validation.

        Never raises: the agent server calls this for whatever an agent sends.
        """
        try:
            self._announce(run, saved)
        except Exception:
            log.exception("checkpoint announcement failed", run=run, rank=rank, path=repr(saved.path))

    def _announce(self, run: str, saved: CheckpointSaved) -> None:
        if not saved.validate:
            return
        if "://" in saved.path and not saved.path.startswith("/"):
            # The probe passes fsspec URLs (s3://...) on as they are: nothing here to validate, and no warning
            # per save about it either.
            self._log_once(f"url {run}", "checkpoints saved to a URL are not validated", run=run, path=repr(saved.path))
            return
        path = normalize(saved.path)
        problem = unusable_root(path)
        if problem is not None:
            self._log_once(
                f"refused {path}",
                "announced checkpoint path refused; not validated",
                run=run,
                path=repr(saved.path),
                reason=problem,
            )
            return
        assert self._started is not None
        roots = self._started.roots
        if roots.root_of(path) is None:
            self._expire_announced()  # may make room for its parent
        if roots.announced_under(path, run):
            self._sync_roots()
        self._commit(path, roots.root_of(path))

    def _commit(self, path: str, root: str | None) -> None:
        if usable(path, self._log_once):
            self.queue.commit(path, root)
