"""Skips that no message explains, and non-static input copies, from Inductor's counters.

Each skip message is logged with an increment of `counters['inductor']['cudagraph_skips']`, but a graph
with no CUDA device bumps the counter without a message: increments no message explains are
CPU-device skips.
"""

from __future__ import annotations

from typing import NamedTuple

from torchpulse.probes.torch_compat import cudagraph_trees as trees_compat
from torchpulse.probes.torch_compat import dynamo as dynamo_compat
from torchpulse.probes.torch_compat import features

SKIPS = ("inductor", "cudagraph_skips")
INPUT_COPIES = ("inductor", "cudagraph_recorded_non_static_inputs")


class CounterIncrease(NamedTuple):
    """What the counters gained since the previous poll."""

    silent_skips: int  # increments no skip message explains
    input_copies: int  # graph inputs copied on replay because their addresses are not static


def silent_skip_reason() -> str:
    """The reason label of skips no message explains."""
    return "other" if trees_compat.cudagraph_policy_set() else "cpu_device"


class SkipCounter:
    """The counters' baselines, and how much of their increase the skip messages explained.

    Baselines are read by `start()` once the job has loaded Dynamo, never before; on a torch without
    the counters every poll finds nothing.
    """

    def __init__(self) -> None:
        self._messages = 0
        self._unexplained = 0
        self._last = self._base = 0
        self._copies_last = 0

    def start(self) -> None:
        """Count from the counters' values now."""
        if features.has("dynamo_counters"):
            self._last = self._base = dynamo_compat.dynamo_counter(*SKIPS)
            self._copies_last = dynamo_compat.dynamo_counter(*INPUT_COPIES)

    def explained(self) -> None:
        """A skip message was logged: its increment is counted by its reason, not as a silent skip."""
        self._messages += 1

    def poll(self) -> CounterIncrease:
        if not features.has("dynamo_counters"):
            return CounterIncrease(0, 0)
        now = dynamo_compat.dynamo_counter(*SKIPS)
        if now < self._last:  # someone cleared counters: rebase, count nothing
            self._base = now - self._messages - self._unexplained
        unexplained = now - self._base - self._messages
        self._last = now
        silent = max(0, unexplained - self._unexplained)
        self._unexplained += silent
        copies = dynamo_compat.dynamo_counter(*INPUT_COPIES)
        gained = max(0, copies - self._copies_last)
        self._copies_last = copies
        return CounterIncrease(silent, gained)
