"""What the sender puts in a frame: the changes of one cycle cut into parts, each encoded as one `Batch`.

MAX_ITEMS_PER_FRAME keeps usual batches small, but 2,000 events with 4 KiB details (a recompile
storm's guard texts) exceed the daemon's frame limit: sent whole, the batch would fail to encode,
and its events be lost uncounted with the connection reset. So a frame over MAX_FRAME_BYTES is
halved until it fits, and one item that alone exceeds it is dropped and counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from torchpulse.limits import MAX_ITEMS_PER_FRAME
from torchpulse.protocol import Batch, FieldValue, FrameError, HistogramSample, LogEvent, Sample, encode, utf8

Part = tuple[list[Sample], list[HistogramSample], list[LogEvent]]


def split(samples: list[Sample], histograms: list[HistogramSample], events: list[LogEvent]) -> list[Part]:
    """The changes of one cycle in parts of at most MAX_ITEMS_PER_FRAME items."""
    if len(samples) + len(histograms) + len(events) <= MAX_ITEMS_PER_FRAME:
        return [(samples, histograms, events)]
    n = MAX_ITEMS_PER_FRAME
    parts: list[Part] = []
    parts += [(samples[i : i + n], [], []) for i in range(0, len(samples), n)]
    parts += [([], histograms[i : i + n], []) for i in range(0, len(histograms), n)]
    parts += [([], [], events[i : i + n]) for i in range(0, len(events), n)]
    return parts


def halves(part: Part) -> tuple[Part, Part]:
    """The items of `part` cut in two at the middle, in order (events keep theirs)."""
    samples, histograms, events = part
    rest = (len(samples) + len(histograms) + len(events)) // 2
    head_samples = samples[:rest]
    rest -= len(head_samples)
    head_histograms = histograms[:rest]
    rest -= len(head_histograms)
    head_events = events[:rest]
    return (
        (head_samples, head_histograms, head_events),
        (samples[len(head_samples) :], histograms[len(head_histograms) :], events[len(head_events) :]),
    )


class BatchEncoder:
    """Numbers the batches of one sender and encodes them; `on_oversized` counts an item dropped."""

    def __init__(self, on_oversized: Callable[[], None]) -> None:
        self._seq = 0
        self._on_oversized = on_oversized

    def encode(self, part: Part) -> list[tuple[bytes | None, int]]:
        """Frames for `part` with the events each carries (None in place of a dropped item's frame)."""
        self._seq += 1
        batch = Batch(self._seq, time.time(), *part)
        try:
            try:
                return [(encode(batch), len(part[2]))]
            except UnicodeEncodeError:
                # A surrogate-escaped byte from argv, a path or the environment: sent as "?".
                return [(encode(utf8_batch(batch)), len(part[2]))]
        except FrameError:
            if len(part[0]) + len(part[1]) + len(part[2]) <= 1:
                self._on_oversized()
                return [(None, len(part[2]))]
            first, second = halves(part)
            return self.encode(first) + self.encode(second)


def _utf8_value(value: FieldValue) -> FieldValue:
    return utf8(value) if isinstance(value, str) else value


def utf8_batch(batch: Batch) -> Batch:
    """`batch` with every string made encodable as UTF-8."""
    return Batch(
        batch.seq,
        batch.sent_at,
        [Sample(utf8(s.family), tuple(utf8(v) for v in s.labels), s.value) for s in batch.samples],
        [
            HistogramSample(utf8(h.family), tuple(utf8(v) for v in h.labels), h.bucket_counts, h.total)
            for h in batch.histograms
        ],
        [
            LogEvent(e.ts, utf8(e.level), utf8(e.event), {utf8(k): _utf8_value(v) for k, v in e.fields.items()})
            for e in batch.events
        ],
    )
