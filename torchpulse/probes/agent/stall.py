"""A rank that stopped crossing step boundaries: its stall flag, and the training thread's stack.

The agent's own thread knows when the job's main optimizer last stepped (`StepBoundary`). A rank is stalled
once that was longer ago than its threshold: the configured stall seconds, or ten times the p99 of its recent
intervals between steps when that is longer (a job of 2-minute steps does not page), and before its first
step a threshold of its own (compiles and data loading take long). The stack comes from inside the process
(`sys._current_frames()`): no ptrace, no signal into the job. A thread that holds the GIL for ever (a C call
that never releases it) stops the agent's thread too: then the daemon stops hearing from the rank instead.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING

from torchpulse.limits import MAX_STACK_CHARS, MAX_STACK_FRAMES
from torchpulse.probes.agent.step_boundary import StepBoundary

if TYPE_CHECKING:
    from torchpulse.probes.agent.agent import Agent

# How many times the recent p99 interval a step may take before it counts as a stall.
STALL_INTERVAL_FACTOR = 10.0


class StallWatch:
    """Sets `agent_stalled` and `agent_last_step_timestamp_seconds`, and logs the stack when a stall begins.

    `check` runs on the agent's thread only (from `Agent.drain`); it reads the step boundary's times, which the
    training thread appends to, through one C-level copy.
    """

    def __init__(self, agent: Agent, boundary: StepBoundary) -> None:
        self._agent = agent
        self._boundary = boundary
        self._started = time.monotonic()
        self._stalled = False
        agent.store.set("agent_stalled", (), 0.0)  # present from the first batch, the hello's

    def threshold(self) -> float:
        """Seconds without a step boundary after which the rank is stalled."""
        config = self._agent.config
        times = self._boundary.recent_step_times()
        if not times:
            return config.first_step_stall_seconds
        intervals = sorted(later - earlier for earlier, later in itertools.pairwise(times))
        p99 = intervals[int(0.99 * (len(intervals) - 1))] if intervals else 0.0
        return max(config.stall_seconds, STALL_INTERVAL_FACTOR * p99)

    def seconds_since_step(self, now: float | None = None) -> float | None:
        """Seconds since the main optimizer's last step; None before the first."""
        times = self._boundary.recent_step_times()
        return None if not times else (time.monotonic() if now is None else now) - times[-1]

    def check(self) -> None:
        now = time.monotonic()
        since = self.seconds_since_step(now)
        store = self._agent.store
        if since is not None:
            store.set("agent_last_step_timestamp_seconds", (), round(time.time() - since, 3))
        waited = since if since is not None else now - self._started
        threshold = self.threshold()
        stalled = waited > threshold
        store.set("agent_stalled", (), float(stalled))
        if stalled and not self._stalled:
            self._agent.emit(
                "warning",
                "rank stalled: no optimizer step for longer than its threshold",
                seconds_since_step=round(waited, 1),
                threshold_seconds=round(threshold, 1),
                step=self._boundary.step,
                thread=self.training_thread_name(),
                stack=self.training_stack(),
            )
        elif self._stalled and not stalled:
            self._agent.emit("info", "rank resumed stepping", step=self._boundary.step)
        self._stalled = stalled

    def training_thread_name(self) -> str:
        thread = _thread(self._training_thread_id())
        return thread.name if thread is not None else f"thread {self._training_thread_id()}"

    def training_stack(self) -> str:
        """The training thread's current Python stack, innermost frames kept within the bounds."""
        frame = sys._current_frames().get(self._training_thread_id())
        if frame is None:
            return "(the training thread has ended)"
        lines = traceback.format_list(traceback.extract_stack(frame)[-MAX_STACK_FRAMES:])
        text = "".join(lines)
        return text if len(text) <= MAX_STACK_CHARS else "...\n" + text[-MAX_STACK_CHARS:]

    def _training_thread_id(self) -> int:
        # The thread that steps the main optimizer; before its first step, the main thread, where most jobs train.
        stepped = self._boundary.thread_id
        return stepped if stepped is not None else threading.main_thread().ident or 0


def _thread(ident: int) -> threading.Thread | None:
    return next((thread for thread in threading.enumerate() if thread.ident == ident), None)
