"""One queued checkpoint, judged: re-stat'ed, skipped when its key was validated before, validated in a
worker process, and recorded only when nothing on disk changed while the worker read it."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import structlog

from torchpulse.checkpoints.model import Level
from torchpulse.checkpoints.worker import Limits
from torchpulse.daemon.checkpoints import runner as checkpoint_runner
from torchpulse.daemon.checkpoints.config import CheckpointsConfig
from torchpulse.daemon.checkpoints.log_once import LogOnce
from torchpulse.daemon.checkpoints.paths import incomplete_key_for, newest_data, uncommitted_save
from torchpulse.daemon.checkpoints.records import Records
from torchpulse.daemon.checkpoints.root_set import RootSet, label
from torchpulse.daemon.checkpoints.scan import metadata_key
from torchpulse.daemon.offloop import off_loop

log = structlog.get_logger("torchpulse.daemon.checkpoints")
T = TypeVar("T")


class Validation:
    def __init__(
        self,
        config: Callable[[], CheckpointsConfig],
        roots: RootSet,
        records: Records,
        enqueue: Callable[[str, str | None], None],
        log_once: LogOnce,
    ) -> None:
        self._config = config
        self._roots = roots
        self._records = records
        self._enqueue = enqueue  # asks for one more validation of a path, once this one ended
        self._log_once = log_once

    async def validate(self, path: str, found_under: str | None) -> None:
        if self._roots.dropped(path, found_under):
            log.info(
                "checkpoint root no longer watched; its queued checkpoint is not validated", path=path, root=found_under
            )
            return
        found = await _stat(metadata_key, path)
        incomplete = found is None
        if found is None:
            save = await _stat(uncommitted_save, path)
            if save is None:
                await self._not_a_save(path)
                return
            if time.time() - save.settled_at < self._config().incomplete_after_seconds:
                # Its metadata went away (an overwrite committing, retention deleting it): not incomplete yet.
                return
            key, committed_at = incomplete_key_for(save.newest_write), save.newest_write
        else:
            key, committed_at = found
        if self._records.known_key(path) == key:
            return
        data_before = await _stat(newest_data, path)
        if not incomplete and self._overwrite_pending(committed_at, data_before):
            # Its shards are being rewritten under the old metadata: judged when the save commits (a new
            # metadata), or by a sweep once they have been quiet for incomplete_after_seconds (a crashed one).
            # Its key carries the newest shard's mtime, so a sweep brings it back here even when this metadata
            # was validated before, and it is validated once (not at each sweep) when the shards stay quiet.
            return
        root = self._roots.root_of(path)
        level = Level.METADATA if incomplete else Level(self._config().level)
        started = time.monotonic()
        result = await checkpoint_runner.validate(path, level, _limits(self._config()))
        elapsed = time.monotonic() - started
        after = await _stat(metadata_key, path)
        if after is None and not await off_loop(Path(path).exists, "torchpulse-stat"):
            # Retention scripts delete old checkpoints all the time: not a finding, not an alert.
            log.info("checkpoint deleted during validation; result discarded", path=path, status=result.status.value)
            return
        if not incomplete and (after is None or after[0] != key):
            # Overwritten (or deleted) while it was read: that result describes nothing on disk.
            log.info("checkpoint changed during validation; validating again", path=path)
            self._enqueue(path, found_under)  # once this one has ended
            return
        if await _stat(newest_data, path) != data_before:
            # The next save rewrites its shards in place: the worker read a mix of two saves. Its commit (a new
            # metadata) brings it back; a sweep does, should that save crash.
            log.info(
                "checkpoint data rewritten during validation; result discarded", path=path, status=result.status.value
            )
            return
        if self._roots.dropped(path, found_under):
            # Kept in the state store (not validated again should its root come back), exported nowhere.
            log.info(
                "checkpoint root stopped being watched during its validation; result not exported",
                path=path,
                root=root,
                status=result.status.value,
            )
            self._records.record(path, label(root), key, committed_at, result, elapsed, export=False)
            return
        # The root now (a SIGHUP may have removed a nested root while this ran; the outer one takes it).
        self._records.record(path, label(self._roots.root_of(path)), key, committed_at, result, elapsed)

    def _overwrite_pending(self, committed_at: float, newest_data: float | None) -> bool:
        """Whether shards newer than the metadata were written too recently to call the save crashed.

        Such shards are an overwrite in place under way, or one that crashed before its new metadata (the
        validator's TP-CKPT-004) once they have been quiet for incomplete_after_seconds.
        """
        return (
            newest_data is not None
            and newest_data > committed_at
            and time.time() - newest_data < self._config().incomplete_after_seconds
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


async def _stat(read: Callable[[str], T], path: str) -> T:
    """`read(path)` off the loop: a stat on a hung mount must not stall it."""
    return await off_loop(functools.partial(read, path), "torchpulse-stat")


def _limits(config: CheckpointsConfig) -> Limits:
    return Limits(
        timeout_seconds=config.validation_timeout_seconds,
        memory_bytes=config.validation_memory_limit_bytes,
        idle_io=True,
        drop_cache=True,
    )
