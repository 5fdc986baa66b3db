"""Histogram bucket layouts against the durations each family really sees.

histogram_quantile interpolates inside one bucket: a duration past the last
finite bound is reported as that bound, and a bucket many times wider than
its lower bound makes every quantile inside it a guess.
"""

from __future__ import annotations

from itertools import pairwise

import pytest

from torchpulse.catalog import CATALOG
from torchpulse.daemon.checkpoints.stats import DURATION_BUCKETS

# (shortest, longest) duration in seconds a family sees in real jobs.
REALISTIC: dict[str, tuple[float, float]] = {
    # A fused step of a small model to a CPU-offloaded step of a huge one.
    "optimizer_step_duration_seconds": (0.001, 60.0),
    "backward_duration_seconds": (0.001, 60.0),
    # One phase of one graph: Dynamo on a small frame to Inductor with max-autotune on a large model.
    "compile_duration_seconds": (0.1, 1800.0),
    "cudagraph_recording_duration_seconds": (0.001, 30.0),
    # A toy model's DCP save to a large model's async save with its upload to slow storage.
    "checkpoint_save_duration_seconds": (1.0, 3600.0),
}
# A bucket at most this many times its lower bound: p50/p99 stay within that factor of the truth.
MAX_BUCKET_RATIO = 3.0


def _layouts() -> list[tuple[str, tuple[float, ...], tuple[float, float]]]:
    layouts = [(name, CATALOG[name].buckets, span) for name, span in REALISTIC.items()]
    # The daemon's own: a metadata-level validation to one at the default 600 s worker time limit.
    layouts.append(("checkpoint_validation_duration_seconds", DURATION_BUCKETS, (0.1, 600.0)))
    return layouts


def test_every_histogram_family_has_a_realistic_range_here() -> None:
    """A new histogram family gets its range written down here, and its buckets checked against it."""
    assert sorted(REALISTIC) == sorted(name for name, family in CATALOG.items() if family.kind == "histogram")


@pytest.mark.parametrize(("name", "bounds", "span"), _layouts(), ids=[layout[0] for layout in _layouts()])
def test_realistic_durations_land_in_finite_buckets_of_bounded_width(
    name: str, bounds: tuple[float, ...], span: tuple[float, float]
) -> None:
    """The whole realistic range lies within the finite buckets, and no bucket is over 3x its lower bound."""
    low, high = span
    too_wide = [(a, b) for a, b in pairwise(bounds) if b / a > MAX_BUCKET_RATIO]
    assert (True, True, []) == (bounds[0] <= low, high <= bounds[-1], too_wide)
