"""One collector per file; `torchpulse.exporters.prometheus` registers them in one place.

The daemon's own families are built from the catalog (`torchpulse.catalog.DAEMON_FAMILIES`), so that
their name, help and labels have one source, which docs/metrics.md is generated from too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from torchpulse.catalog import DAEMON_FAMILIES, Family, Kind


class NamedCollector(Protocol):
    """A collector with a stable name for the per-collector self metrics."""

    name: str

    def collect(self) -> Iterable[Metric]: ...


def _family(name: str, kind: Kind) -> Family:
    family = DAEMON_FAMILIES[name]
    if family.kind != kind:
        raise ValueError(f"{family.exposed_name} is a {family.kind} in the catalog, not a {kind}")
    return family


def gauge(name: str, value: float | None = None) -> GaugeMetricFamily:
    """The catalog's gauge `name` (no prefix): empty, for its labels' series, or holding an unlabelled `value`."""
    family = _family(name, "gauge")
    if value is not None:
        return GaugeMetricFamily(family.exposed_name, family.help, value=value)
    return GaugeMetricFamily(family.exposed_name, family.help, labels=list(family.labels))


def counter(name: str, value: float | None = None) -> CounterMetricFamily:
    """The catalog's counter `name` (no prefix, `_total` included), as `gauge` does it."""
    family = _family(name, "counter")
    if value is not None:
        return CounterMetricFamily(family.exposed_name, family.help, value=value)
    return CounterMetricFamily(family.exposed_name, family.help, labels=list(family.labels))


def histogram(name: str) -> HistogramMetricFamily:
    """The catalog's histogram `name` (no prefix), empty, for its labels' series."""
    family = _family(name, "histogram")
    return HistogramMetricFamily(family.exposed_name, family.help, labels=list(family.labels))
