"""The scrape: every collector rendered under supervision into one exposition.

Collectors are of two kinds: prometheus_client-style collectors (`collect()`
yields metric families; each is rendered through its own explicit
`CollectorRegistry`, never the global one) and text collectors (`render()`
returns complete families in text format 0.0.4, for the one collector whose
size grows with the fleet). The supervisor times each collector and reports
`torchpulse_scrape_collector_duration_seconds{collector}` and
`torchpulse_scrape_collector_success{collector}`; a collector that raises
contributes nothing but never fails the scrape.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import structlog
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from torchpulse.daemon.runs import RunsView
from torchpulse.exporters.collectors import NamedCollector, gauge
from torchpulse.exporters.collectors.agents import AgentsCollector
from torchpulse.exporters.collectors.daemon import DaemonCollector
from torchpulse.exporters.collectors.series import AgentSeriesCollector

log = structlog.get_logger("torchpulse.exporters")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@runtime_checkable
class TextCollector(Protocol):
    name: str

    def render(self) -> str: ...


class _Fixed(Collector):
    """Hands already-collected families to generate_latest."""

    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self.metrics


def _registry_for(collector: NamedCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


class Exposition:
    def __init__(self, collectors: Sequence[NamedCollector | TextCollector]) -> None:
        self._entries: list[tuple[str, CollectorRegistry | TextCollector]] = []
        for collector in collectors:
            self.add(collector)

    def add(self, collector: NamedCollector | TextCollector) -> None:
        source = collector if isinstance(collector, TextCollector) else _registry_for(collector)
        self._entries.append((collector.name, source))

    def render(self) -> bytes:
        chunks: list[bytes] = []
        duration, success = gauge("scrape_collector_duration_seconds"), gauge("scrape_collector_success")
        for name, source in self._entries:
            start = time.perf_counter()
            try:
                if isinstance(source, CollectorRegistry):
                    chunks.append(generate_latest(source))
                else:
                    chunks.append(source.render().encode())
                ok = 1.0
            except Exception:
                log.exception("collector failed; scrape continues without it", collector=name)
                ok = 0.0
            duration.add_metric([name], time.perf_counter() - start)
            success.add_metric([name], ok)
        chunks.append(generate_latest(_Fixed([duration, success])))
        return b"".join(chunks)


def build_exposition(registry: RunsView, extra: Sequence[NamedCollector | TextCollector] = ()) -> Exposition:
    return Exposition([DaemonCollector(registry), AgentsCollector(registry), AgentSeriesCollector(registry), *extra])
