"""Checkpoint validation results per root, from the daemon's checkpoint watcher, and whether its state persists."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import accumulate

from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from torchpulse.daemon.checkpoints.stats import DURATION_BUCKETS, STATUSES, CheckpointStats
from torchpulse.exporters.collectors import counter, gauge, histogram


class CheckpointCollector:
    name = "checkpoints"

    def __init__(self, stats: CheckpointStats, state_persistent: Callable[[], bool | None] = lambda: None) -> None:
        self.stats = stats
        # The checkpoint state is all the daemon keeps in its state directory.
        self.state_persistent = state_persistent

    def collect(self) -> Iterator[Metric]:
        validations = counter("checkpoint_validations_total")
        last_validation = gauge("checkpoint_last_validation_timestamp_seconds")
        last_status, last_valid = gauge("checkpoint_last_status"), gauge("checkpoint_last_valid_timestamp_seconds")
        findings, size = gauge("checkpoint_findings"), gauge("checkpoint_bytes")
        incomplete, announced = gauge("checkpoint_incomplete"), gauge("checkpoint_last_announced_timestamp_seconds")
        readable = gauge("checkpoint_root_readable")
        for root, stats in sorted(self.stats.roots.items()):
            if stats.last_announced is not None:
                announced.add_metric([root], stats.last_announced)
            if stats.readable is not None:
                readable.add_metric([root], 1.0 if stats.readable else 0.0)
            for status in STATUSES:
                # Listed at zero so that increase() alerts have a series from the start.
                validations.add_metric([root, status], float(stats.validations.get(status, 0)))
            incomplete.add_metric([root], float(stats.incomplete))
            if stats.last_validation is not None:
                last_validation.add_metric([root], stats.last_validation)
            if stats.last_status is not None:
                for status in STATUSES:
                    last_status.add_metric([root, status], 1.0 if status == stats.last_status else 0.0)
                size.add_metric([root], float(stats.bytes))
            if stats.last_valid is not None:
                last_valid.add_metric([root], stats.last_valid)
            for (rule, severity), count in sorted(stats.findings.items()):
                findings.add_metric([root, rule, severity], float(count))
        yield from (
            validations,
            last_validation,
            last_status,
            last_valid,
            findings,
            size,
            incomplete,
            announced,
            readable,
        )
        yield self._durations()
        persistent = self.state_persistent()
        if persistent is not None:
            yield gauge("daemon_state_persistent", 1.0 if persistent else 0.0)

    def _durations(self) -> Metric:
        family = histogram("checkpoint_validation_duration_seconds")
        bounds = [floatToGoString(b) for b in DURATION_BUCKETS] + ["+Inf"]  # type: ignore[no-untyped-call]
        for level, durations in sorted(self.stats.durations.items()):
            cumulative = list(accumulate(durations.counts))
            family.add_metric([level], list(zip(bounds, map(float, cumulative), strict=True)), durations.total)
        return family
