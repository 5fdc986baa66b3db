"""How long each CUDA-graph recording takes, from Dynamo's compile callbacks (trigger CUDAGRAPH_RECORDING)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from torchpulse.probes.torch_compat import dynamo as dynamo_compat

CompileCallback = Callable[[object], None]


class RecordingClock:
    """Times each recording between its start and end callbacks.

    `torch._dynamo.reset()` clears compile callbacks: `ensure()` re-adds them when missing. `guard` is the
    owning probe's (`Probe.guard`), so a disabled probe's callbacks do nothing and a failing one disables it.
    """

    def __init__(
        self, guard: Callable[[CompileCallback], CompileCallback], on_recorded: Callable[[float], None]
    ) -> None:
        self._on_recorded = on_recorded
        self._started: float | None = None
        self._start = guard(self._on_start)
        self._end = guard(self._on_end)

    def ensure(self) -> None:
        handler = dynamo_compat.callback_handler()
        if self._start not in handler.start_callbacks:
            handler.register_start_callback(self._start)
        if self._end not in handler.end_callbacks:
            handler.register_end_callback(self._end)

    def remove(self) -> None:
        handler = dynamo_compat.callback_handler()
        for remove, callback in (
            (handler.remove_start_callback, self._start),
            (handler.remove_end_callback, self._end),
        ):
            with contextlib.suppress(ValueError):
                remove(callback)

    def _on_start(self, args: object) -> None:
        if dynamo_compat.callback_trigger_name(args) == dynamo_compat.TRIGGER_CUDAGRAPH_RECORDING:
            self._started = time.perf_counter()

    def _on_end(self, args: object) -> None:
        if dynamo_compat.callback_trigger_name(args) != dynamo_compat.TRIGGER_CUDAGRAPH_RECORDING:
            return
        started, self._started = self._started, None
        if started is not None:
            self._on_recorded(time.perf_counter() - started)
