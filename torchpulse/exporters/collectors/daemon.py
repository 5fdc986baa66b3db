"""The daemon's own health: build, uptime, connections, ingest and rejections."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.metrics_core import Metric

from torchpulse.daemon.runs import RunsView
from torchpulse.exporters.collectors import counter, gauge
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
        build = gauge("build_info")
        build.add_metric([__version__, str(PROTOCOL_VERSION)], 1.0)
        yield build
        yield gauge("daemon_start_time_seconds", self.started_at)
        yield gauge("daemon_connections", float(reg.connections))
        runs, _ranks = reg.counts()
        yield gauge("daemon_runs", float(runs))
        yield counter("daemon_events_received_total", float(reg.events_received))
        rejected = counter("daemon_frames_rejected_total")
        for reason in sorted(set(FRAME_REJECT_REASONS) | set(reg.frames_rejected)):
            rejected.add_metric([reason], float(reg.frames_rejected.get(reason, 0)))
        yield rejected
        series = counter("daemon_series_rejected_total")
        for reason in sorted(set(SERIES_REJECT_REASONS) | set(reg.series_rejected)):
            series.add_metric([reason], float(reg.series_rejected.get(reason, 0)))
        yield series
