"""The scrape: every collector run under supervision on an explicit registry.

The supervisor times each collector and reports
`torchpulse_scrape_collector_duration_seconds{collector}` and
`torchpulse_scrape_collector_success{collector}`; a collector that raises
contributes nothing but never fails the scrape.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from torchpulse.daemon.registry import Registry
from torchpulse.exporters.collectors import NamedCollector
from torchpulse.exporters.collectors.agents import AgentsCollector
from torchpulse.exporters.collectors.daemon import DaemonCollector
from torchpulse.exporters.collectors.series import AgentSeriesCollector

log = structlog.get_logger("torchpulse.exporters")


class SupervisedCollectors(Collector):
    def __init__(self, collectors: Sequence[NamedCollector]) -> None:
        self.collectors = list(collectors)

    def add(self, collector: NamedCollector) -> None:
        self.collectors.append(collector)

    def collect(self) -> Iterator[Metric]:
        duration = GaugeMetricFamily("torchpulse_scrape_collector_duration_seconds",
                                     "Time a collector took in this scrape.", labels=["collector"])
        success = GaugeMetricFamily("torchpulse_scrape_collector_success",
                                    "1 if the collector succeeded in this scrape.", labels=["collector"])
        for collector in self.collectors:
            start = time.perf_counter()
            try:
                # Materialise inside the try: a generator fails while it is consumed.
                metrics = list(collector.collect())
                ok = 1.0
            except Exception:
                log.exception("collector failed; scrape continues without it", collector=collector.name)
                metrics, ok = [], 0.0
            yield from metrics
            duration.add_metric([collector.name], time.perf_counter() - start)
            success.add_metric([collector.name], ok)
        yield duration
        yield success

    def describe(self) -> Iterable[Metric]:
        # Unchecked registration: families are built at scrape time.
        return []


def build_registry(registry: Registry, extra: Sequence[NamedCollector] = ()) -> tuple[CollectorRegistry, SupervisedCollectors]:
    """An explicit registry (never the global REGISTRY) holding the supervised collectors."""
    supervised = SupervisedCollectors(
        [DaemonCollector(registry), AgentsCollector(registry), AgentSeriesCollector(registry), *extra]
    )
    prom = CollectorRegistry(auto_describe=False)
    prom.register(supervised)
    return prom, supervised
