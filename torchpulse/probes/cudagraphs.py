"""CUDA-graph probe: skips by reason, recordings, warm-ups, re-recordings, pools, optimizer readiness.

Sources, all read without changing what torch prints (see `compile_logtap`):
- `counters['inductor']['cudagraph_skips']` plus the skip messages logged with
  each increment. A graph with no CUDA device bumps the counter without a
  message, so increments no message explains are CPU-device skips.
- The tree manager's own debug/info lines for warm-ups, recordings, new shapes
  and re-record reasons, told apart by the frames they are logged from (see
  `torch_compat.TREES_RERECORD_REASON`), and the CUDAGRAPH_RECORDING compile
  callbacks for recording time.
- The tree manager itself (thread-local) and optimizer state, read from the
  training thread in a global optimizer post-hook every N steps.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_post_hook

from torchpulse.probes.agent.config import int_option
from torchpulse.probes.agent.logs import get_logger
from torchpulse.probes.agent.probe import Probe
from torchpulse.probes.compile.logtap import LogTap
from torchpulse.probes.compile.reasons import (
    CUDAGRAPH_SKIP_REASONS,
    RERECORD_REASONS,
    classify_cudagraph_skip,
    classify_rerecord,
)
from torchpulse.probes.optimizer import OptimizerLabels
from torchpulse.probes.torch_compat import cudagraph_trees as trees_compat
from torchpulse.probes.torch_compat import dynamo as dynamo_compat
from torchpulse.probes.torch_compat import features
from torchpulse.protocol import FieldValue

if TYPE_CHECKING:
    from torchpulse.probes.agent.agent import Agent

log = get_logger("torchpulse.probes")
MAX_SYMINT_IDS = 4096


class Readiness(NamedTuple):
    """What Dynamo's optimizer integration would find when compiling `optimizer.step`."""

    nonstatic_grads: int
    moving_grads: int
    capturable: tuple[tuple[int, bool], ...]  # (param group, capturable) for CUDA groups
    cpu_step_tensors: int


def measure_readiness(
    optimizer: Optimizer, last_ptrs: dict[int, int], is_static: Callable[[torch.Tensor], bool]
) -> Readiness:
    """Count the CUDA-graph hazards of one optimizer; `last_ptrs` maps param id -> grad address,
    `is_static` is `torch_compat.static_checker()`."""
    nonstatic = moving = cpu_steps = 0
    capturable: list[tuple[int, bool]] = []
    for index, group in enumerate(optimizer.param_groups):
        on_cuda = False
        for param in group["params"]:
            if not param.is_cuda:
                continue
            on_cuda = True
            grad = param.grad
            if grad is not None:
                if not is_static(grad):
                    nonstatic += 1
                # DTensor (FSDP2): data_ptr() of the wrapper is 0; the shard this rank holds moves.
                ptr = getattr(grad, "_local_tensor", grad).data_ptr()
                if last_ptrs.get(id(param), ptr) != ptr:
                    moving += 1
                last_ptrs[id(param)] = ptr
            step = optimizer.state.get(param, {}).get("step")
            if isinstance(step, torch.Tensor) and not step.is_cuda:
                cpu_steps += 1
        if on_cuda and "capturable" in group:
            capturable.append((index, bool(group["capturable"])))
    return Readiness(nonstatic, moving, tuple(capturable), cpu_steps)


def readiness_hint(r: Readiness) -> str | None:
    """One actionable sentence per optimizer, or None when nothing blocks CUDA graphs."""
    fixes: list[str] = []
    if any(not flag for _group, flag in r.capturable) or r.cpu_step_tensors:
        fixes.append("construct the optimizer with capturable=True (keeps `step` on the GPU)")
    if r.moving_grads:
        fixes.append("call zero_grad(set_to_none=False) so grads keep their addresses")
    if r.nonstatic_grads:
        fixes.append(
            f"mark the {r.nonstatic_grads} grads static with torch._dynamo.mark_static_address "
            "(else each is copied on every graph replay)"
        )
    return "; ".join(fixes) if fixes else None


class _Callbacks:
    """Start/end compile callbacks that `torch._dynamo.reset()` may clear; re-added when missing."""

    def __init__(self, start: Any, end: Any) -> None:
        self.start, self.end = start, end

    def ensure(self) -> None:
        handler = dynamo_compat.callback_handler()
        if self.start not in handler.start_callbacks:
            handler.register_start_callback(self.start)
        if self.end not in handler.end_callbacks:
            handler.register_end_callback(self.end)

    def remove(self) -> None:
        handler = dynamo_compat.callback_handler()
        for remove, callback in ((handler.remove_start_callback, self.start), (handler.remove_end_callback, self.end)):
            with contextlib.suppress(ValueError):
                remove(callback)


