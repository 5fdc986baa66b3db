"""Validation results: recorded in the state store and exported, and forgotten once their checkpoint is gone.

A result the state store cannot write (a full or read-only disk) is remembered in memory, so that the
checkpoint is not validated again at every sweep.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping

import structlog

from torchpulse.checkpoints.model import ValidationResult
from torchpulse.daemon.checkpoints.scan import deleted
from torchpulse.daemon.checkpoints.state import Record, StateStore
from torchpulse.daemon.checkpoints.stats import CheckpointStats
from torchpulse.daemon.offloop import off_loop

log = structlog.get_logger("torchpulse.daemon.checkpoints")


class Records:
    def __init__(self, store: StateStore, stats: CheckpointStats) -> None:
        self._store = store
        self._stats = stats
        self._unsaved: dict[str, str] = {}  # path -> validated key the state store could not write

    def known_key(self, path: str, recorded: Mapping[str, str] | None = None) -> str | None:
        """The key `path` was last validated with.

        `recorded`: the records of its root, read in one query (a sweep), instead of one query for `path`.
        """
        return self._unsaved.get(path) or (self._store.key_of(path) if recorded is None else recorded.get(path))

    def keys_under(self, root: str) -> dict[str, str]:
        return self._store.keys_under(root)

    def record(
        self,
        path: str,
        root_label: str,
        key: str,
        committed_at: float,
        result: ValidationResult,
        elapsed: float,
        export: bool = True,
    ) -> None:
        """Store a validation's result and, with `export`, count it in the series of `root_label` and log it."""
        # The true counts: `result.findings` lists at most validate.MAX_FINDINGS_PER_RULE of a rule.
        findings = result.finding_counts()
        record = Record(
            path=path,
            root=root_label,
            key=key,
            status=result.status.value,
            level=result.level.value,
            validated_at=time.time(),
            committed_at=committed_at,
            bytes=int(result.stats.get("bytes", 0)),
            duration_seconds=round(elapsed, 6),
            findings=findings,
        )
        if self._store.save(record):
            self._unsaved.pop(path, None)
        else:
            self._unsaved[path] = key
        if not export:
            return
        self._stats.record(record)
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

    async def prune(self, exported_labels: set[str]) -> None:
        """Forget the records of checkpoint directories deleted since (a job's retention policy)."""
        # Only exported roots keep their newest records: the others restore no series.
        rows = self._store.prunable(exported_labels)
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
