"""The periodic sweep: finds what events missed (checkpoints committed while the daemon was down, saves that
never committed, roots that came back) and, hourly, forgets the records of deleted checkpoints.

At most one scan per root runs at a time, each in its own thread, awaited a bounded time only: a root on a
hung network mount stalls neither the loop nor the other roots.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from typing import Final

import structlog

from torchpulse.daemon.checkpoints.config import CheckpointsConfig
from torchpulse.daemon.checkpoints.log_once import LogOnce
from torchpulse.daemon.checkpoints.paths import incomplete_key_for, usable
from torchpulse.daemon.checkpoints.queue import ValidationQueue
from torchpulse.daemon.checkpoints.records import Records
from torchpulse.daemon.checkpoints.root_set import RootSet, label
from torchpulse.daemon.checkpoints.roots import RootWatches, log_crash
from torchpulse.daemon.checkpoints.scan import Scan, deleted, scan
from torchpulse.daemon.checkpoints.state import StateStore
from torchpulse.daemon.checkpoints.stats import CheckpointStats
from torchpulse.daemon.offloop import off_loop
from torchpulse.limits import SETTLE_SECONDS

log = structlog.get_logger("torchpulse.daemon.checkpoints")
MAX_SWEEP_INTERVAL: Final = 60.0
# Forgetting records of deleted checkpoints stats every recorded path: hourly is plenty.
PRUNE_INTERVAL: Final = 3600.0


class Sweeps:
    def __init__(
        self,
        config: Callable[[], CheckpointsConfig],
        roots: RootSet,
        watches: RootWatches,
        store: StateStore,
        records: Records,
        queue: ValidationQueue,
        stats: CheckpointStats,
        log_once: LogOnce,
        expire_announced: Callable[[], None],
    ) -> None:
        self._config = config
        self._roots = roots
        self._watches = watches
        self._store = store
        self._records = records
        self._queue = queue
        self._stats = stats
        self._log_once = log_once
        self._expire_announced = expire_announced  # expires announced roots and syncs the watches after
        self.scans: dict[str, asyncio.Task[None]] = {}  # root -> its scan in flight
        self.prune_task: asyncio.Task[None] | None = None
        self._pruned_at = -PRUNE_INTERVAL  # monotonic; the first sweep prunes
        self._now = asyncio.Event()

    def interval(self) -> float:
        return min(MAX_SWEEP_INTERVAL, max(0.5, self._config().incomplete_after_seconds / 4))

    def soon(self) -> None:
        """Sweep now rather than at the next interval (the config changed)."""
        self._now.set()

    async def run(self) -> None:
        while True:
            try:
                await self.sweep()
            except Exception:  # a bad root must not stop the sweeps of the others
                log.exception("checkpoint sweep failed; retrying")
            self._now.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._now.wait(), self.interval())

    async def sweep(self) -> None:
        """Catch up on what events missed, report stale uncommitted saves, re-watch lost roots."""
        self._expire_announced()
        # Watch, then scan: a checkpoint committed in between is seen by one or the other.
        self._watches.rewatch()
        await self._watches.settle()
        started = [self.start_scan(root) for root in list(self._watches.wanted)]
        scans = [task for task in started if task is not None]
        if scans:
            # Scans left running past SETTLE_SECONDS go on (a hung mount); their roots are skipped until they end.
            await asyncio.wait(scans, timeout=SETTLE_SECONDS)
        prune_running = self.prune_task is not None and not self.prune_task.done()
        if time.monotonic() - self._pruned_at >= PRUNE_INTERVAL and not prune_running:
            self._pruned_at = time.monotonic()
            # In the background: it stats every recorded path, and one of them may be on a hung mount.
            self.prune_task = asyncio.create_task(self.prune(), name="checkpoint-prune")
            self.prune_task.add_done_callback(functools.partial(log_crash, message="checkpoint prune failed"))

    async def prune(self) -> None:
        await self._records.prune(self._roots.exported_labels())

    def start_scan(self, root: str) -> asyncio.Task[None] | None:
        if root in self.scans:
            return None  # the previous scan still runs (a hung mount): skipped, not waited for
        task = asyncio.create_task(self._scan_root(root), name=f"scan {root}")
        self.scans[root] = task
        task.add_done_callback(functools.partial(self._scan_done, root))
        return task

    def running(self) -> list[asyncio.Task[None]]:
        """The scans and the prune in flight, for close to cancel."""
        return [*self.scans.values(), *([] if self.prune_task is None else [self.prune_task])]

    def _scan_done(self, root: str, task: asyncio.Task[None]) -> None:
        self.scans.pop(root, None)
        log_crash(task, "checkpoint root scan failed", root=root)

    async def _scan_root(self, root: str) -> None:
        result: Scan = await off_loop(functools.partial(scan, root), f"torchpulse-scan {root}")
        if root not in self._watches.wanted:
            return  # dropped while it ran: its series are gone and stay gone
        # One query for the root's records, on the loop: a lookup per directory blocked it ~0.2 s at 8,200.
        recorded = self._records.keys_under(root)
        found = [
            (ckpt.committed_at, ckpt.path)
            for ckpt in result.committed
            if usable(ckpt.path, self._log_once)
            and self._records.known_key(ckpt.path, recorded) != ckpt.key
            and not self._queue.debouncing(ckpt.path)
        ]
        now = time.time()
        stale = [u for u in result.uncommitted if now - u.settled_at >= self._config().incomplete_after_seconds]
        self._stats.root(label(root)).incomplete = len(stale)
        found += [
            (save.newest_write, save.path)
            for save in stale
            if usable(save.path, self._log_once)
            and self._records.known_key(save.path, recorded) != incomplete_key_for(save.newest_write)
        ]
        for path in result.unvalidated:
            # Hugging Face Trainer `checkpoint-N/`, `save_pretrained` output: safetensors without a DCP commit.
            self._log_once(
                f"not dcp {path}",
                "not a DCP checkpoint (safetensors, no .metadata): not validated",
                level="info",
                path=path,
                root=root,
            )
        for _, path in sorted(found):  # oldest first: the newest is validated next
            self._queue.enqueue(path, root)
        present = {ckpt.path for ckpt in result.committed} | {save.path for save in result.uncommitted}
        await self._follow_a_deleted_latest(root, present)

    async def _follow_a_deleted_latest(self, root: str, present: set[str]) -> None:
        """When the root's latest checkpoint was deleted, its newest one left becomes the latest."""
        root_label = label(root)
        latest = self._stats.root(root_label).latest_path
        if latest is None or latest in present:
            return
        (gone,) = await off_loop(functools.partial(deleted, [latest]), "torchpulse-deleted")
        if not gone:  # out of reach (an unmounted filesystem, permissions): not known to be deleted
            return
        if root not in self._watches.wanted or self._stats.root(root_label).latest_path != latest:
            return  # dropped, or a newer result came in, while it looked
        newest = self._store.newest_of_root(root_label, present)
        self._stats.latest_deleted(root_label, newest)
        log.info(
            "the latest checkpoint was deleted: the newest one left is the root's latest now",
            deleted=latest,
            latest=None if newest is None else newest.path,
            root=root_label,
        )
