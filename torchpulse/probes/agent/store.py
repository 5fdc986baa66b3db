"""Cumulative metric state kept inside the agent.

Only the agent's sender thread touches a store; `snapshot()`, a copy, may also
be read from another thread. Counters are running totals since the process
started, so a daemon that restarts (or a batch that is lost with a broken
connection) loses no counts: the next batch carries the totals.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Final

from torchpulse.catalog import CATALOG, Family
from torchpulse.protocol import HistogramSample, Sample

OTHER: Final = "other"
SeriesKey = tuple[str, tuple[str, ...]]


class _Histogram:
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        # Prometheus buckets are upper-inclusive (le), which bisect_left gives.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value


class MetricStore:
    """Counters, gauges and histograms keyed by family and label values."""

    def __init__(self) -> None:
        self._values: dict[SeriesKey, float] = {}
        self._histograms: dict[SeriesKey, _Histogram] = {}
        self._dirty: set[SeriesKey] = set()

    @staticmethod
    def _family(name: str, kind: str, labels: tuple[str, ...]) -> Family:
        family = CATALOG[name]
        if family.kind != kind or len(family.labels) != len(labels):
            raise ValueError(f"{name} is a {family.kind} with labels {family.labels}, not {kind} {labels}")
        return family

    def inc(self, name: str, labels: tuple[str, ...] = (), amount: float = 1.0) -> None:
        key = (name, labels)
        value = self._values.get(key)
        if value is None:
            self._family(name, "counter", labels)
            value = 0.0
        self._values[key] = value + amount
        self._dirty.add(key)

    def start_at_zero(self, name: str, label_sets: tuple[tuple[str, ...], ...] = ((),)) -> None:
        """Create counter series at 0 so their first increment is a visible change; a series that
        exists keeps its running total (a re-install or a resend must never reset a count).

        Prometheus' rate() and increase() cannot see the increment that created a series: a
        counter first exported at 1 reads as no change.
        """
        for labels in label_sets:
            key = (name, labels)
            if key not in self._values:
                self._family(name, "counter", labels)
                self._values[key] = 0.0
                self._dirty.add(key)

    def set(self, name: str, labels: tuple[str, ...], value: float) -> None:
        key = (name, labels)
        if key not in self._values:
            self._family(name, "gauge", labels)
        elif self._values[key] == value:
            return
        self._values[key] = value
        self._dirty.add(key)

    def observe(self, name: str, labels: tuple[str, ...], value: float) -> None:
        key = (name, labels)
        histogram = self._histograms.get(key)
        if histogram is None:
            family = self._family(name, "histogram", labels)
            histogram = self._histograms[key] = _Histogram(family.buckets)
        histogram.observe(value)
        self._dirty.add(key)

    def value(self, name: str, labels: tuple[str, ...] = ()) -> float | None:
        return self._values.get((name, labels))

    def snapshot(self) -> tuple[list[Sample], list[HistogramSample]]:
        """Every series as it stands, what a resend after `mark_all_dirty` would carry; the change marks stay as
        they are.

        Read-only, and a copy: each table is copied in one step (`dict.copy`) before it is read, so a reader on
        another thread (a job's or a test's, while the sender runs) never meets a table that changes size under
        it; the two tables are read one after the other, not as one view.
        """
        values, histograms = self._values.copy(), self._histograms.copy()
        samples = [Sample(name, labels, value) for (name, labels), value in values.items()]
        return samples, [
            HistogramSample(name, labels, tuple(histogram.counts), histogram.total)
            for (name, labels), histogram in histograms.items()
        ]

    def mark_all_dirty(self) -> None:
        """After a reconnect the daemon may know nothing: resend everything."""
        self._dirty.update(self._values)
        self._dirty.update(self._histograms)

    def take_changes(self) -> tuple[list[Sample], list[HistogramSample]]:
        """Return the series changed since the last call and forget the change marks."""
        samples: list[Sample] = []
        histograms: list[HistogramSample] = []
        for key in self._dirty:
            name, labels = key
            histogram = self._histograms.get(key)
            if histogram is None:
                samples.append(Sample(name, labels, self._values[key]))
            else:
                histograms.append(HistogramSample(name, labels, tuple(histogram.counts), histogram.total))
        self._dirty.clear()
        return samples, histograms

    def restore_changes(self, samples: list[Sample], histograms: list[HistogramSample]) -> None:
        """A batch that was not sent: mark its series changed again."""
        self._dirty.update((s.family, s.labels) for s in samples)
        self._dirty.update((h.family, h.labels) for h in histograms)


class BoundedLabel:
    """Maps free-form values to at most `limit` distinct label values plus `other`.

    The first values seen keep their own series; later ones fold into `other`.
    First-come rather than top-K by volume, because a counter series that was
    exported cannot be withdrawn later without breaking `rate()`.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._admitted: set[str] = set()
        self.folded = 0

    def __call__(self, value: str) -> str:
        if value in self._admitted:
            return value
        if len(self._admitted) < self.limit:
            self._admitted.add(value)
            return value
        self.folded += 1
        return OTHER
