"""Every series the agents sent, exposed under its catalog family with run and rank added."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import accumulate

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from torchpulse.catalog import CATALOG, Family
from torchpulse.daemon.registry import Registry


def _empty_family(family: Family) -> Metric:
    labels = ["run", "rank", *family.labels]
    if family.kind == "counter":
        return CounterMetricFamily(family.exposed_name, family.help, labels=labels)
    if family.kind == "gauge":
        return GaugeMetricFamily(family.exposed_name, family.help, labels=labels)
    return HistogramMetricFamily(family.exposed_name, family.help, labels=labels)


class AgentSeriesCollector:
    name = "agent_series"

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._bounds = {
            name: [floatToGoString(b) for b in family.buckets] + ["+Inf"]
            for name, family in CATALOG.items() if family.kind == "histogram"
        }

    def collect(self) -> Iterator[Metric]:
        metrics: dict[str, Metric] = {}
        for run in self.registry.runs.values():
            for rank, state in run.ranks.items():
                prefix = [run.name, str(rank)]
                for (name, labels), value in state.values.items():
                    metric = metrics.get(name)
                    if metric is None:
                        metric = metrics[name] = _empty_family(CATALOG[name])
                    metric.add_metric([*prefix, *labels], value)  # type: ignore[attr-defined]
                for (name, labels), (counts, total) in state.histograms.items():
                    metric = metrics.get(name)
                    if metric is None:
                        metric = metrics[name] = _empty_family(CATALOG[name])
                    buckets = list(zip(self._bounds[name], accumulate(counts), strict=True))
                    metric.add_metric([*prefix, *labels], buckets, total)  # type: ignore[attr-defined]
        yield from metrics.values()
