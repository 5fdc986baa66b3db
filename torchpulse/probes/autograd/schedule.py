"""Which autograd passes are timed, logged node by node and searched for parameters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torchpulse.probes.autograd.nodes import PassTimer

# Passes between parameter discoveries when node timing is switched off.
DISCOVER_EVERY = 100


@dataclass
class PassPlan:
    """What the probe does around one pass, decided before the pass runs."""

    kind: str
    index: int
    accumulate: bool
    due: bool = False  # its turn: timed when timing is on, and searched for parameters
    timer: PassTimer | None = None
    sampled: bool = False
    logged: bool = False


class PassSchedule:
    """Counts the passes and plans each: every `sample_every`th is due (every DISCOVER_EVERY-th while
    timing is off), and the next `log_passes` are logged.

    Both settings change from the control thread; a change applies at the next pass boundary, on the
    training thread. `on_timing_on` runs there when a change switches timing on.
    """

    def __init__(self, sample_every: int, log_passes: int, on_timing_on: Callable[[], None]) -> None:
        self._sample_every = sample_every
        self._log_left = log_passes
        self._on_timing_on = on_timing_on
        self._passes = 0
        self._countdown = 0  # the first pass is due: it also discovers the parameters
        self._due_passes = 0
        self._control: dict[str, int] = {}

    @property
    def passes(self) -> int:
        return self._passes

    @property
    def sample_every(self) -> int:
        return self._sample_every

    @property
    def log_left(self) -> int:
        return self._log_left

    def set_sample_every(self, every: int) -> None:
        """Time the nodes of every `every`th pass from the next pass on; 0 switches timing off."""
        if every < 0:
            raise ValueError("sample_every must be >= 0")
        self._control["sample_every"] = every

    def log_next_passes(self, passes: int) -> None:
        """Emit one structured event per executed node for the next `passes` passes."""
        if passes < 0:
            raise ValueError("log_next_passes needs passes >= 0")
        self._control["log_passes"] = passes

    def plan(self, kind: str, accumulate: bool, compiled: bool) -> PassPlan:
        """The next pass's plan: its index, whether it is due, sampled, and to be logged (which the
        caller still refuses where torch logs the nodes itself)."""
        if self._control:
            self._apply_control()
        plan = PassPlan(kind, self._passes, accumulate)
        self._passes += 1
        self._countdown -= 1
        plan.due = self._countdown < 0
        if plan.due:
            # Periods alternate N+1 and N-1 (N on average): a job alternating graphs (a GAN's two
            # passes) with a period dividing N would otherwise have only one of them ever timed
            # or searched for parameters.
            period = self._sample_every or DISCOVER_EVERY
            self._due_passes += 1
            jitter = (1 if self._due_passes % 2 else -1) if period > 1 else 0
            self._countdown = period - 1 + jitter
        # Compiled autograd: hooks would be traced into its graph and change its
        # cache key, so its passes are neither timed nor logged (reading is fine).
        plan.logged = not compiled and self._log_left > 0
        if plan.logged:
            self._log_left -= 1
        plan.sampled = not compiled and plan.due and self._sample_every > 0
        return plan

    def _apply_control(self) -> None:
        # pop() is atomic, so a request arriving from the control thread meanwhile is kept.
        sample_every = self._control.pop("sample_every", None)
        if sample_every is not None:
            self._sample_every = sample_every
            if sample_every > 0:
                self._on_timing_on()
            # A shorter period takes effect now, not after the old countdown.
            self._countdown = min(self._countdown, (sample_every or DISCOVER_EVERY) - 1)
        log_passes = self._control.pop("log_passes", None)
        if log_passes is not None:
            self._log_left = log_passes
