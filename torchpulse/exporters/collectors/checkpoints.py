"""Checkpoint validation results per root, from the daemon's checkpoint watcher, and whether its state persists."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import accumulate

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from torchpulse.daemon.checkpoints.stats import DURATION_BUCKETS, STATUSES, CheckpointStats


class CheckpointCollector:
    name = "checkpoints"

    def __init__(self, stats: CheckpointStats, state_persistent: Callable[[], bool | None] = lambda: None) -> None:
        self.stats = stats
        # The checkpoint state is all the daemon keeps in its state directory.
        self.state_persistent = state_persistent

    def collect(self) -> Iterator[Metric]:
        validations = CounterMetricFamily(
            "torchpulse_checkpoint_validations",
            "Checkpoint validations finished, by outcome.",
            labels=["root", "status"],
        )
        last_validation = GaugeMetricFamily(
            "torchpulse_checkpoint_last_validation_timestamp_seconds",
            "Unix time the last validation under the root finished.",
            labels=["root"],
        )
        last_status = GaugeMetricFamily(
            "torchpulse_checkpoint_last_status",
            "1 for the status of the root's newest checkpoint, 0 for the others.",
            labels=["root", "status"],
        )
        last_valid = GaugeMetricFamily(
            "torchpulse_checkpoint_last_valid_timestamp_seconds",
            "Commit time (metadata mtime) of the root's newest valid checkpoint.",
            labels=["root"],
        )
        findings = GaugeMetricFamily(
            "torchpulse_checkpoint_findings",
            "Findings of the root's newest checkpoint, by rule and severity.",
            labels=["root", "rule", "severity"],
        )
        size = GaugeMetricFamily(
            "torchpulse_checkpoint_bytes", "Bytes on disk of the root's newest checkpoint.", labels=["root"]
        )
        incomplete = GaugeMetricFamily(
            "torchpulse_checkpoint_incomplete",
            "Saves under the root with data files but no metadata past the timeout.",
            labels=["root"],
        )
        announced = GaugeMetricFamily(
            "torchpulse_checkpoint_last_announced_timestamp_seconds",
            "Unix time a job last announced a save under the root; only for roots "
            "watched because of announcements, not configured ones.",
            labels=["root"],
        )
        readable = GaugeMetricFamily(
            "torchpulse_checkpoint_root_readable",
            "1 when the daemon can list the root, 0 when it cannot (missing, not a directory, "
            "permission denied): nothing under it is watched or validated then.",
            labels=["root"],
        )
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
            yield GaugeMetricFamily(
                "torchpulse_daemon_state_persistent",
                "1 when checkpoint validation state is written to the state directory, 0 when it "
                "is kept in memory only and lost at a restart.",
                value=1.0 if persistent else 0.0,
            )

    def _durations(self) -> Metric:
        family = HistogramMetricFamily(
            "torchpulse_checkpoint_validation_duration_seconds",
            "Wall time of one checkpoint validation (worker start to result).",
            labels=["level"],
        )
        bounds = [floatToGoString(b) for b in DURATION_BUCKETS] + ["+Inf"]  # type: ignore[no-untyped-call]
        for level, histogram in sorted(self.stats.durations.items()):
            cumulative = list(accumulate(histogram.counts))
            family.add_metric([level], list(zip(bounds, map(float, cumulative), strict=True)), histogram.total)
        return family
