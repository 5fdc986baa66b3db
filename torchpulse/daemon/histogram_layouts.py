"""Histograms of an agent whose buckets are not the daemon's: re-bucketed exactly, or refused.

A histogram sample carries per-bucket counts, not the bounds. Agents run the
torchpulse of their job's environment, the daemon the system's: across an
upgrade they may bucket a family differently. Counts of another layout,
rendered with the daemon's `le` labels, would be wrong without a sign (or,
with another number of buckets, refused as `bad_buckets` with no reason
given). The hello says how the agent buckets each family: a layout that
splits every bucket of the daemon's (a finer one) is summed into it exactly;
any other is refused, and the log says which family and why.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence

from torchpulse.catalog import HISTOGRAM_BOUNDS
from torchpulse.limits import MAX_HISTOGRAM_BOUNDS


class Refused:
    """A family whose counts cannot be told apart in the daemon's buckets."""

    def __init__(self, why: str) -> None:
        self.why = why


# Per family: the daemon bucket each agent bucket (its bounds, then +Inf) falls into, or Refused.
# Families missing from a plan are bucketed as the daemon buckets them.
BucketPlan = dict[str, tuple[int, ...] | Refused]


def bucket_map(agent: Sequence[float], ours: Sequence[float]) -> tuple[int, ...] | Refused:
    """For each of the agent's buckets, the index of the daemon's bucket that holds all of it."""
    if len(agent) > MAX_HISTOGRAM_BOUNDS:
        return Refused(f"{len(agent)} bounds (at most {MAX_HISTOGRAM_BOUNDS})")
    if not all(math.isfinite(b) for b in agent) or any(b >= c for b, c in itertools.pairwise(agent)):
        return Refused("bounds that are not finite and strictly increasing")
    plan = []
    lower = -math.inf
    for upper in (*agent, math.inf):
        # The first of ours at or above the bucket's upper bound; len(ours) is our +Inf bucket.
        index = bisect.bisect_left(ours, upper)
        if index > 0 and lower < ours[index - 1]:
            inside = ours[bisect.bisect_right(ours, lower)]  # the first of ours that splits the bucket
            return Refused(f"its bucket ({lower:g}, {upper:g}] straddles the daemon's bound {inside:g}")
        plan.append(index)
        lower = upper
    return tuple(plan)


def plan_for(bounds: Mapping[str, Sequence[float]]) -> BucketPlan:
    """What to do with each histogram family an agent buckets otherwise than the daemon (from its hello)."""
    plan: BucketPlan = {}
    for name, agent in bounds.items():
        ours = HISTOGRAM_BOUNDS.get(name)
        if ours is None or tuple(agent) == ours:
            continue  # a family the daemon does not know is refused as unknown_family anyway
        plan[name] = bucket_map(agent, ours)
    return plan


def rebucket(counts: Sequence[int], targets: tuple[int, ...], n_buckets: int) -> tuple[int, ...]:
    """The agent's per-bucket counts summed into the daemon's `n_buckets` (bounds and +Inf)."""
    summed = [0] * n_buckets
    for count, target in zip(counts, targets, strict=True):
        summed[target] += count
    return tuple(summed)
