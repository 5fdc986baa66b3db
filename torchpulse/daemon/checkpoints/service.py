"""The checkpoint watcher: roots, announcements, debounce, bounded validation, sweeps.

Everything here runs on the daemon's event loop. Filesystem events arrive
from the watcher threads as `WatchEvent`s; agents' announcements arrive from
the agent server. A committed checkpoint is debounced, re-stat'ed, skipped
when its key (its metadata, and shards rewritten after it: `metadata_key`)
was validated before (also before a restart), and
validated in a worker process, at most `max_concurrent_validations` at once,
the newest first: when saves come faster than validations, the newest
checkpoint's status is what matters, and the backlog waits.
A periodic sweep finds what events missed: checkpoints committed while the
daemon was down, saves that never committed, roots that came back.

Anything that touches a root's filesystem (scheduling a watch walks the whole
tree) runs in its own thread, at most one watch operation and one scan per
root at a time, and is awaited for a bounded time only: a root on a hung
network mount stalls neither the loop nor the other roots.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

import structlog

from torchpulse.checkpoints.model import Level, ValidationResult
from torchpulse.checkpoints.worker import Limits
from torchpulse.daemon.checkpoints import runner as checkpoint_runner
from torchpulse.daemon.checkpoints.config import CheckpointsConfig
from torchpulse.daemon.checkpoints.mounts import Mount, read_mounts
from torchpulse.daemon.checkpoints.roots import SETTLE_SECONDS, RootWatches, log_crash
from torchpulse.daemon.checkpoints.scan import (
    Scan,
    Uncommitted,
    deleted,
    metadata_key,
    newest_data_write,
    scan,
    uncommitted,
)
from torchpulse.daemon.checkpoints.state import Record, StateStore
from torchpulse.daemon.checkpoints.stats import CheckpointStats
from torchpulse.daemon.checkpoints.watcher import Watcher, WatchEvent
from torchpulse.daemon.offloop import off_loop
from torchpulse.protocol import CheckpointSaved

log = structlog.get_logger("torchpulse.daemon.checkpoints")
OTHER: Final = "other"
MAX_SWEEP_INTERVAL: Final = 60.0
# Forgetting records of deleted checkpoints stats every recorded path: hourly is plenty.
PRUNE_INTERVAL: Final = 3600.0
# Longer paths cannot be opened (PATH_MAX).
MAX_PATH_BYTES: Final = 4095
# Distinct refused paths logged; an agent repeating a bad one logs it once.
MAX_LOGGED_ONCE: Final = 1024


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
        self._store: StateStore | None = None
        self._watcher: Watcher | None = None
        self._announced: dict[str, float] = {}  # announced root -> last announcement
        # Last announcement of a save validated under root="other" (past the cap, or directly under /); None:
        # none within the TTL, and no "other" series. It comes and goes like an announced root.
        self._other_announced: float | None = None
        self._watches: RootWatches | None = None
        self._scans: dict[str, asyncio.Task[None]] = {}  # root -> its scan in flight
        self._prune_task: asyncio.Task[None] | None = None
        # path -> validated key the state store could not write (full, read-only disk): not validated twice.
        self._unsaved: dict[str, str] = {}
        self._logged_once: set[str] = set()
        self._debounce: dict[str, asyncio.TimerHandle] = {}
        # Paths waiting for validation in the order they were found, the last next, each with the root it was
        # found under (None: announced outside every root, validated under "other").
        self._pending: dict[str, str | None] = {}
        self._has_pending = asyncio.Event()
        self._in_flight: set[str] = set()
        # Found again while being validated: checked once more when that validation ends (it may have read
        # the previous save). Path -> the root it was found under.
        self._again: dict[str, str | None] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._catch_ups: set[asyncio.Task[None]] = set()
        self._closing = False
        self._slot_free = asyncio.Event()
        self._sweep_now = asyncio.Event()
        self._background: list[asyncio.Task[None]] = []
        self._pruned_at = -PRUNE_INTERVAL  # monotonic; the first sweep prunes

    # -- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._store = StateStore(self._state_dir)
        self.stats.restore(self._store.latest_per_root(), self._store.last_valid_per_root())
        restored_other = self.stats.roots.get(OTHER)
        if restored_other is not None:
            # Not stored as such: its last validation followed its last announcement by the validation's time.
            self._other_announced = restored_other.last_validation
            restored_other.last_announced = self._other_announced
        stored = self._stored_announced_roots()
        self._announced = dict(stored[: self.config.max_announced_roots])
        self._forget_announced(stored[self.config.max_announced_roots :], "max_announced_roots was lowered")
        self._expire_announced()  # before the watcher exists: the one sync below covers it
        mounts: Callable[[], list[Mount]] = (
            read_mounts if self._mounts is None else functools.partial(list, self._mounts)
        )
        self._watcher = Watcher(loop, self._on_watch_event, self.config.poll_interval_seconds, mounts)
        self._watches = RootWatches(self._watcher, self._roots, self._root_readable)
        self._sync_roots()
        # Roots are usually watched when start returns; a hung mount delays the start a bounded time only.
        await self._watches.settle()
        self._background = [
            asyncio.create_task(self._dispatch(), name="checkpoint-dispatch"),
            asyncio.create_task(self._sweeps(), name="checkpoint-sweep"),
        ]

    def _stored_announced_roots(self) -> list[tuple[str, float]]:
        """Announced roots from the state store, most recent first, forgetting any that cannot be a root.

        Versions before the check stored whatever agents sent (a NUL byte, `/`);
        one such row made every start fail.
        """
        assert self._store is not None
        kept: list[tuple[str, float]] = []
        for root, last in self._store.announced_roots().items():
            problem = _unusable_root(root)
            if problem is None:
                kept.append((root, last))
                continue
            self._store.remove_announced_root(root)
            log.warning(
                "forgot a stored announced checkpoint root that cannot be watched", root=repr(root), reason=problem
            )
        return kept

    async def close(self) -> None:
        self._closing = True  # events still arriving from the watch threads start nothing
        operations = self._watches.close() if self._watches is not None else []
        for handle in self._debounce.values():
            handle.cancel()
        tasks = [*self._background, *self._tasks, *self._catch_ups, *operations, *self._scans.values()]
        if self._prune_task is not None:
            tasks.append(self._prune_task)
        for task in tasks:
            task.cancel()
        # Cancelling a validation kills its worker; unrecorded, it runs again after a restart.
        # A cancelled watch operation or scan goes on in its daemon thread; the watcher refuses it once stopped.
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._watcher is not None:
            await off_loop(self._watcher.stop, "torchpulse-watch-stop")
        if self._store is not None:
            self._store.close()

    def apply_config(self, config: CheckpointsConfig) -> None:
        """SIGHUP: new roots, observers and limits apply at once; running validations finish."""
        self.config = config
        if self._store is not None:
            # A lowered max_announced_roots keeps the roots announced most recently, as a start would.
            newest_first = sorted(self._announced.items(), key=lambda item: item[1], reverse=True)
            self._forget_announced(newest_first[config.max_announced_roots :], "max_announced_roots was lowered")
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

    def state_persistent(self) -> bool | None:
        """Whether validation results go to the state file (False: memory only); None before start."""
        return None if self._store is None else self._store.persistent

    # -- roots ------------------------------------------------------------------
    def _roots(self) -> dict[str, str]:
        """Root path -> configured observer (announced roots use the section's)."""
        roots = {
            root.path: root.observer if root.observer != "auto" else self.config.observer for root in self.config.roots
        }
        for path in self._announced:
            roots.setdefault(path, self.config.observer)
        return roots

    def _sync_roots(self) -> None:
        assert self._watches is not None
        self._watches.sync()
        for root in self._watches.wanted:
            self._export_announced(root)
        # A root no longer configured or announced (restored from the state
        # store, removed on SIGHUP, expired) must not export frozen series forever.
        self.stats.retain(self._exported_labels())

    def _exported_labels(self) -> set[str]:
        """Root labels whose series are exported now (and whose newest records the state store keeps)."""
        labels = {self._label(root) for root in self._roots()}
        return labels | {OTHER} if self._other_announced is not None else labels

    def _root_readable(self, root: str, readable: bool) -> None:
        """A watch operation found whether `root` (a wanted root) can be read."""
        self.stats.root(self._label(root)).readable = readable

    def _expire_announced(self) -> None:
        """Forget announced roots (and "other") that no job has announced a save under for the TTL."""
        now = self._clock()
        ttl = self.config.announced_root_ttl_seconds
        expired = [(root, last) for root, last in self._announced.items() if now - last > ttl]
        self._forget_announced(expired, "no save announced under it for the TTL")
        other_expired = self._other_announced is not None and now - self._other_announced > ttl
        if other_expired:
            # Otherwise its series, and NoValidCheckpointRecently on them, stay once the jobs past the cap ended.
            self._other_announced = None
            log.info('checkpoint root "other" expired: no save announced under it for the TTL', ttl_seconds=ttl)
        if (expired or other_expired) and self._watcher is not None:
            self._sync_roots()
        elif other_expired:
            self.stats.retain(self._exported_labels())

    def _forget_announced(self, roots: list[tuple[str, float]], reason: str) -> None:
        """Stop watching these announced roots (the caller syncs the watches) and forget them for good."""
        assert self._store is not None
        for root, _ in roots:
            self._announced.pop(root, None)
            self._store.remove_announced_root(root)
            log.info(
                "announced checkpoint root no longer watched",
                root=root,
                reason=reason,
                ttl_seconds=self.config.announced_root_ttl_seconds,
                max_announced_roots=self.config.max_announced_roots,
            )

    def _root_of(self, path: str) -> str | None:
        best: str | None = None
        for root in self._roots():
            if (path == root or path.startswith(root.rstrip("/") + "/")) and (best is None or len(root) > len(best)):
                best = root
        return best

    @staticmethod
    def _label(root: str | None) -> str:
        return OTHER if root is None else root

    # -- inputs -------------------------------------------------------------------
    def _on_watch_event(self, event: WatchEvent) -> None:
        if self._closing:
            return
        if event.kind == "commit":
            self._commit(event.path, event.root)
            return
        assert self._watcher is not None and self._watches is not None
        if event.kind == "backend_error" and self._watcher.kind_of(event.root) == "inotify":
            # Most often the inotify watch limit (a deep tree's RecursionError too): polling needs no watches.
            self._watches.fall_back(event.root, event.detail)
        log.warning(
            "checkpoint root watch lost; retrying at each sweep",
            root=event.root,
            reason=event.kind,
            error=event.detail,
            now_using=self._watches.wanted.get(event.root),
        )
        # The lost watch no longer counts as watched; its replacement is scheduled off the loop.
        self._watches.reconcile(event.root)
        # A save committed between the loss and the new watch raised no event: scan once that watch is in place.
        task = asyncio.create_task(self._catch_up(event.root), name=f"catch up {event.root}")
        self._catch_ups.add(task)
        task.add_done_callback(self._catch_ups.discard)

    async def _catch_up(self, root: str) -> None:
        assert self._watches is not None
        await self._watches.settle()
        if root in self._watches.wanted:
            self._start_scan(root)

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
        problem = _unusable_root(path)
        if problem is not None:
            self._log_once(
                f"refused {path}",
                "announced checkpoint path refused; not validated",
                run=run,
                path=repr(saved.path),
                reason=problem,
            )
            return
        assert self._store is not None
        root = self._root_of(path)
        if root in self._announced:
            self._touch_announced(root)
            self._export_announced(root)
        elif root is None:
            self._expire_announced()
            parent = str(Path(path).parent)
            folded = f"folded {parent}"
            if parent == "/":
                # Refused as a root: watching / recursively walks the whole machine (network mounts included)
                # and, a prefix of every path, / would swallow every later announcement. The checkpoint is
                # still validated (under root="other"); a later save there is announced, and validated, again.
                self._log_once(
                    f"top {path}",
                    "checkpoint saved directly under /: validated, its parent not watched",
                    run=run,
                    path=path,
                )
            elif len(self._announced) < self.config.max_announced_roots:
                self._touch_announced(parent)
                self._logged_once.discard(folded)  # folded again later (expired, slots full): news again
                self._sync_roots()
            else:
                # Warned once per directory through the bounded log-once set: one entry per folded directory
                # kept forever grew by one per job on a node that starts a new job every hour.
                self._log_once(
                    folded,
                    "too many announced checkpoint roots; this one is validated but not "
                    'watched and its metrics use root="other"',
                    root=parent,
                    run=run,
                    max_announced_roots=self.config.max_announced_roots,
                )
        if self._root_of(path) is None:
            self._other_announced = self._clock()
            self.stats.root(OTHER).last_announced = self._other_announced
        self._commit(path, self._root_of(path))

    def _export_announced(self, root: str) -> None:
        """Export when a job last announced a save under `root`; nothing for a configured root.

        The alert on old checkpoints leaves an announced root alone once its jobs stopped
        saving (they ended), as it cannot for a configured one.
        """
        configured = any(r.path == root for r in self.config.roots)
        self.stats.root(self._label(root)).last_announced = None if configured else self._announced.get(root)

    def _touch_announced(self, root: str) -> None:
        assert self._store is not None
        self._announced[root] = self._clock()
        self._store.touch_announced_root(root, self._announced[root])

    def _commit(self, path: str, root: str | None) -> None:
        """`.metadata` appeared in `path` under `root`: validate once things have been quiet for a moment."""
        if not self._usable(path):
            return
        handle = self._debounce.pop(path, None)
        if handle is not None:
            handle.cancel()
        loop = asyncio.get_running_loop()
        self._debounce[path] = loop.call_later(self.config.debounce_seconds, self._enqueue, path, root)

    def _enqueue(self, path: str, root: str | None) -> None:
        self._debounce.pop(path, None)
        if path in self._in_flight:
            self._again[path] = root
        elif path not in self._pending:
            self._pending[path] = root
            self._has_pending.set()

    def _dropped(self, path: str, found_under: str | None) -> bool:
        """Whether `path` was found under a root that is no longer watched (SIGHUP removed it, or it expired).

        Its series were dropped with the root; a validation recorded under the
        old label, or under "other", would bring back a frozen status, and an
        alert on it, that nothing updates any more.
        """
        return found_under is not None and self._root_of(path) is None

    # -- validation ---------------------------------------------------------------
    async def _dispatch(self) -> None:
        while True:
            # A slot first, then the path: one found while waiting may be newer.
            while len(self._tasks) >= self.config.max_concurrent_validations:
                self._slot_free.clear()
                await self._slot_free.wait()
            if not self._pending:
                self._has_pending.clear()
                await self._has_pending.wait()
                continue
            path = next(reversed(self._pending))
            found_under = self._pending.pop(path)
            self._in_flight.add(path)
            task = asyncio.create_task(self._validate(path, found_under), name=f"validate {path}")
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._finished, path))

    def _finished(self, path: str, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._in_flight.discard(path)
        self._slot_free.set()
        log_crash(task, "checkpoint validation crashed", path=path)
        if path in self._again:
            self._enqueue(path, self._again.pop(path))  # validated again only if its key changed

    def _log_once(self, key: str, event: str, level: str = "warning", **fields: object) -> None:
        if key in self._logged_once:
            return
        if len(self._logged_once) >= MAX_LOGGED_ONCE:
            self._logged_once.clear()
        self._logged_once.add(key)
        getattr(log, level)(event, **fields)

    def _usable(self, path: str) -> bool:
        """Whether a path found on disk can be validated and recorded (a non-UTF-8 name cannot)."""
        problem = _unusable(path)
        if problem is not None:
            self._log_once(
                f"unusable {path}", "checkpoint path cannot be recorded; not validated", path=repr(path), reason=problem
            )
        return problem is None

    def _known_key(self, path: str, recorded: Mapping[str, str] | None = None) -> str | None:
        """The key `path` was last validated with, remembered in memory when the state store refused it.

        `recorded`: the records of its root, read in one query (a sweep), instead of one query for `path`.
        """
        assert self._store is not None
        return self._unsaved.get(path) or (self._store.key_of(path) if recorded is None else recorded.get(path))

    async def _validate(self, path: str, found_under: str | None) -> None:
        if self._dropped(path, found_under):
            log.info(
                "checkpoint root no longer watched; its queued checkpoint is not validated", path=path, root=found_under
            )
            return
        found = await off_loop(functools.partial(metadata_key, path), "torchpulse-stat")
        incomplete = found is None
        if found is None:
            save = await off_loop(functools.partial(_uncommitted_save, path), "torchpulse-stat")
            if save is None:
                await self._not_a_save(path)
                return
            if time.time() - save.settled_at < self.config.incomplete_after_seconds:
                # Its metadata went away (an overwrite committing, retention deleting it): not incomplete yet.
                return
            key, committed_at = _incomplete_key_for(save.newest_write), save.newest_write
        else:
            key, committed_at = found
        if self._known_key(path) == key:
            return
        data_before = await off_loop(functools.partial(_newest_data, path), "torchpulse-stat")
        if not incomplete and self._overwrite_pending(committed_at, data_before):
            # Its shards are being rewritten under the old metadata: judged when the save commits (a new
            # metadata), or by a sweep once they have been quiet for incomplete_after_seconds (a crashed one).
            # Its key carries the newest shard's mtime, so a sweep brings it back here even when this metadata
            # was validated before, and it is validated once (not at each sweep) when the shards stay quiet.
            return
        root = self._root_of(path)
        level = Level.METADATA if incomplete else Level(self.config.level)
        started = time.monotonic()
        result = await checkpoint_runner.validate(path, level, self._limits())
        elapsed = time.monotonic() - started
        after = await off_loop(functools.partial(metadata_key, path), "torchpulse-stat")
        if after is None and not await off_loop(Path(path).exists, "torchpulse-stat"):
            # Retention scripts delete old checkpoints all the time: not a finding, not an alert.
            log.info("checkpoint deleted during validation; result discarded", path=path, status=result.status.value)
            return
        if not incomplete and (after is None or after[0] != key):
            # Overwritten (or deleted) while it was read: that result describes nothing on disk.
            log.info("checkpoint changed during validation; validating again", path=path)
            self._enqueue(path, found_under)  # once this one has ended
            return
        if await off_loop(functools.partial(_newest_data, path), "torchpulse-stat") != data_before:
            # The next save rewrites its shards in place: the worker read a mix of two saves. Its commit (a new
            # metadata) brings it back; a sweep does, should that save crash.
            log.info(
                "checkpoint data rewritten during validation; result discarded", path=path, status=result.status.value
            )
            return
        if self._dropped(path, found_under):
            # Kept in the state store (not validated again should its root come back), exported nowhere.
            log.info(
                "checkpoint root stopped being watched during its validation; result not exported",
                path=path,
                root=root,
                status=result.status.value,
            )
            self._record(path, root, key, committed_at, result, elapsed, export=False)
            return
        # The root now (a SIGHUP may have removed a nested root while this ran; the outer one takes it).
        self._record(path, self._root_of(path), key, committed_at, result, elapsed)

    def _overwrite_pending(self, committed_at: float, newest_data: float | None) -> bool:
        """Whether shards newer than the metadata were written too recently to call the save crashed.

        Such shards are an overwrite in place under way, or one that crashed before its new metadata (the
        validator's TP-CKPT-004) once they have been quiet for incomplete_after_seconds.
        """
        return (
            newest_data is not None
            and newest_data > committed_at
            and time.time() - newest_data < self.config.incomplete_after_seconds
        )

    async def _not_a_save(self, path: str) -> None:
        """`path` has neither a DCP `.metadata` nor `.distcp` files: deleted meanwhile, or not DCP at all."""
        if await off_loop(functools.partial(os.path.isdir, path), "torchpulse-stat"):
            # An announced Hugging Face layout (DCP's HuggingFaceStorageWriter writes no `.metadata`).
            self._log_once(
                f"not dcp {path}",
                "not a DCP checkpoint (no .metadata, no .distcp files): not validated",
                level="info",
                path=path,
            )
        else:
            log.info("checkpoint vanished before validation", path=path)

    def _limits(self) -> Limits:
        return Limits(
            timeout_seconds=self.config.validation_timeout_seconds,
            memory_bytes=self.config.validation_memory_limit_bytes,
            idle_io=True,
            drop_cache=True,
        )

    def _record(
        self,
        path: str,
        root: str | None,
        key: str,
        committed_at: float,
        result: ValidationResult,
        elapsed: float,
        export: bool = True,
    ) -> None:
        # The true counts: `result.findings` lists at most validate.MAX_FINDINGS_PER_RULE of a rule.
        findings = result.finding_counts()
        stats = result.stats
        record = Record(
            path=path,
            root=self._label(root),
            key=key,
            status=result.status.value,
            level=result.level.value,
            validated_at=time.time(),
            committed_at=committed_at,
            bytes=int(stats.get("bytes", 0)),
            duration_seconds=round(elapsed, 6),
            findings=findings,
        )
        assert self._store is not None
        if self._store.save(record):
            self._unsaved.pop(path, None)
        else:
            self._unsaved[path] = key
        if not export:
            return
        self.stats.record(record)
        level = "info" if result.status.value == "valid" else "warning"
        getattr(log, level)(
            "checkpoint validated",
            path=path,
            root=record.root,
            status=record.status,
            validation_level=record.level,
            findings=sum(findings.values()),
            bytes=record.bytes,
            duration_seconds=record.duration_seconds,
            first_finding=result.findings[0].message[:300] if result.findings else None,
        )

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
        # Watch, then scan: a checkpoint committed in between is seen by one or the other.
        assert self._watches is not None
        self._watches.rewatch()
        await self._watches.settle()
        started = [self._start_scan(root) for root in list(self._watches.wanted)]
        scans = [task for task in started if task is not None]
        if scans:
            # Scans left running past SETTLE_SECONDS go on (a hung mount); their roots are skipped until they end.
            await asyncio.wait(scans, timeout=SETTLE_SECONDS)
        prune_running = self._prune_task is not None and not self._prune_task.done()
        if time.monotonic() - self._pruned_at >= PRUNE_INTERVAL and not prune_running:
            self._pruned_at = time.monotonic()
            # In the background: it stats every recorded path, and one of them may be on a hung mount.
            self._prune_task = asyncio.create_task(self.prune(), name="checkpoint-prune")
            self._prune_task.add_done_callback(functools.partial(log_crash, message="checkpoint prune failed"))

    def _start_scan(self, root: str) -> asyncio.Task[None] | None:
        if root in self._scans:
            return None  # the previous scan still runs (a hung mount): skipped, not waited for
        task = asyncio.create_task(self._scan_root(root), name=f"scan {root}")
        self._scans[root] = task
        task.add_done_callback(functools.partial(self._scan_done, root))
        return task

    def _scan_done(self, root: str, task: asyncio.Task[None]) -> None:
        self._scans.pop(root, None)
        log_crash(task, "checkpoint root scan failed", root=root)

    async def _scan_root(self, root: str) -> None:
        result: Scan = await off_loop(functools.partial(scan, root), f"torchpulse-scan {root}")
        if self._watches is None or root not in self._watches.wanted or self._store is None:
            return  # dropped while it ran: its series are gone and stay gone
        # One query for the root's records, on the loop: a lookup per directory blocked it ~0.2 s at 8,200.
        recorded = self._store.keys_under(root)
        found = [
            (ckpt.committed_at, ckpt.path)
            for ckpt in result.committed
            if self._usable(ckpt.path)
            and self._known_key(ckpt.path, recorded) != ckpt.key
            and ckpt.path not in self._debounce
        ]
        now = time.time()
        stale = [u for u in result.uncommitted if now - u.settled_at >= self.config.incomplete_after_seconds]
        self.stats.root(self._label(root)).incomplete = len(stale)
        found += [
            (save.newest_write, save.path)
            for save in stale
            if self._usable(save.path)
            and self._known_key(save.path, recorded) != _incomplete_key_for(save.newest_write)
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
            self._enqueue(path, root)
        present = {ckpt.path for ckpt in result.committed} | {save.path for save in result.uncommitted}
        await self._follow_a_deleted_latest(root, present)

    async def _follow_a_deleted_latest(self, root: str, present: set[str]) -> None:
        """When the root's latest checkpoint was deleted, its newest one left becomes the latest."""
        label = self._label(root)
        latest = self.stats.root(label).latest_path
        if latest is None or latest in present or self._store is None:
            return
        (gone,) = await off_loop(functools.partial(deleted, [latest]), "torchpulse-deleted")
        if not gone:  # out of reach (an unmounted filesystem, permissions): not known to be deleted
            return
        if self._watches is None or root not in self._watches.wanted or self.stats.root(label).latest_path != latest:
            return  # dropped, or a newer result came in, while it looked
        newest = self._store.newest_of_root(label, present)
        self.stats.latest_deleted(label, newest)
        log.info(
            "the latest checkpoint was deleted: the newest one left is the root's latest now",
            deleted=latest,
            latest=None if newest is None else newest.path,
            root=label,
        )

    async def prune(self) -> None:
        """Forget the records of checkpoint directories deleted since (a job's retention policy)."""
        assert self._store is not None
        # Only exported roots keep their newest records: the others restore no series.
        rows = self._store.prunable(self._exported_labels())
        unsaved = list(self._unsaved)
        paths = [path for path, _ in rows] + unsaved
        gone = await off_loop(functools.partial(deleted, paths), "torchpulse-prune")
        forgotten = [row for row, is_gone in zip(rows, gone[: len(rows)], strict=True) if is_gone]
        if forgotten:
            self._store.forget(forgotten)
            log.info("forgot the records of deleted checkpoints", count=len(forgotten))
        for path, is_gone in zip(unsaved, gone[len(rows) :], strict=True):
            if is_gone:
                self._unsaved.pop(path, None)


def normalize(path: str) -> str:
    """The path the service validates and watches: `..` taken lexically, as `os.path.normpath` does."""
    path = os.path.normpath(path)
    # POSIX normpath keeps a leading "//"; to the kernel it is "/".
    return "/" + path.lstrip("/") if path.startswith("//") else path


def _unusable(path: str) -> str | None:
    """Why `path` cannot be a checkpoint directory or root here, or None when it can."""
    if "\0" in path:
        return "contains a NUL byte"
    if not path.startswith("/"):
        return "is not an absolute path"
    try:
        # SQLite and the metric labels take UTF-8 only; a lone surrogate (a non-UTF-8 name) cannot be stored.
        size = len(path.encode())
    except UnicodeEncodeError:
        return "is not valid UTF-8"
    if size > MAX_PATH_BYTES:
        return "is too long"
    return None


def _unusable_root(path: str) -> str | None:
    """Why an announced path cannot be taken (nor its parent made a root), or None when it can."""
    return _unusable(path) or ("is the filesystem root" if path == "/" else None)


def _incomplete_key_for(newest_write: float) -> str:
    return f"incomplete:{newest_write!r}"


def _names(path: str) -> list[str] | None:
    try:
        return [entry.name for entry in Path(path).iterdir()]
    except (OSError, ValueError):
        return None


def _uncommitted_save(path: str) -> Uncommitted | None:
    """`path` as a save that has not committed (as the sweep sees it), or None when it is none."""
    names = _names(path)
    return None if names is None else uncommitted(path, names)


def _newest_data(path: str) -> float | None:
    """mtime of the newest data file in `path`: an overwrite in place moves it."""
    names = _names(path)
    return None if names is None else newest_data_write(path, names)
