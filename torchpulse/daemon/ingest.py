"""A batch applied to a rank's series: running totals overwrite, and what cannot be a value is refused.

Agents send running totals, so applying a batch is an overwrite, never an add: a resent or duplicated
batch changes nothing. A refused sample is counted by reason (torchpulse_daemon_series_rejected).
"""

from __future__ import annotations

import math
import time
from collections import Counter

from torchpulse.catalog import CATALOG
from torchpulse.daemon.histogram_layouts import Refused, rebucket
from torchpulse.daemon.runs import COUNTER_FAMILIES, RankState, RunState
from torchpulse.limits import MAX_LABEL_CHARS
from torchpulse.protocol import Batch


def apply_batch(run: RunState, state: RankState, batch: Batch, series_limit: int, rejected: Counter[str]) -> int:
    """Overwrite the rank's series with the batch's running totals; returns the updates and events received."""
    state.last_seen = time.monotonic()
    _apply_samples(run, state, batch, series_limit, rejected)
    _apply_histograms(run, state, batch, series_limit, rejected)
    received = len(batch.samples) + len(batch.histograms) + len(batch.events)
    state.events_received += received
    return received


def _apply_samples(run: RunState, state: RankState, batch: Batch, series_limit: int, rejected: Counter[str]) -> None:
    values = state.values
    for sample in batch.samples:
        key = (sample.family, sample.labels)
        value = sample.value
        if not 0.0 <= value < math.inf and sample.family in COUNTER_FAMILIES:
            # NaN, Inf or negative: not a count. Rendered, it would turn every rate() over the
            # series into NaN (or a reset); the last good total stays.
            rejected["bad_value"] += 1
            continue
        if key not in values:
            if not _admit(run, sample.family, sample.labels, False, series_limit, rejected):
                continue
            run.series += 1
        values[key] = sample.value
        if sample.family == "optimizer_steps_total" and sample.labels[0].endswith("#0"):
            _update_step_rate(state, sample.value)


def _apply_histograms(run: RunState, state: RankState, batch: Batch, series_limit: int, rejected: Counter[str]) -> None:
    histograms = state.histograms
    for hist in batch.histograms:
        if any(count < 0 for count in hist.bucket_counts):
            # Rendered cumulatively, a negative count makes `le` buckets decrease.
            rejected["bad_buckets"] += 1
            continue
        if not 0.0 <= hist.total < math.inf:
            # Every histogram in the catalog observes durations: a NaN, Inf or negative sum would
            # make rate(_sum) / rate(_count), the mean step time, NaN or a reset. The last good one stays.
            rejected["bad_value"] += 1
            continue
        counts = hist.bucket_counts
        plan = state.bucket_plan.get(hist.family)
        if plan is not None:
            if isinstance(plan, Refused) or len(counts) != len(plan):
                rejected["bad_buckets"] += 1
                continue
            counts = rebucket(counts, plan, len(CATALOG[hist.family].buckets) + 1)
        key = (hist.family, hist.labels)
        if key not in histograms:
            if not _admit(run, hist.family, hist.labels, True, series_limit, rejected):
                continue
            if len(counts) != len(CATALOG[hist.family].buckets) + 1:
                rejected["bad_buckets"] += 1
                continue
            run.series += 1
        elif len(counts) != len(histograms[key][0]):
            rejected["bad_buckets"] += 1
            continue
        histograms[key] = (counts, hist.total)


def _admit(
    run: RunState, name: str, labels: tuple[str, ...], histogram: bool, series_limit: int, rejected: Counter[str]
) -> bool:
    """Whether a new series may be held: a family of the catalog, of its shape, within the run's limit."""
    family = CATALOG.get(name)
    if family is None:
        rejected["unknown_family"] += 1
        return False
    if (family.kind == "histogram") != histogram or len(labels) != len(family.labels):
        rejected["bad_shape"] += 1
        return False
    if any(len(value) > MAX_LABEL_CHARS for value in labels):
        rejected["label_too_long"] += 1
        return False
    if run.series >= series_limit:
        run.series_rejected += 1
        rejected["run_series_limit"] += 1
        return False
    return True


def _update_step_rate(state: RankState, steps: float) -> None:
    if not math.isfinite(steps):
        return  # a buggy agent's inf/NaN must not poison the rate that traces are planned with
    now = time.monotonic()
    mark = state._rate_mark
    state._rate_mark = (now, steps)
    if mark is not None and now > mark[0] and steps >= mark[1]:
        rate = (steps - mark[1]) / (now - mark[0])
        state.step_rate = rate if state.step_rate == 0 else 0.7 * state.step_rate + 0.3 * rate
