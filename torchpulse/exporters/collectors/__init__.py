"""One collector per file; `torchpulse.exporters.prometheus` registers them in one place."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from prometheus_client.metrics_core import Metric


class NamedCollector(Protocol):
    """A collector with a stable name for the per-collector self metrics."""

    name: str

    def collect(self) -> Iterable[Metric]: ...
