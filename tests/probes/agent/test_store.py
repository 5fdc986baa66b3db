"""Cumulative agent state: running totals, change tracking, bounded labels."""

from __future__ import annotations

import pytest

from torchpulse.catalog import CATALOG
from torchpulse.probes.agent.store import OTHER, BoundedLabel, MetricStore


def test_counters_are_running_totals_and_changes_are_sent_once() -> None:
    """Two increments give a total of 2, reported once, then nothing until the next change."""
    store = MetricStore()
    store.inc("optimizer_steps_total", ("SGD#0",))
    store.inc("optimizer_steps_total", ("SGD#0",))
    samples, _ = store.take_changes()
    assert [2.0] == [s.value for s in samples]
    assert ([], []) == store.take_changes()


def test_unsent_changes_are_restored_and_reconnect_resends_everything() -> None:
    """A failed send marks its series dirty again; mark_all_dirty resends every series."""
    store = MetricStore()
    store.inc("optimizer_steps_total", ("SGD#0",))
    store.observe("optimizer_step_duration_seconds", ("SGD#0",), 0.003)
    samples, hists = store.take_changes()
    store.restore_changes(samples, hists)
    assert (1, 1) == tuple(map(len, store.take_changes()))
    store.mark_all_dirty()
    assert (1, 1) == tuple(map(len, store.take_changes()))


def test_a_counter_started_at_zero_is_sent_once_and_never_resets_a_running_total() -> None:
    """start_at_zero sends each new series once at 0; on a series that counted, or a second call, it changes nothing."""
    store = MetricStore()
    store.inc("optimizer_steps_total", ("SGD#0",), 3.0)
    store.take_changes()
    store.start_at_zero("optimizer_steps_total", (("SGD#0",), ("SGD#1",)))
    store.start_at_zero("grad_nonfinite_passes_total")
    samples, _ = store.take_changes()
    assert {("optimizer_steps_total", ("SGD#1",), 0.0), ("grad_nonfinite_passes_total", (), 0.0)} == {
        (s.family, s.labels, s.value) for s in samples
    }
    store.start_at_zero("grad_nonfinite_passes_total")
    assert ([], []) == store.take_changes()
    store.inc("grad_nonfinite_passes_total")
    assert (3.0, 1.0) == (store.value("optimizer_steps_total", ("SGD#0",)), store.value("grad_nonfinite_passes_total"))
    with pytest.raises(ValueError):
        store.start_at_zero("optimizer_learning_rate", (("SGD#0", "0"),))  # a gauge is not a counter


def test_histogram_buckets_are_upper_inclusive() -> None:
    """A value equal to a bucket bound lands in that bucket, like Prometheus' `le`."""
    store = MetricStore()
    bounds = CATALOG["optimizer_step_duration_seconds"].buckets
    store.observe("optimizer_step_duration_seconds", ("SGD#0",), bounds[2])
    _, [hist] = store.take_changes()
    assert 1 == hist.bucket_counts[2]
    assert len(bounds) + 1 == len(hist.bucket_counts)


def test_store_refuses_shapes_that_contradict_the_catalog() -> None:
    """Using a counter as a gauge, or the wrong number of labels, is a probe bug and raises."""
    store = MetricStore()
    with pytest.raises(ValueError):
        store.set("optimizer_steps_total", ("SGD#0",), 1.0)
    with pytest.raises(ValueError):
        store.inc("optimizer_steps_total", ())


def test_a_snapshot_is_every_series_as_it_stands_and_leaves_the_changes_to_send() -> None:
    """snapshot() holds counters, gauges and histograms, sent or not, as copies; what is left to send stays."""
    store = MetricStore()
    store.inc("optimizer_steps_total", ("SGD#0",), 2.0)
    store.observe("optimizer_step_duration_seconds", ("SGD#0",), 0.003)
    store.take_changes()
    store.set("optimizer_learning_rate", ("SGD#0", "0"), 0.1)
    samples, histograms = store.snapshot()
    store.inc("optimizer_steps_total", ("SGD#0",))
    store.observe("optimizer_step_duration_seconds", ("SGD#0",), 0.003)
    assert {("optimizer_steps_total", ("SGD#0",), 2.0), ("optimizer_learning_rate", ("SGD#0", "0"), 0.1)} == {
        (s.family, s.labels, s.value) for s in samples
    }
    assert [("optimizer_step_duration_seconds", ("SGD#0",), 1, 0.003)] == [
        (h.family, h.labels, sum(h.bucket_counts), h.total) for h in histograms
    ]
    changed, changed_histograms = store.take_changes()
    assert (2, 1) == (len(changed), len(changed_histograms))  # the gauge and the counter; the histogram


def test_bounded_label_folds_late_values_into_other() -> None:
    """Past the limit, new values map to `other` and are counted as folded."""
    label = BoundedLabel(2)
    assert ["a", "b", OTHER, "a", OTHER] == [label(v) for v in ("a", "b", "c", "a", "d")]
    assert 2 == label.folded
