"""What the checkpoint collector exports, kept per root label on the loop thread.

"Latest" is the newest committed checkpoint (by metadata mtime), not the
last one validated: a backlog validated after a restart must not make an old
checkpoint's status the root's current one.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field
from typing import Final

from torchpulse.daemon.checkpoints.state import FindingCounts, Record

STATUSES: Final = ("valid", "invalid", "incomplete", "error")
# Metadata-only runs take ~0.1 s; data-level reads of 100 GB shards take many minutes.
DURATION_BUCKETS: Final = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


@dataclass
class RootStats:
    validations: Counter[str] = field(default_factory=Counter)
    last_validation: float | None = None
    latest_committed: float | None = None
    # The directory of the latest checkpoint: deleted, it stops being the root's current one.
    latest_path: str | None = None
    last_status: str | None = None
    last_valid: float | None = None
    findings: FindingCounts = field(default_factory=dict)
    bytes: int = 0
    incomplete: int = 0
    # When a job last announced a save under this root; None for configured roots (watched regardless).
    last_announced: float | None = None
    # Whether the daemon can list the root, as its last watch operation found; None until one has ended.
    readable: bool | None = None


@dataclass
class DurationHistogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(DURATION_BUCKETS, seconds)] += 1
        self.total += seconds


class CheckpointStats:
    def __init__(self) -> None:
        self.roots: dict[str, RootStats] = {}
        self.durations: dict[str, DurationHistogram] = {}

    def root(self, label: str) -> RootStats:
        stats = self.roots.get(label)
        if stats is None:
            stats = self.roots[label] = RootStats()
        return stats

    def _set_latest(self, stats: RootStats, record: Record) -> None:
        if stats.latest_committed is None or record.committed_at >= stats.latest_committed:
            self._make_latest(stats, record)
        if record.status == "valid" and (stats.last_valid is None or record.committed_at > stats.last_valid):
            stats.last_valid = record.committed_at

    @staticmethod
    def _make_latest(stats: RootStats, record: Record | None) -> None:
        stats.latest_committed = None if record is None else record.committed_at
        stats.latest_path = None if record is None else record.path
        stats.last_status = None if record is None else record.status
        stats.findings = {} if record is None else dict(record.findings)
        stats.bytes = 0 if record is None else record.bytes

    def latest_deleted(self, label: str, newest_left: Record | None) -> None:
        """The latest checkpoint's directory is gone: the newest one left (None: none) is the latest now.

        Deleting a broken newest checkpoint is how an operator answers CheckpointInvalid; its status
        and findings must not stay exported until the next save. The last valid time stays.
        """
        self._make_latest(self.root(label), newest_left)

    def retain(self, labels: set[str]) -> None:
        """Drop the series of every root label not in `labels`."""
        for label in set(self.roots) - labels:
            del self.roots[label]

    def record(self, record: Record) -> None:
        """A validation that just finished."""
        stats = self.root(record.root)
        stats.validations[record.status] += 1
        stats.last_validation = record.validated_at
        self._set_latest(stats, record)
        self.durations.setdefault(record.level, DurationHistogram()).observe(record.duration_seconds)

    def restore(self, latest: list[Record], last_valid: dict[str, float]) -> None:
        """Gauges as they were before a restart (counters start again at zero, as counters do)."""
        for record in latest:
            stats = self.root(record.root)
            stats.last_validation = record.validated_at
            self._set_latest(stats, record)
        for label, committed_at in last_valid.items():
            stats = self.root(label)
            stats.last_valid = max(stats.last_valid or 0.0, committed_at)

    def not_valid(self) -> int:
        """Roots whose latest checkpoint is not valid (for systemd's STATUS= line)."""
        return sum(1 for s in self.roots.values() if s.last_status not in (None, "valid"))
