"""Optimizer probe: step count and time, learning rates, parameter and state size.

Uses the global `register_optimizer_step_pre_hook`/`post_hook`, so every
optimizer in the process is seen without touching training code. The hooks
only take a timestamp and queue a record; sizes are measured on the training
thread (where `optimizer.state` is safe to iterate) every N steps, when the
state gains entries or param groups are added, and after `load_state_dict`.

A step's time excludes the closure it runs: `step(closure)` evaluates the
model inside the step (LBFGS, several times; Lightning's automatic
optimization passes every training step as the closure), and the forward
and backward passes would otherwise read as optimizer time.

An optimizer stepped inside another optimizer's step on the same thread is
wrapped by it (ZeroRedundancyOptimizer, Lookahead, SAM): the job called the
outer one, so only the outer one is counted and timed, and the state the
inner one keeps is counted in the outer one's state size.
"""

from __future__ import annotations

import heapq
import itertools
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from torchpulse.probes.agent.probe import Probe, Removable
from torchpulse.probes.torch_compat import dynamo as dynamo_compat

if TYPE_CHECKING:
    from torchpulse.probes.agent.agent import Agent

Sizes = tuple[int, int, int]
# Frames of these files sit between torch's step wrapper and our hook.
_WRAPPER_DIRS = (str(Path(__file__).resolve().parent.parent), *dynamo_compat.TRACING_WRAPPER_PATHS)
# Frames searched above a step for an outer step of the same optimizer.
_MAX_STEP_DEPTH = 32


