"""The wrapper every autograd pass goes through.

Every pass goes through `torch.autograd.graph._engine_run_backward`, which
`torch.autograd` also imports under its own name; both references are
replaced by a wrapper, so `loss.backward()`, `torch.autograd.backward`,
`torch.autograd.grad` and compiled-autograd passes are all seen.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Generic, Protocol, TypeVar

import torch
import torch.autograd
import torch.autograd.graph

from torchpulse.probes.agent.probe import Removable
from torchpulse.probes.autograd.nodes import PassTimer
from torchpulse.probes.torch_compat import dynamo as dynamo_compat

P = TypeVar("P")
EngineRun = Callable[..., tuple[torch.Tensor, ...]]
# Before a pass, with `_engine_run_backward`'s arguments: a plan, or None to leave the pass alone.
Begin = Callable[[Sequence[object], tuple[object, ...], dict[str, object]], P | None]
# After a planned pass: the plan, the pass's seconds, and whether it returned.
End = Callable[[P, float, bool], None]


class _Switch(Protocol):
    @property
    def enabled(self) -> bool: ...


class _Patch:
    """Replaces a module attribute; `remove()` restores it unless someone patched over us."""

    def __init__(self, owner: ModuleType, attr: str, replacement: EngineRun) -> None:
        self._owner, self._attr, self.replacement = owner, attr, replacement
        self.original: EngineRun = getattr(owner, attr)
        setattr(owner, attr, replacement)

    def remove(self) -> None:
        # A later patcher captured our wrapper; it passes through once we are disabled.
        if getattr(self._owner, self._attr) is self.replacement:
            setattr(self._owner, self._attr, self.original)


class EngineHook(Generic[P]):
    """Calls `begin` before each pass of the job and `end` after the passes it planned.

    Not while `owner` or `agent` is disabled, and not for AOTAutograd tracing the joint graph through
    the engine at compile time. `begin` and `end` are read at each pass, so a benchmark can wrap them.
    """

    def __init__(self, owner: _Switch, agent: _Switch, begin: Begin[P], end: End[P]) -> None:
        self._owner, self._agent = owner, agent
        self.begin, self.end = begin, end
        # Set once Dynamo is loaded (`keep_dynamo_out`): its frame callback (None outside compiled
        # code), and `begin` and `end` behind torch.compiler.disable for passes that start inside
        # compiled code.
        self._dynamo_callback: Callable[[], object] | None = None
        self._begin_untraced: Begin[P] = begin
        self._end_untraced: End[P] = end
        self._wrappers: tuple[EngineRun, ...] = ()

    def install(self) -> list[Removable]:
        """Wrap both names of the engine's entry; the handles, removed in reverse, restore them."""
        graph_patch = _Patch(
            torch.autograd.graph, "_engine_run_backward", self._wrap(torch.autograd.graph._engine_run_backward)
        )
        # Usually the same function; wrap separately if someone patched only one.
        current = torch.autograd._engine_run_backward  # type: ignore[attr-defined]
        wrapper = graph_patch.replacement if current is graph_patch.original else self._wrap(current)
        self._wrappers = (graph_patch.replacement, wrapper)
        return [graph_patch, _Patch(torch.autograd, "_engine_run_backward", wrapper)]

    def keep_dynamo_out(self) -> None:
        """Run the wrappers and the owner's work eagerly even under a compiled step (once Dynamo is loaded).

        A graph break at `loss.backward()` inside a compiled function leaves the
        frames below it to Dynamo: it would trace the wrapper, read is_compiling()
        as True there and run the pass uncounted. The frames of the wrapper and of
        the node hooks are skipped (no cost in eager mode, and the engine's frames
        below are left as they would be without us); the work between them
        goes through torch.compiler.disable when Dynamo's frame callback is set
        (~2 µs a pass, only for passes started inside compiled code).
        """
        for wrapper in set(self._wrappers):
            dynamo_compat.skip_tracing(wrapper)
        PassTimer.keep_dynamo_out()
        self._begin_untraced = dynamo_compat.disable_tracing(self.begin)
        self._end_untraced = dynamo_compat.disable_tracing(self.end)
        self._dynamo_callback = dynamo_compat.dynamo_frame_callback_getter()

    def _wrap(self, original: EngineRun) -> EngineRun:
        hook, owner, agent = self, self._owner, self._agent
        is_compiling, clock = torch.compiler.is_compiling, time.perf_counter

        @functools.wraps(original)
        def _engine_run_backward(
            t_outputs: Sequence[object], *args: object, **kwargs: object
        ) -> tuple[torch.Tensor, ...]:
            # AOTAutograd traces the joint graph through here at compile time.
            if not (owner.enabled and agent.enabled) or is_compiling():
                return original(t_outputs, *args, **kwargs)
            callback = hook._dynamo_callback
            traced = callback is not None and callback() is not None
            plan = (hook._begin_untraced if traced else hook.begin)(t_outputs, args, kwargs)
            if plan is None:
                return original(t_outputs, *args, **kwargs)
            start = clock()
            ok = False
            try:
                result = original(t_outputs, *args, **kwargs)
                ok = True
                return result
            finally:
                (hook._end_untraced if traced else hook.end)(plan, clock() - start, ok)

        return _engine_run_backward
