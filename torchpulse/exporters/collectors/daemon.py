"""The daemon's own health: build, uptime, connections, ingest and rejections."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from torchpulse.daemon.runs import RunsView
from torchpulse.protocol import PROTOCOL_VERSION
from torchpulse.version import __version__

# Listed even at zero so that alerts on them have a series to watch.
FRAME_REJECT_REASONS = (
    "bad_magic",
    "version_mismatch",
    "oversized",
    "decode_error",
    "invalid_frame",
    "unknown_type",
    "truncated",
    "no_hello",
    "unexpected_type",
    "timeout",
    "rank_taken",
    "run_owned",
)

SERIES_REJECT_REASONS = (
    "unknown_family",
    "bad_shape",
    "bad_buckets",
    "bad_value",
    "label_too_long",
    "run_series_limit",
)


class DaemonCollector:
    name = "daemon"

    def __init__(self, registry: RunsView) -> None:
        self.registry = registry
        self.started_at = time.time()

    def collect(self) -> Iterator[Metric]:
        reg = self.registry
        build = GaugeMetricFamily(
            "torchpulse_build_info", "torchpulse version; always 1.", labels=["version", "protocol_version"]
        )
        build.add_metric([__version__, str(PROTOCOL_VERSION)], 1.0)
        yield build
        yield GaugeMetricFamily(
            "torchpulse_daemon_start_time_seconds", "Unix time the daemon started.", value=self.started_at
        )
        yield GaugeMetricFamily(
            "torchpulse_daemon_connections", "Open agent connections.", value=float(reg.connections)
        )
        runs, _ranks = reg.counts()
        yield GaugeMetricFamily("torchpulse_daemon_runs", "Runs with at least one connected rank.", value=float(runs))
        yield CounterMetricFamily(
            "torchpulse_daemon_events_received",
            "Series updates and log events received from agents.",
            value=float(reg.events_received),
        )
        rejected = CounterMetricFamily(
            "torchpulse_daemon_frames_rejected",
            "Frames refused (the connection is closed), by reason.",
            labels=["reason"],
        )
        for reason in sorted(set(FRAME_REJECT_REASONS) | set(reg.frames_rejected)):
            rejected.add_metric([reason], float(reg.frames_rejected.get(reason, 0)))
        yield rejected
        series = CounterMetricFamily(
            "torchpulse_daemon_series_rejected",
            "Series updates refused, by reason: unknown_family, bad_shape, bad_buckets, "
            "bad_value (a counter that is NaN, Inf or negative), label_too_long, "
            "run_series_limit.",
            labels=["reason"],
        )
        for reason in sorted(set(SERIES_REJECT_REASONS) | set(reg.series_rejected)):
            series.add_metric([reason], float(reg.series_rejected.get(reason, 0)))
        yield series