def _step_wrapper_frame() -> FrameType | None:
    """The frame of torch's `optimizer.step` wrapper that called the current hook."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_WRAPPER_DIRS):
        frame = frame.f_back
    return frame


def _inside_step_of(optimizer: Optimizer, wrapper: FrameType) -> bool:
    """Whether a caller of `wrapper` is another run of the same step wrapper for `optimizer`.

    That is `super().step()` in a subclass (torch wraps both methods). Found by
    walking the stack instead of remembering the outer frame: a remembered frame
    holds the optimizer in its locals, and when step() raised (the post-hook
    never ran) it kept the optimizer alive for ever.
    """
    frame = wrapper.f_back
    for _ in range(_MAX_STEP_DEPTH):
        if frame is None:
            return False
        if frame.f_code is wrapper.f_code and frame.f_locals.get("self") is optimizer:
            return True
        frame = frame.f_back
    return False


def _with_timed_closure(args: Any, kwargs: Any, tracked: _Tracked) -> tuple[Any, Any] | None:
    """The step's arguments with its closure (`step(closure)`, `step(closure=...)`) timed into
    `tracked.in_closure`; None when it has none, so that the step runs with what it was given.

    torch's step wrapper hands the hooks its own arguments: `args[0]` is the optimizer.
    """
    if kwargs and callable(kwargs.get("closure")):
        return args, {**kwargs, "closure": _timed(kwargs["closure"], tracked)}
    if len(args) > 1 and callable(args[1]):
        return (args[0], _timed(args[1], tracked), *args[2:]), kwargs
    return None


def _timed(closure: Callable[..., Any], tracked: _Tracked) -> Callable[..., Any]:
    # Not functools.wraps: it would copy a callable object's __dict__ (Lightning's Closure) onto the wrapper.
    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return closure(*args, **kwargs)
        finally:
            tracked.in_closure += time.perf_counter() - began

    return timed


class _Tracked:
    __slots__ = (
        "__weakref__",
        "groups",
        "in_closure",
        "inner",
        "label",
        "nested",
        "rescan",
        "started",
        "state_len",
        "steps",
    )

    def __init__(self, label: str) -> None:
        self.label = label
        self.started: float | None = None
        # Seconds the current step spent in the closure it was given.
        self.in_closure = 0.0
        # A subclass whose step() calls super().step() runs torch's hooked
        # wrapper twice: inner runs are counted here, not as steps.
        self.nested = 0
        self.steps = 0
        self.state_len = -1
        # add_param_group: an optimizer without state (plain SGD) has no state growth to notice it by.
        self.groups = -1
        self.rescan = True
        # Optimizers this one steps inside its own step (it wraps them): their state is its state.
        self.inner: weakref.WeakSet[Optimizer] = weakref.WeakSet()


def learning_rates(param_groups: list[dict[str, Any]]) -> tuple[float | None, ...]:
    """Per-group learning rates without forcing a device sync (a CUDA lr tensor reads as None)."""
    rates: list[float | None] = []
    for group in param_groups:
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor):
            rates.append(float(lr) if lr.device.type == "cpu" and lr.numel() == 1 else None)
        elif isinstance(lr, int | float):
            rates.append(float(lr))
        else:
            rates.append(None)
    return tuple(rates)


def measure(optimizer: Optimizer) -> Sizes:
    """Parameter tensors, their elements, and local bytes of state tensors."""
    params = elements = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            params += 1
            elements += param.numel()
    state_bytes = 0
    for state in optimizer.state.values():
        for value in state.values():
            # LBFGS keeps its history (old_dirs, old_stps: history_size flat copies of every
            # parameter, most of its state) as lists of tensors.
            values = value if isinstance(value, list | tuple) else (value,)
            for item in values:
                if isinstance(item, torch.Tensor):
                    # DTensor: count the local shard, which is what this rank holds.
                    local = getattr(item, "_local_tensor", item)
                    state_bytes += local.numel() * local.element_size()
    return params, elements, state_bytes


def measure_wrapping(optimizer: Optimizer, inner: Iterable[Optimizer]) -> Sizes:
    """`measure` of an optimizer plus the state of the optimizers it wraps (their parameters are its own)."""
    params, elements, state_bytes = measure(optimizer)
    return params, elements, state_bytes + sum(measure(wrapped)[2] for wrapped in inner)


class _PerOptimizerHooks:
    """Handles of hooks registered on each optimizer, dropped together with it."""

    def __init__(self) -> None:
        self.handles: weakref.WeakKeyDictionary[Optimizer, Removable] = weakref.WeakKeyDictionary()

    def remove(self) -> None:
        for handle in list(self.handles.values()):
            handle.remove()
        self.handles.clear()


class OptimizerLabels:
    """`Type#n` with the smallest n no live optimizer holds: a job that builds optimizers over
    and over (a search, OOM retries) keeps as many series as it has optimizers at once."""

    def __init__(self, at_death: Callable[..., None]) -> None:
        self._free: list[int] = []
        self._next = itertools.count()
        self._lock = threading.Lock()  # optimizers die in whichever thread collects them
        self._at_death = at_death  # `Probe.at_death` of the probe that owns the labels

    def take(self, optimizer: Optimizer) -> str:
        with self._lock:
            index = heapq.heappop(self._free) if self._free else next(self._next)
        self._at_death(optimizer, self._give_back, index)
        return f"{type(optimizer).__name__}#{index}"

    def _give_back(self, index: int) -> None:
        with self._lock:
            heapq.heappush(self._free, index)


class OptimizerProbe(Probe):
    name = "optimizer"

    def __init__(self, agent: Agent) -> None:
        super().__init__(agent)
        self.state_every = agent.config.optimizer_state_every
        self._tracked: weakref.WeakKeyDictionary[Optimizer, _Tracked] = weakref.WeakKeyDictionary()
        self._labels = OptimizerLabels(self.at_death)
        self._named: weakref.WeakKeyDictionary[Optimizer, str] = weakref.WeakKeyDictionary()
        self._load_hooks = _PerOptimizerHooks()
        # The optimizer whose (outermost) step runs on this thread, weakly: a step that raised leaves it set.
        self._running = threading.local()
        # Optimizers seen stepping inside another one's step, for the CUDA-graph probe to skip as well.
        self.wrapped: weakref.WeakSet[Optimizer] = weakref.WeakSet()

    def _install(self) -> None:
        self._keep(register_optimizer_step_pre_hook(self.guard(self._before_step)))
        self._keep(register_optimizer_step_post_hook(self.guard(self._after_step)))
        self._load_hooks = _PerOptimizerHooks()
        self._keep(self._load_hooks)
        # Re-enabled (`ctl enable optimizer`): the optimizers tracked before lost their load hooks with the
        # uninstall. Hook them again, and rescan: a `load_state_dict` may have run while the probe was off.
        for optimizer, tracked in list(self._tracked.items()):
            tracked.rescan = True
            self._hook_loads(optimizer, tracked)

    def _uninstalled(self) -> None:
        # Labels stay stable across disable/enable; a step in flight is forgotten.
        for tracked in self._tracked.values():
            tracked.started = None
            tracked.nested = 0
        self._running = threading.local()

    def label_of(self, optimizer: Optimizer) -> str:
        """The optimizer's label, the same for as long as it lives: the CUDA-graph probe asks for it too,
        also while this probe is disabled, so that both name one optimizer alike."""
        label = self._named.get(optimizer)
        if label is None:
            label = self._named[optimizer] = self._labels.take(optimizer)
        return label

    def _track(self, optimizer: Optimizer) -> _Tracked:
        tracked = _Tracked(self.label_of(optimizer))
        self._tracked[optimizer] = tracked
        # Once per optimizer: a step that raises later is then an increase() from 0, not a series born at 1.
        for family in ("optimizer_steps_total", "optimizer_step_errors_total"):
            self.start_at_zero(family, ((tracked.label,),))
        # A step that raised is counted at the optimizer's next step, which never comes when the job
        # drops it (an OOM retry or a fallback builds a new one): then it is counted when it dies.
        self.at_death(optimizer, self._dropped, tracked)
        self._hook_loads(optimizer, tracked)
        return tracked

    def _hook_loads(self, optimizer: Optimizer, tracked: _Tracked) -> None:
        """A `load_state_dict` changes the state's size at once: rescan at the next step, not the 100th."""
        register = getattr(optimizer, "register_load_state_dict_post_hook", None)
        if register is not None:
            ref = weakref.ref(tracked)

            def _loaded(_optimizer: Optimizer) -> None:
                entry = ref()
                if entry is not None:
                    entry.rescan = True

            self._load_hooks.handles[optimizer] = register(_loaded)

    def _dropped(self, tracked: _Tracked) -> None:
        if tracked.started is not None and self.enabled and self.agent.enabled:
            tracked.started = None
            self.agent.record(self._on_error, tracked.label)

    def _before_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        tracked = self._tracked.get(optimizer)
        if (tracked is None or tracked.started is None) and self._wrapped_by_running(optimizer):
            return None
        tracked = tracked or self._track(optimizer)
        if tracked.started is not None:
            frame = _step_wrapper_frame()
            if frame is not None and _inside_step_of(optimizer, frame):
                tracked.nested += 1
                return None  # the outer step already times its closure
            # The previous step raised: its post-hook never ran.
            self.agent.record(self._on_error, tracked.label)
        tracked.nested = 0
        tracked.in_closure = 0.0
        replaced = _with_timed_closure(args, kwargs, tracked)
        self._running.step = weakref.ref(optimizer)
        tracked.started = time.perf_counter()
        return replaced

    def _wrapped_by_running(self, optimizer: Optimizer) -> bool:
        """Whether `optimizer` steps inside the step of another optimizer on this thread; then it is
        remembered as that one's inner optimizer. Costs an attribute read unless a step runs."""
        ref = getattr(self._running, "step", None)
        outer = ref() if ref is not None else None
        if outer is None or outer is optimizer:
            return False
        frame = _step_wrapper_frame()
        outer_tracked = self._tracked.get(outer)
        if frame is None or outer_tracked is None or not _inside_step_of(outer, frame):
            self._running.step = None  # that step raised long ago: its post-hook never ran
            return False
        if optimizer not in outer_tracked.inner:
            outer_tracked.inner.add(optimizer)
            outer_tracked.rescan = True
            self.wrapped.add(optimizer)
        return True

    def _after_step(self, optimizer: Optimizer, _args: Any, _kwargs: Any) -> None:
        end = time.perf_counter()
        tracked = self._tracked.get(optimizer)
        if tracked is None or tracked.started is None:
            return
        if tracked.nested:
            tracked.nested -= 1
            return
        duration = max(0.0, end - tracked.started - tracked.in_closure)
        tracked.started = None
        running = getattr(self._running, "step", None)
        if running is not None and running() is optimizer:
            self._running.step = None
        tracked.steps += 1
        sizes: Sizes | None = None
        state_len, groups = len(optimizer.state), len(optimizer.param_groups)
        if tracked.inner:
            state_len += sum(len(inner.state) for inner in tracked.inner)
        if (
            tracked.rescan
            or state_len != tracked.state_len
            or groups != tracked.groups
            or tracked.steps % self.state_every == 0
        ):
            tracked.rescan = False
            tracked.state_len, tracked.groups = state_len, groups
            sizes = measure_wrapping(optimizer, tracked.inner)
        self.agent.record(self._on_step, tracked.label, duration, learning_rates(optimizer.param_groups), sizes)

    # -- sender thread -----------------------------------------------------
    def _on_step(self, label: str, duration: float, rates: tuple[float | None, ...], sizes: Sizes | None) -> None:
        store = self.agent.store
        store.inc("optimizer_steps_total", (label,))
        store.observe("optimizer_step_duration_seconds", (label,), duration)
        for index, rate in enumerate(rates):
            if rate is not None:
                store.set("optimizer_learning_rate", (label, str(index)), rate)
        if sizes is not None:
            params, elements, state_bytes = sizes
            store.set("optimizer_parameters", (label,), float(params))
            store.set("optimizer_parameter_elements", (label,), float(elements))
            store.set("optimizer_state_bytes", (label,), float(state_bytes))

    def _on_error(self, label: str) -> None:
        self.agent.store.inc("optimizer_step_errors_total", (label,))
