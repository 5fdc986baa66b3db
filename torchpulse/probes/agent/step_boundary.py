"""The training thread's step boundary: optimizer steps counted, and the moment commands may run.

Commands (un)install probes, which adds to and removes from torch's table of
global post-hooks while torch iterates it. That is harmless only from the
table's last hook (the iteration is then over), so our hook is kept last:
before each step of the main optimizer (from a pre-hook on that optimizer,
when no global table is being iterated) and after commands ran. The main
optimizer is the first one to step, outermost when one wraps another,
replaced when it stops stepping while another one goes on.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from torchpulse.probes.agent.logs import get_logger
from torchpulse.probes.torch_compat.dynamo import disable_tracing
from torchpulse.probes.torch_compat.optim import global_optimizer_post_hooks

log = get_logger("torchpulse.control")
# Steps whose times give the recent step rate that `status` reports (the daemon plans a trace's start with it).
STEP_RATE_WINDOW = 16
# Step times kept: the last 100 intervals give the stall threshold its p99 (stall.py).
STEP_TIMES_KEPT = 101
StepHook = Callable[[torch.optim.Optimizer, object, object], None]


class StepBoundary:
    """Counts the main optimizer's steps and calls `on_boundary` after one while `wanted()` says so.

    Its hooks are its own, independent of any probe, so that `ctl disable optimizer` can be undone
    by `ctl enable optimizer`.
    """

    def __init__(
        self, enabled: Callable[[], bool], wanted: Callable[[], bool], on_boundary: Callable[[], None]
    ) -> None:
        self._enabled = enabled
        self._wanted = wanted
        self._on_boundary = on_boundary
        # Completed steps of the main optimizer: the step number commands use.
        self.step = 0
        self._first: weakref.ref[torch.optim.Optimizer] | None = None
        self._stepped_since_first: set[int] = set()  # ids of other optimizers since the main one stepped
        self._handle: RemovableHandle | None = None
        self._hook: StepHook | None = None
        self._pre_handle: RemovableHandle | None = None
        self._step_times: deque[float] = deque(maxlen=STEP_TIMES_KEPT)
        # The thread that steps the main optimizer: whose stack a stall shows.
        self.thread_id: int | None = None

    def install(self) -> None:
        if self._handle is None:
            self._hook = disable_tracing(self._after_step)
            self._handle = register_optimizer_step_post_hook(self._hook)

    def uninstall(self) -> None:
        handles, self._handle, self._pre_handle = (self._handle, self._pre_handle), None, None
        self._first = None
        for handle in handles:
            if handle is not None:
                handle.remove()

    def step_rate(self) -> float:
        """Steps per second over the last few steps and the wait since; 0.0 before two steps.

        A rank stuck in a collective keeps its last steps' times: the time since its last step,
        beyond one usual interval, counts too, so its rate falls instead of reading as before.
        """
        times = self.recent_step_times()[-STEP_RATE_WINDOW:]
        if len(times) < 2 or times[-1] <= times[0]:
            return 0.0
        span = times[-1] - times[0]
        overdue = time.monotonic() - times[-1] - span / (len(times) - 1)
        return round((len(times) - 1) / (span + max(0.0, overdue)), 3)

    def recent_step_times(self) -> list[float]:
        """The monotonic times of the last steps, oldest first (any thread)."""
        return list(self._step_times)  # one C-level copy: the training thread appends meanwhile

    def keep_last(self) -> None:
        """Re-register our hook at the end of the table; only when the table is not being iterated."""
        if self._handle is not None and self._hook is not None and not self._last_hook():
            self._handle.remove()
            self._handle = register_optimizer_step_post_hook(self._hook)

    def _after_step(self, optimizer: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
        if not self._enabled():
            return
        try:
            if _nested_step():
                return  # the inner optimizer of a wrapper, or super().step(): not a step boundary
            first = self._first() if self._first is not None else None
            if first is not optimizer:
                if first is not None and id(optimizer) not in self._stepped_since_first:
                    self._stepped_since_first.add(id(optimizer))
                    return
                # No main optimizer yet, it is gone, or this one stepped twice while it did not (an LR finder's).
                self._adopt(optimizer)
            self._stepped_since_first.clear()
            self.step += 1
            self._step_times.append(time.monotonic())
            self.thread_id = threading.get_ident()
            if self._wanted() and self._last_hook():
                self._on_boundary()
                self.keep_last()
        except Exception as exc:  # never into the job
            log.warning("step boundary hook failed", error=repr(exc))

    def _adopt(self, optimizer: torch.optim.Optimizer) -> None:
        if self._pre_handle is not None:
            self._pre_handle.remove()  # the old optimizer's own table: not being iterated
        self._pre_handle = optimizer.register_step_pre_hook(disable_tracing(self._before_main_step))
        self._first = weakref.ref(optimizer)

    def _before_main_step(self, _optimizer: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
        try:
            if self._wanted():
                self.keep_last()
        except Exception as exc:  # never into the job
            log.warning("step boundary hook failed", error=repr(exc))

    def _last_hook(self) -> bool:
        """Whether our hook is the last of the global table (unknown tables count as last)."""
        table = global_optimizer_post_hooks()
        return table is None or self._handle is None or next(reversed(table), None) == self._handle.id


_OPTIMIZER_FILE = "optim/optimizer.py"


def _nested_step() -> bool:
    """True inside the inner call when a subclass's step() calls super().step().

    Torch wraps both methods, so the post-hooks run twice for one step; the
    outer wrapper frame sits a couple of frames above the inner one.
    """
    frame = sys._getframe(1)
    seen = 0
    for _ in range(16):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "wrapper" and code.co_filename.endswith(_OPTIMIZER_FILE):
            seen += 1
            if seen == 2:
                return True
        frame = frame.f_back  # type: ignore[assignment]
    return False