class _Tracked:
    __slots__ = ("__weakref__", "grad_ptrs", "hinted", "label", "steps")

    def __init__(self, label: str) -> None:
        self.label = label
        self.steps = 0
        self.grad_ptrs: dict[int, int] = {}
        self.hinted = False


class CudaGraphProbe(Probe):
    name = "cudagraphs"
    commands = frozenset({"cudagraph-dump"})

    def __init__(self, agent: Agent) -> None:
        super().__init__(agent)
        self.every = int_option(
            agent.config.options, "cudagraph_readiness_every", agent.config.optimizer_state_every, minimum=1
        )
        self._callbacks: _Callbacks | None = None
        self._taps: list[LogTap] = []
        self._labels = OptimizerLabels(self.at_death)  # when the optimizer probe is off
        # Per optimizer, kept across disable/enable (as the optimizer probe keeps its labels): a
        # re-install must not give a live optimizer a second label, series and hint.
        self._due_in: dict[int, int] = {}  # id(optimizer) -> steps until its next check
        self._tracked: weakref.WeakKeyDictionary[Optimizer, _Tracked] = weakref.WeakKeyDictionary()
        self._wrapped_seen: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        self._reset_state()

    def _reset_state(self) -> None:
        self._recording_started: float | None = None
        self._trees_dirty = False
        self._trees_seen: tuple[int, ...] = ()  # ids of the tree managers last read
        self._trees_warned = False
        self._frames_warned = False
        self._symint_ids: set[str] = set()  # only on a torch without the tree frames
        # Skip accounting: counter increments no message explains are CPU-device skips.
        self._skip_messages = 0
        self._skip_unexplained = 0
        # Baselines are read when Dynamo is loaded (`_install_with_dynamo`), never before.
        self._skip_last = self._skip_base = 0
        self._nonstatic_last = 0

    def _read_baselines(self) -> None:
        if features.has("dynamo_counters"):
            self._skip_last = self._skip_base = dynamo_compat.dynamo_counter("inductor", "cudagraph_skips")
            self._nonstatic_last = dynamo_compat.dynamo_counter("inductor", "cudagraph_recorded_non_static_inputs")

    def _install(self) -> None:
        # Everything here reads Dynamo or Inductor: wait for the job to import Dynamo
        # (a compile, or its first optimizer step) instead of importing it now.
        self._install_after_import(dynamo_compat.DYNAMO, self._install_with_dynamo)

    def _install_with_dynamo(self) -> None:
        _skip_tracing_once()
        # Tree managers are detected once the job imports their module (`_trees_usable`).
        for feature in features.missing("dynamo_counters", "compile_callbacks", "compile_callback_args"):
            log.warning("cudagraphs probe runs without a torch feature", feature=feature.name, reason=feature.reason)
        self._reset_state()
        self._read_baselines()
        for logger_name in trees_compat.CUDAGRAPH_SKIP_LOGGERS:
            self._tap(logger_name, logging.WARNING, self._on_cudagraphs_record)
        if trees_compat.cuda_present():
            # Only a CUDA process builds graph trees; elsewhere a DEBUG level on
            # torch's logger would be a change with nothing to observe.
            self._tap(trees_compat.CUDAGRAPH_TREES_LOGGER, logging.DEBUG, self._on_trees_record)
            # Inductor imports the tree module when it first records a graph: a job that never
            # uses CUDA graphs (most, though every optimizer step loads Dynamo) gets no zeros.
            self._install_after_import(trees_compat.CUDAGRAPH_TREES, self._start_counters_at_zero)
        if features.has("compilation_metrics_log"):
            self._tap(dynamo_compat.METRICS_LOGGER, logging.INFO, self._on_compile_end)
        if features.has("compile_callbacks") and features.has("compile_callback_args"):
            self._callbacks = _Callbacks(self.guard(self._on_callback_start), self.guard(self._on_callback_end))
            self._callbacks.ensure()
            self._keep(self._callbacks)
        self._checked_step = self.guard(self._after_step)
        self._keep(register_optimizer_step_post_hook(self._every_step))

    def _start_counters_at_zero(self) -> None:
        """Every counter of this probe at 0 (their labels are fixed reason lists), so that a later
        skip or re-record is an increase() from 0 instead of a series born at its first value."""
        self.start_at_zero("cudagraph_skips_total", tuple((reason,) for reason in CUDAGRAPH_SKIP_REASONS))
        self.start_at_zero("cudagraph_rerecords_total", tuple((reason,) for reason in RERECORD_REASONS))
        for family in (
            "cudagraph_recordings_total",
            "cudagraph_warmups_total",
            "cudagraph_rerecord_limit_hits_total",
            "cudagraph_dynamic_shape_warnings_total",
        ):
            self.start_at_zero(family)
        if features.has("dynamo_counters"):  # its only source
            self.start_at_zero("cudagraph_nonstatic_input_copies_total")

    def _tap(self, logger_name: str, level: int, sink: Any) -> None:
        tap = LogTap(logger_name, level, self.guard(sink))
        self._taps.append(tap)
        self._keep(tap)

    def _uninstalled(self) -> None:
        # State stays until the next install resets it (`_install_with_dynamo`): records
        # queued before a detach are folded in after it, in the sender's last batch.
        self._callbacks = None
        self._taps = []

    # -- training thread: compile time and slow CUDA-graph paths ---------------
    def _on_compile_end(self, record: logging.LogRecord) -> None:
        if dynamo_compat.compilation_metrics_of(record.args) is None:
            return
        if self._callbacks is not None:
            self._callbacks.ensure()  # torch._dynamo.reset() clears compile callbacks
        for tap in self._taps:
            tap.refresh()
        self._poll_counters()

    def _on_cudagraphs_record(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.funcName == trees_compat.CUDAGRAPH_SKIP_FUNCTION or message.startswith(
            trees_compat.CUDAGRAPH_SKIP_PREFIX
        ):
            self._skip_messages += 1
            limit = any(marker in message for marker in trees_compat.CUDAGRAPH_RERECORD_LIMIT_MARKERS)
            self.agent.record(self._on_skip, classify_cudagraph_skip(message), message, limit)
        elif message.startswith(trees_compat.CUDAGRAPH_DYNAMIC_SHAPE_WARNING):
            self.agent.record(self._on_dynamic_shape_warning, message)

    def _on_trees_record(self, record: logging.LogRecord) -> None:
        msg = str(record.msg)
        args = record.args if isinstance(record.args, tuple) else ()
        if trees_compat.TREES_WARMUP in msg:
            self.agent.record(self._inc, "cudagraph_warmups_total")
        elif trees_compat.TREES_RERECORD in msg and len(args) >= 4:
            if self._tree_frames() is None:
                # Without the frames: one line per recorded sibling that failed its checks, an over-count.
                self.agent.record(self._on_rerecord, classify_rerecord(str(args[3])), str(args[3]))
        elif trees_compat.TREES_SYMINT_RECORDING in msg and args:
            self._on_new_shape(str(args[0]), msg % args)
        elif trees_compat.TREES_RECORDING in msg:
            frames = self._tree_frames()
            if frames is not None:
                found, reason = trees_compat.caller_local(frames.run, trees_compat.TREES_RERECORD_REASON)
                if found and reason is not None:
                    self.agent.record(self._on_rerecord, classify_rerecord(str(reason)), str(reason))
            if self._callbacks is None:
                self._trees_dirty = True  # no recording callbacks on this torch: count from the log
                self.agent.record(self._inc, "cudagraph_recordings_total")

    def _on_new_shape(self, compile_id: str, detail: str) -> None:
        # The first shape of a compiled graph is its first recording, not a re-record.
        frames = self._tree_frames()
        if frames is not None:
            found, shapes = trees_compat.caller_local(frames.deferred, trees_compat.TREES_SHAPE_CACHE)
            if found:
                if shapes:
                    self.agent.record(self._on_rerecord, "new_dynamic_shape", detail)
                return
        if compile_id in self._symint_ids:  # fallback: forward and backward share a compile id
            self.agent.record(self._on_rerecord, "new_dynamic_shape", detail)
        elif len(self._symint_ids) < MAX_SYMINT_IDS:
            self._symint_ids.add(compile_id)

    def _tree_frames(self) -> trees_compat.TreeFrames | None:
        frames = trees_compat.tree_frames()
        if frames is None and not self._frames_warned:
            self._frames_warned = True
            feature = features.feature("cudagraph_tree_frames")
            log.warning("cudagraphs probe runs without a torch feature", feature=feature.name, reason=feature.reason)
        return frames

    def _on_callback_start(self, args: Any) -> None:
        if dynamo_compat.callback_trigger_name(args) == dynamo_compat.TRIGGER_CUDAGRAPH_RECORDING:
            self._recording_started = time.perf_counter()

    def _on_callback_end(self, args: Any) -> None:
        if (
            dynamo_compat.callback_trigger_name(args) != dynamo_compat.TRIGGER_CUDAGRAPH_RECORDING
            or self._recording_started is None
        ):
            return
        duration = time.perf_counter() - self._recording_started
        self._recording_started = None
        self._trees_dirty = True
        self.agent.record(self._on_recording, duration)
        self._poll_counters()

    def _poll_counters(self) -> None:
        if not features.has("dynamo_counters"):
            return
        now = dynamo_compat.dynamo_counter("inductor", "cudagraph_skips")
        if now < self._skip_last:  # someone cleared counters: rebase, count nothing
            self._skip_base = now - self._skip_messages - self._skip_unexplained
        unexplained = now - self._skip_base - self._skip_messages
        self._skip_last = now
        if unexplained > self._skip_unexplained:
            reason = "other" if trees_compat.cudagraph_policy_set() else "cpu_device"
            self.agent.record(self._on_silent_skips, reason, unexplained - self._skip_unexplained)
            self._skip_unexplained = unexplained
        copies = dynamo_compat.dynamo_counter("inductor", "cudagraph_recorded_non_static_inputs")
        if copies > self._nonstatic_last:
            self.agent.record(self._inc, "cudagraph_nonstatic_input_copies_total", float(copies - self._nonstatic_last))
        self._nonstatic_last = copies

    # -- training thread: every optimizer step (cheap unless due) --------------
    def _every_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        # Not wrapped by `guard`: its Dynamo-disable wrapper costs ~1 us a call,
        # measurable on a fast compiled step. This path is a dict lookup and an
        # int compare that cannot raise; `_skip_tracing_once` below keeps Dynamo from
        # tracing it, and the real work runs guarded. A disabled probe's hook may stay registered (an
        # uninstall inside a hook): it must not start countdowns that only a tracked optimizer's finalizer drops.
        if not self.enabled:
            return
        key = id(optimizer)
        left = self._due_in.get(key, 0) - 1
        if left > 0:
            self._due_in[key] = left
            return
        self._due_in[key] = self.every
        self._checked_step(optimizer, args, kwargs)

    def _after_step(self, optimizer: Optimizer, _args: Any, _kwargs: Any) -> None:
        optimizer_probe = self.agent.probes.get("optimizer")
        if optimizer in getattr(optimizer_probe, "wrapped", ()):
            # Stepped inside a wrapper's step (ZeroRedundancyOptimizer): the wrapper is measured. Its
            # countdown still goes with it, as a tracked optimizer's does.
            if optimizer not in self._wrapped_seen:
                self._wrapped_seen.add(optimizer)
                self.at_death(optimizer, self._due_in.pop, id(optimizer), None)
            return
        tracked = self._tracked.get(optimizer) or self._track(optimizer)
        tracked.steps += 1
        if self._callbacks is not None:
            self._callbacks.ensure()
        readiness = measure_readiness(optimizer, tracked.grad_ptrs, trees_compat.static_checker())
        hint = None
        if not tracked.hinted:
            hint = readiness_hint(readiness)
            tracked.hinted = hint is not None
        self.agent.record(self._on_readiness, tracked.label, readiness, hint)
        self._poll_counters()
        if trees_compat.CUDAGRAPH_TREES in sys.modules and self._trees_usable():
            managers = list(trees_compat.tree_managers())
            seen = tuple(id(manager) for manager in managers)
            # Recordings make the trees dirty; torch._dynamo.reset() drops the managers without a sign.
            if self._trees_dirty or seen != self._trees_seen:
                self._trees_dirty, self._trees_seen = False, seen
                trees, nodes = self._count_trees(managers)
                self.agent.record(self._on_trees, trees, nodes, trees_compat.pool_bytes(managers))

    def _trees_usable(self) -> bool:
        if trees_compat.trees_loaded():
            return True
        if not self._trees_warned:
            self._trees_warned = True
            feature = features.feature("cudagraph_tree_managers")
            log.warning("cudagraphs probe runs without a torch feature", feature=feature.name, reason=feature.reason)
        return False

    @staticmethod
    def _count_trees(managers: list[Any]) -> tuple[int, int]:
        trees = nodes = 0
        for manager in managers:
            t, n = trees_compat.count_tree_nodes(manager)
            trees, nodes = trees + t, nodes + n
        return trees, nodes

    def dump_state(self) -> dict[str, FieldValue]:
        """CUDA-graph tree state for `torchpulse ctl cudagraph-dump`; call on the training thread,
        where the (thread-local) tree manager lives."""
        managers: list[Any]
        if trees_compat.CUDAGRAPH_TREES not in sys.modules:
            managers, trees, nodes = [], 0, 0  # nothing compiled with CUDA graphs here yet
        elif trees_compat.trees_loaded():
            managers = list(trees_compat.tree_managers())
            trees, nodes = self._count_trees(managers)
        else:
            return {"available": False, "reason": "this torch has no CUDA-graph tree managers"}
        skips = dynamo_compat.dynamo_counter("inductor", "cudagraph_skips") if features.has("dynamo_counters") else None
        return {
            "available": True,
            "cuda": trees_compat.cuda_present(),
            "managers": len(managers),
            "trees": trees,
            "nodes": nodes,
            "pool_bytes": trees_compat.pool_bytes(managers),
            "skips_total": skips,
        }

    def _track(self, optimizer: Optimizer) -> _Tracked:
        # One name per optimizer across both probes, also while the optimizer probe is disabled.
        label_of = getattr(self.agent.probes.get("optimizer"), "label_of", self._labels.take)
        tracked = _Tracked(label_of(optimizer))
        self._tracked[optimizer] = tracked
        # The countdown is keyed by id() for the hot path's sake: drop it with the optimizer.
        self.at_death(optimizer, self._due_in.pop, id(optimizer), None)
        return tracked

    # -- agent thread ------------------------------------------------------------
    def _inc(self, family: str, amount: float = 1.0) -> None:
        self.agent.store.inc(family, (), amount)

    def _on_skip(self, reason: str, message: str, rerecord_limit: bool) -> None:
        self.agent.store.inc("cudagraph_skips_total", (reason,))
        if rerecord_limit:
            self.agent.store.inc("cudagraph_rerecord_limit_hits_total", ())
        self.agent.emit("warning", "cudagraphs skipped", reason=reason, detail=message)

    def _on_silent_skips(self, reason: str, count: int) -> None:
        self.agent.store.inc("cudagraph_skips_total", (reason,), float(count))

    def _on_dynamic_shape_warning(self, message: str) -> None:
        self.agent.store.inc("cudagraph_dynamic_shape_warnings_total", ())
        self.agent.emit("warning", "cudagraph dynamic-shape warn limit crossed", detail=message)

    def _on_rerecord(self, reason: str, detail: str) -> None:
        self.agent.store.inc("cudagraph_rerecords_total", (reason,))
        self.agent.emit("info", "cudagraph re-recorded", reason=reason, detail=detail)

    def _on_recording(self, duration: float) -> None:
        self.agent.store.inc("cudagraph_recordings_total", ())
        self.agent.store.observe("cudagraph_recording_duration_seconds", (), duration)

    def _on_trees(self, trees: int, nodes: int, pool: int | None) -> None:
        self.agent.store.set("cudagraph_trees", (), float(trees))
        self.agent.store.set("cudagraph_nodes", (), float(nodes))
        if pool is not None:
            self.agent.store.set("cudagraph_pool_bytes", (), float(pool))

    def _on_readiness(self, label: str, r: Readiness, hint: str | None) -> None:
        store = self.agent.store
        store.set("optimizer_nonstatic_grads", (label,), float(r.nonstatic_grads))
        store.set("optimizer_moving_grads", (label,), float(r.moving_grads))
        store.set("optimizer_cpu_step_tensors", (label,), float(r.cpu_step_tensors))
        for group, flag in r.capturable:
            store.set("optimizer_capturable", (label, str(group)), 1.0 if flag else 0.0)
        if hint is not None:
            self.agent.emit(
                "warning",
                "optimizer is not ready for CUDA graphs",
                optimizer=label,
                hint=hint,
                nonstatic_grads=r.nonstatic_grads,
                moving_grads=r.moving_grads,
                cpu_step_tensors=r.cpu_step_tensors,
            )


@functools.cache
def _skip_tracing_once() -> None:
    # Dynamo treats a skipped function like a disabled one when a compiled
    # `optimizer.step` calls hooks, without a wrapper in eager mode.
    dynamo_compat.skip_tracing(CudaGraphProbe._every_step)
